"""One request's reply, from the scheduler's thread to the server's event loop: the scheduler hands each committed
token over as it lands, and the event loop turns them into text (pipeline.serving.text_stream) without ever
blocking on the batch. Streamed and whole replies both read it, so they say the same."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pipeline.serving.served_model import ServedModel
from pipeline.serving.text_stream import TextStream

_DONE = None  # the queue's last item: every row has finished or failed


@dataclass(frozen=True)
class Ask:
    """What a request asks for, checked (pipeline.serving.openai_api builds it)."""
    ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None


class Reply:
    """Submitted at construction (QueueFull or ValueError raised at once); `pieces()` yields its text."""

    def __init__(self, served: ServedModel, ask: Ask):
        import torch

        from runtime.serving.batch_engine import BatchRequest
        from runtime.speculation.sampling import SamplingParams

        self.served, self.ask = served, ask
        self.started = time.perf_counter()
        self.first_token_s: float | None = None  # seconds from submission to the first token
        self.last_token_at = self.started
        self.ids: list[int] = []  # committed tokens received (the stop id included)
        self.finish_reason: str | None = None  # stop | length, once the reply has ended
        self._ended_on_stop_id = False
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        device = served.engine.target.device
        generator = None if ask.seed is None else torch.Generator(device).manual_seed(ask.seed)
        request = BatchRequest(None, ask.ids, ask.max_tokens, SamplingParams(ask.temperature, ask.top_p),
                               served.stop_ids, generator)
        self.pending = served.scheduler.submit([request], on_tokens=lambda _, t: self._post(t),
                                               on_done=lambda: self._post(_DONE))

    def _post(self, item) -> None:
        """(Scheduler thread.) Hand `item` to the event loop; a loop already closed has nobody to read it."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            pass

    async def pieces(self) -> AsyncIterator[str]:
        """The reply's text as it becomes final, each piece non-empty. Raises RequestTimedOut past the deadline
        (its rows leave the batch) or SchedulerError if a step failed. Stops the request early when a stop string
        appears, and whenever the caller stops reading (a client that went away)."""
        text = TextStream(self.served.tokenizer, self.ask.stop)
        try:
            while True:
                try:
                    item = await asyncio.wait_for(self._queue.get(), max(0.0, self.pending.deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    self.pending.result()  # past the deadline: raises RequestTimedOut, unless it just finished
                    continue
                if item is _DONE:
                    self.pending.result()  # raises the engine's error, if that is how it ended
                    piece = text.finish()
                    self.finish_reason = "stop" if self._ended_on_stop_id or text.stopped else "length"
                    if piece:
                        yield piece
                    return
                self._count(item)
                piece = text.push(item)
                if piece:
                    yield piece
                if text.stopped:
                    self.pending.cancel()
                    self.finish_reason = "stop"
                    return
        finally:
            self.pending.cancel()  # no-op once finished; frees the rows of a reply nobody reads any more

    def _count(self, tokens: list[int]) -> None:
        now = time.perf_counter()
        if self.first_token_s is None:
            self.first_token_s = now - self.started
        self.ids += tokens
        self.last_token_at = now
        self._ended_on_stop_id = tokens[-1] in self.served.stop_ids

    @property
    def time_per_output_token(self) -> float | None:
        """Seconds per token after the first; None for a reply of one token."""
        if self.first_token_s is None or len(self.ids) < 2:
            return None
        return (self.last_token_at - self.started - self.first_token_s) / (len(self.ids) - 1)
