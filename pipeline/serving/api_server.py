"""The OpenAI-compatible server over a loaded drafter (pipeline.serving.served_model): /v1/completions and
/v1/chat/completions, whole or streamed as server-sent events token by token, /v1/models, /health and /metrics.

Every request goes through the scheduler's batch (one thread owns the engine); the event loop only submits, reads
tokens as they land and writes them out, so it never waits on a step. Errors use OpenAI's shape: 400 for bad input,
401 without the API key (when one is set; such a request is neither logged nor counted by prompt), 429 when the
queue is full, 504 past the request timeout. A client that goes away mid-stream has its rows dropped at the next
step.
"""
from __future__ import annotations

import hmac
import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from pipeline.serving.capture import Captured, TrafficCapture
from pipeline.serving.drift import DriftMonitor, DriftSettings
from pipeline.serving.metrics import ServingMetrics
from pipeline.serving.openai_api import (ApiError, ChatCompletionRequest, CompletionRequest, completion_body,
                                         model_list, new_id, now, usage)
from pipeline.serving.reply import Ask, Reply
from pipeline.serving.retrain_trigger import RetrainTrigger
from pipeline.serving.served_model import ServedModel

CLIENT_GONE = 499  # the status counted for a stream its client closed early (nginx's)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models")  # the request counter's endpoint labels


def _ask(served: ServedModel, body, ids: list[int], max_tokens: int | None) -> Ask:
    """The request's ids and settings, checked against the served context: a 400 for what cannot run."""
    from runtime.target.model_config import context_error

    vocab = served.engine.target.config.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise ApiError(400, f"prompt token ids must lie in 0..{vocab - 1}", param="prompt")
    room = served.max_seq_len - len(ids) + 1  # the last new token needs no cache slot
    length = max_tokens if max_tokens is not None else max(1, min(served.max_new_tokens, room))
    overflow = context_error(len(ids), length, served.max_seq_len, "the served context of max_seq_len")
    if overflow:
        raise ApiError(400, f"{overflow}: send a shorter prompt or a smaller max_tokens", code="context_length_exceeded",
                       param="max_tokens" if max_tokens is not None and len(ids) < served.max_seq_len else "prompt")
    return Ask(ids, length, body.temperature, body.top_p, body.stop_strings(), body.seed)


def _chat_ids(served: ServedModel, body: ChatCompletionRequest) -> list[int]:
    tok = served.tokenizer
    if not tok.chat_template:
        raise ApiError(400, "the served model's tokenizer has no chat template: use /v1/completions")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # the template's own refusal (say, roles that must alternate) is the client's to fix
        raise ApiError(400, f"the chat template refused these messages: {e}", param="messages") from None
    return tok(text, add_special_tokens=False).input_ids


