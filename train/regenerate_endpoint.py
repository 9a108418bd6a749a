"""Self-distillation through an OpenAI-compatible server (vLLM, SGLang, `pipeline serve --openai`): the regeneration
of train.regenerate with the target behind `/v1/chat/completions` instead of in this process.

Turns are regenerated in order as there. Each reply's text is re-tokenised with the target tokenizer where the chat
template puts it, so a row is laid out as the local path's: the templated prompt, the answer's ids, and the
end-of-sequence id when the server stopped there. `concurrency` conversations are in flight; the openai client
retries 408/409/429/5xx, timeouts and refused connections with exponential backoff (honouring Retry-After).
Finished conversations go to resumable shards (train.shards) every `shard_rows` or every few seconds, and on any
error or interrupt, so a rerun asks only for the conversations not yet written.
"""
from __future__ import annotations

import asyncio
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from train.data import tokenize_prompt
from train.regenerate import RegenSettings, opening_at_user
from train.shards import Row, ShardWriter, done_keys

FLUSH_S = 5.0  # at most this much finished work is lost to a kill -9
RETRIED_STATUS = {408, 409, 429} | set(range(500, 600))  # what the openai client retries


@dataclass(frozen=True)
class Endpoint:
    url: str  # base URL, ending in /v1
    model: str | None  # None: the only model GET /v1/models lists
    api_key: str | None
    concurrency: int
    retries: int
    timeout_s: float


class EndpointError(RuntimeError):
    """The endpoint refused a request or could not be reached after the retries: one line for the user."""


@dataclass
class _Progress:
    bar: tqdm
    requests: int = 0
    retried: int = 0  # answers the client retried (429, 5xx)
    tokens: int = 0

    def show(self) -> None:
        self.bar.set_postfix(requests=self.requests, retried=self.retried, tokens=self.tokens, refresh=False)


def regenerate_via_endpoint(endpoint: Endpoint, tokenizer, conversations: list[list[dict]], work: Path,
                            s: RegenSettings, eos_id: int | None) -> str:
    """Regenerate `conversations` into shards under `work` (resuming a killed run); read them with merge_shards.
    Returns the model id asked."""
    return asyncio.run(_regenerate(endpoint, tokenizer, conversations, work, s, eos_id))


async def _regenerate(endpoint: Endpoint, tokenizer, conversations: list[list[dict]], work: Path, s: RegenSettings,
                      eos_id: int | None) -> str:
    import openai

    done = done_keys(work)
    remaining = [(i, opening_at_user(turns)) for i, turns in enumerate(conversations) if i not in done]
    if not remaining:  # a rerun after every conversation was written: nothing to ask
        return endpoint.model or ""
    todo = iter(remaining)
    progress = _Progress(tqdm(total=len(conversations), initial=len(done), desc="prepare: regenerate via endpoint",
                              unit="conv", mininterval=2.0))

    async def count_retried(response):
        progress.retried += response.status_code in RETRIED_STATUS

    http = openai.DefaultAsyncHttpxClient(event_hooks={"response": [count_retried]})
    client = openai.AsyncOpenAI(base_url=endpoint.url, api_key=endpoint.api_key or "none", http_client=http,
                                max_retries=endpoint.retries, timeout=endpoint.timeout_s)
    writer, flushed = ShardWriter(work, s.shard_rows), [time.monotonic()]

    async def worker():
        for key, turns in todo:  # one shared iterator: each conversation goes to one worker
            row = await _conversation(client, model, tokenizer, key, turns, s, eos_id, progress)
            if row is None:
                writer.drop(key, "no assistant turn fits")
            elif sum(row.mask) >= s.min_assistant_tokens:
                writer.add(row)
            else:
                writer.drop(key, "too_few_assistant_tokens")
            if time.monotonic() - flushed[0] >= FLUSH_S:
                writer.flush()
                flushed[0] = time.monotonic()
            progress.bar.update(1)
            progress.show()

    tasks: list[asyncio.Task] = []
    try:
        model = endpoint.model or await _only_model(client, endpoint)
        tasks = [asyncio.create_task(worker()) for _ in range(min(endpoint.concurrency, len(remaining)))]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
        if failed:
            raise failed[0]
        return model
    except openai.APIError as e:
        raise EndpointError(explain(e, endpoint)) from None
    finally:
        for task in tasks:  # on an error or an interrupt the others stop where they are; theirs stay to do
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        writer.flush()  # whatever finished is kept
        progress.bar.close()
        await client.close()


