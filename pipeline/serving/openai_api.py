"""OpenAI's request and response shapes for /v1/completions and /v1/chat/completions, as far as this server
implements them; a request that asks for what it does not (n > 1, logprobs, tools) is refused by name rather than
silently answered otherwise."""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 4  # as OpenAI's API


class ApiError(Exception):
    """A request refused with an HTTP status, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Sampling(BaseModel):
    # fields a client may send that change nothing here are ignored, as OpenAI ignores unknown ones
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default: sampled
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: Literal[1] = 1
    logprobs: Literal[False, None] = None

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(..., description="text, or token ids of the target's vocabulary")
    echo: Literal[False] = False

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if not v:
            raise ValueError("the prompt is empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str | list[dict]

    def text(self) -> str:
        """The message's text: a string, or the text parts of a list of content parts."""
        if isinstance(self.content, str):
            return self.content
        if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in self.content):
            raise ApiError(400, "only text content parts ({'type': 'text', 'text': ...}) are served", param="messages")
        return "".join(part["text"] for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    tools: None = None

    def length(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, text: str, finish: str | None, chat: bool, created: int,
                    stream: bool = False, first: bool = False) -> dict:
    """One completion (stream: one chunk of it) for the completions or chat endpoint."""
    if chat:
        key = "delta" if stream else "message"
        message = ({"role": "assistant", "content": text} if first or not stream else {"content": text})
        choice = {"index": 0, key: message, "finish_reason": finish}
        kind = "chat.completion.chunk" if stream else "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}


def model_list(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                        "owned_by": "draftsmith"}]}


def now() -> int:
    return int(time.time())