def build_app(served: ServedModel, model_id: str, *, api_key: str | None = None, validated_tau: float | None = None,
              drift: DriftSettings = DriftSettings(), capture: TrafficCapture | None = None,
              retrain: RetrainTrigger | None = None) -> FastAPI:
    """The server's app; `validated_tau`: the bundle's, from its registered validation metrics; `capture`: where
    answered requests are recorded (None: nowhere); `retrain`: what the drift alert triggers (None: nothing)."""
    from runtime.serving.scheduler import QueueFull, RequestTimedOut, SchedulerError

    app = FastAPI(title="draftsmith", docs_url=None, redoc_url=None, openapi_url=None)
    monitor = DriftMonitor(served.engine.counters, validated_tau, drift, retrain.fire if retrain else None)
    metrics = ServingMetrics(served, monitor)
    if retrain is not None:
        metrics.count_outcomes("retrain_triggers", "retraining DAG runs the drift alert triggered, by outcome",
                               retrain.outcomes)
    created = now()
    app.state.served, app.state.metrics, app.state.drift = served, metrics, monitor
    if capture is not None:
        metrics.watch("capture_dropped", "answered requests traffic capture could not record",
                      lambda: capture.dropped)

    def record(endpoint: str, prompt, ask: Ask, reply: Reply, text: str) -> None:
        if capture is not None:
            capture.add(Captured(endpoint, model_id, prompt, ask.ids, text, reply.ids, ask.temperature,
                                 reply.finish_reason))

    def refusal(e: Exception) -> ApiError:
        if isinstance(e, QueueFull):
            return ApiError(429, str(e), kind="server_busy", code="queue_full")
        if isinstance(e, RequestTimedOut):
            return ApiError(504, str(e), kind="timeout", code="request_timed_out")
        if isinstance(e, ValueError):
            return ApiError(400, str(e))
        return ApiError(500, str(e), kind="server_error")

    def error_response(e: ApiError, path: str) -> JSONResponse:
        if path in ENDPOINTS:  # only known paths: a scanner's made-up ones would each add a label
            metrics.count(path, e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(e, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        problems = e.errors()
        if any(p.get("type") == "json_invalid" for p in problems):
            message, param = "the request body is not valid JSON", None
        else:
            where = [".".join(str(x) for x in p.get("loc", ())[1:]) for p in problems]
            message = "; ".join(f"{w or 'body'}: {p.get('msg')}" for w, p in zip(where, problems))
            param = where[0] if where and where[0] else None
        return error_response(ApiError(400, message, param=param), request.url.path)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        return error_response(ApiError(e.status_code, str(e.detail), kind="not_found" if e.status_code == 404 else
                                       "invalid_request_error"), request.url.path)

    @app.middleware("http")
    async def _key(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response(ApiError(401, "a valid API key is required (Authorization: Bearer <key>)",
                                               code="invalid_api_key"), request.url.path)
        return await call_next(request)

    def check_model(name: str) -> None:
        if name != model_id:
            raise ApiError(400, f"model {name!r} is not served here: this server serves {model_id!r}",
                           code="model_not_found", param="model")

    async def answer(endpoint: str, body, prompt, ask: Ask, chat: bool):
        try:
            reply = Reply(served, ask)
        except (SchedulerError, ValueError) as e:
            raise refusal(e) from None
        rid, stamp = new_id("chatcmpl" if chat else "cmpl"), now()
        if body.stream:
            return StreamingResponse(stream(endpoint, prompt, ask, reply, rid, stamp, chat),
                                     media_type="text/event-stream")
        try:
            text = "".join([piece async for piece in reply.pieces()])
        except SchedulerError as e:
            raise refusal(e) from None
        metrics.observe(reply)
        monitor.check()
        metrics.count(endpoint, 200)
        record(endpoint, prompt, ask, reply, text)
        out = completion_body(rid, model_id, text, reply.finish_reason, chat, stamp)
        return JSONResponse(out | {"usage": usage(len(ask.ids), len(reply.ids))})

    async def stream(endpoint: str, prompt, ask: Ask, reply: Reply, rid: str, stamp: int, chat: bool):
        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        first, status, text = True, CLIENT_GONE, []
        try:
            async for piece in reply.pieces():
                yield event(completion_body(rid, model_id, piece, None, chat, stamp, stream=True, first=first))
                first = False
                text.append(piece)
            status = 200
            record(endpoint, prompt, ask, reply, "".join(text))
            yield event(completion_body(rid, model_id, "", reply.finish_reason, chat, stamp, stream=True,
                                        first=first))
            yield "data: [DONE]\n\n"
        except SchedulerError as e:  # the status line has gone out: the error travels as the last event
            error = refusal(e)
            status = error.status
            yield event(error.body())
        finally:  # a client that went away ends here too: its rows leave the batch at the next step
            reply.pending.cancel()
            metrics.observe(reply)
            monitor.check()
            metrics.count(endpoint, status)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        check_model(body.model)
        ids = body.prompt if isinstance(body.prompt, list) else served.tokenizer(body.prompt).input_ids
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", param="prompt")
        return await answer("/v1/completions", body, body.prompt, _ask(served, body, ids, body.max_tokens),
                            chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        check_model(body.model)
        ids = _chat_ids(served, body)
        return await answer("/v1/chat/completions", body, [m.model_dump() for m in body.messages],
                            _ask(served, body, ids, body.length()), chat=True)

    @app.get("/v1/models")
    async def models():
        return model_list(model_id, created)

    @app.get("/health")
    async def health():
        alive = served.scheduler.alive
        return JSONResponse({"status": "ok" if alive else "scheduler stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