async def _only_model(client, endpoint: Endpoint) -> str:
    ids = [m.id for m in (await client.models.list()).data]
    if len(ids) != 1:
        raise EndpointError(f"{endpoint.url} serves the models {ids}: name one in data.regen_model")
    return ids[0]


async def _conversation(client, model: str, tokenizer, key: int, turns: list[dict], s: RegenSettings,
                        eos_id: int | None, progress: _Progress) -> Row | None:
    """Regenerate every assistant turn of `turns` in order; the row of the last answer, or None when none fits."""
    row = None
    for k in [k for k, t in enumerate(turns) if t["role"] == "assistant"]:
        encoded = tokenize_prompt(tokenizer, turns[:k], s.max_length - s.min_assistant_tokens)
        if encoded is None:
            break
        prompt, prompt_mask = encoded
        budget = min(s.max_new_tokens, s.max_length - len(prompt))
        extra = {} if s.params.greedy else {"seed": zlib.crc32(f"{s.seed}:{key}:{k}".encode()) & 0x7FFFFFFF}
        reply = await client.chat.completions.create(model=model, messages=turns[:k], max_tokens=budget,
                                                     temperature=s.params.temperature, **extra)
        progress.requests += 1
        if not reply.choices or reply.choices[0].message.content is None:
            raise EndpointError(f"{client.base_url}: a reply without a message (conversation {key}, turn {k})")
        text = reply.choices[0].message.content
        answer, stopped = answer_ids(tokenizer, turns[:k], prompt, text, reply.choices[0].finish_reason == "stop",
                                     eos_id, budget)
        progress.tokens += len(answer)
        row = Row(key, prompt + answer, prompt_mask + [1] * len(answer))
        turns[k] = {"role": "assistant", "content": text}
        if not stopped:  # cut by the budget: a follow-up turn would answer a truncated reply
            break
    return row


def answer_ids(tokenizer, history: list[dict], prompt: list[int], text: str, stopped: bool, eos_id: int | None,
               budget: int) -> tuple[list[int], bool]:
    """A reply's ids as the target tokenizer reads its text after the templated `history` (whose ids are `prompt`),
    plus `eos_id` when the server stopped on it, cut to `budget`; and whether it still ends stopped."""
    opened = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    joint = tokenizer(opened + text, add_special_tokens=False).input_ids
    if joint[:len(prompt)] == prompt:
        ids = joint[len(prompt):]
    else:  # the reply's first characters merge with the prompt's last: read the reply alone
        ids = tokenizer(text, add_special_tokens=False).input_ids
    if stopped and eos_id is not None:
        ids = ids + [eos_id]
    if len(ids) > budget:
        return ids[:budget], False
    return ids, stopped


def explain(e: Exception, endpoint: Endpoint) -> str:
    """One line for an openai client error, after its retries."""
    import openai

    retried = f"after {endpoint.retries} retries" if endpoint.retries else "with retries off"
    if isinstance(e, openai.APITimeoutError):
        return f"{endpoint.url}: no answer within {endpoint.timeout_s:g} s, {retried}"
    if isinstance(e, openai.APIConnectionError):
        cause = str(e.__cause__ or e).replace("\n", " ")
        return f"{endpoint.url}: unreachable, {retried} ({cause})"
    if isinstance(e, openai.APIStatusError):
        said = e.body.get("message") if isinstance(e.body, dict) else None  # OpenAI's and vLLM's error shapes
        message = " ".join(str(said or e.message).split())
        when = f", {retried}" if e.status_code in RETRIED_STATUS else ""
        return f"{endpoint.url}: HTTP {e.status_code}{when}: {message}"
    return f"{endpoint.url}: {type(e).__name__}: {e}"
