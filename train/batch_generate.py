"""Continuous-batching generation, for throughput work such as regenerating a dataset with the target.

`batch_size` rows of one static KV cache decode together; a finished row is refilled with the next request at
once (prefilled alone through `KVCache.row`), so one long answer never holds the batch back; once no request waits,
the busy rows are packed together and a step decodes only them. With `keep_hidden` every completion carries the target's
final hidden state at every position of prompt + answer: the features drafters train on, at no extra target forwards.

A request that `continues` the completion just returned (the next turn of a conversation, whose prompt is the
previous prompt + answer + a new user turn) goes into that completion's row and keeps its KV cache for the prefix
the two share: only the new turn is prefilled.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Hashable

import torch
from torch import Tensor

from runtime.speculation.sampling import SamplingParams, sample, warp
from runtime.target.model import Taps, Transformer


@dataclass(frozen=True)
class Request:
    key: Hashable  # the caller's handle, returned with the completion
    prompt: list[int]
    max_new_tokens: int
    continues: Hashable | None = None  # key of the completion this prompt extends: its row's KV is reused


@dataclass(frozen=True)
class Completion:
    key: Hashable
    prompt: list[int]
    tokens: list[int]  # new tokens; ends at the first stop id (included) or after max_new_tokens
    hidden: Tensor | None  # [len(prompt) + len(tokens), dim] final-norm hidden states, with keep_hidden
    stopped: bool  # ended on a stop id (False: cut at max_new_tokens)


@dataclass
class _Row:
    request: Request
    tokens: list[int]
    hidden: list[Tensor] = field(default_factory=list)
    flushing: bool = False  # answer complete; with keep_hidden one more step feeds its last token
    stop_hit: bool = False


@dataclass(frozen=True)
class _Resident:
    """What a row finished since the last fill leaves in its KV cache, for a request that continues it."""
    key: Hashable
    tokens: list[int]  # the tokens cached at slots 0..len-1
    hidden: Tensor | None  # their final hidden states, with keep_hidden


class BatchGenerator:
    def __init__(self, target: Transformer, batch_size: int, params: SamplingParams = SamplingParams(),
                 stop_ids: tuple[int, ...] = (), keep_hidden: bool = False, max_len: int | None = None,
                 generator: torch.Generator | None = None, streams: tuple[int, ...] = ()):
        """`keep_hidden`: every completion carries the target's final hidden state and the residual streams
        entering the `streams` layers, at every position (ForwardOutput.with_streams)."""
        if batch_size < 1:
            raise ValueError(f"BatchGenerator: batch_size={batch_size}, expected >= 1")
        self.target, self.params, self.stop, self.keep_hidden = target, params, set(stop_ids), keep_hidden
        self.streams = streams
        self.generator = generator
        self.cache = target.new_cache(batch_size, max_len or target.max_seq_len)
        self.rows: list[_Row | None] = [None] * batch_size
        self.queue: deque[Request] = deque()
        self.resident: dict[int, _Resident] = {}  # free rows whose cache a continuing request may reuse
        self.prompt_tokens = self.reused_tokens = 0  # over every prefill: prompt tokens, those read from cache

    def submit(self, request: Request) -> None:
        vocab, n = self.target.config.vocab_size, len(request.prompt)
        if n == 0 or request.max_new_tokens < 1:
            raise ValueError(f"request {request.key!r}: empty prompt or max_new_tokens={request.max_new_tokens} < 1")
        if any(not 0 <= t < vocab for t in request.prompt):
            raise ValueError(f"request {request.key!r}: prompt ids outside the vocabulary 0..{vocab - 1}")
        # every new token is fed back once (the last one only to read its hidden state)
        fed = n + request.max_new_tokens - (0 if self.keep_hidden else 1)
        if fed > self.cache.max_len:
            raise ValueError(f"request {request.key!r}: {n} prompt + {request.max_new_tokens} new tokens exceed the "
                             f"cache length {self.cache.max_len}")
        self.queue.append(request)

    @property
    def busy(self) -> bool:
        return bool(self.queue) or any(r is not None for r in self.rows)

    @torch.inference_mode()
    def step(self) -> list[Completion]:
        """Fill free rows, decode one token in every busy row; return the requests that finished."""
        done: list[Completion] = []
        for b, request in self._continuations():  # first, each into the row it continues
            done += self._fill(b, request, self.resident[b])
        for b in range(len(self.rows)):
            while self.rows[b] is None and self.queue:
                done += self._fill(b, self.queue.popleft(), None)
        self.resident.clear()  # packing may overwrite free rows: only the fill right after a finish reuses them
        n = self._pack()
        if n == 0:
            return done
        cache = self.cache.rows_view(0, n)
        tokens = torch.tensor([[row.tokens[-1]] for row in self.rows[:n]], device=self.target.device)
        logits, hidden = self._forward(tokens, cache, cache.lengths[:, None].clone())
        cache.advance(1)
        next_tokens = self._pick(logits[:, 0]).tolist()
        for b in range(n):
            row = self.rows[b]
            if self.keep_hidden:
                row.hidden.append(hidden[b])
            if row.flushing:  # this step only fed the last token
                done.append(self._finish(b, row))
                continue
            self._append(row, next_tokens[b])
            if row.flushing and not self.keep_hidden:
                done.append(self._finish(b, row))
        return done

    def _forward(self, tokens, cache, positions, last_logits_only: bool = False):
        out = self.target(tokens, cache, positions, taps=Taps.entering(self.streams),
                          last_logits_only=last_logits_only)
        return out.logits, out.with_streams(self.streams)

    def _continuations(self) -> list[tuple[int, Request]]:
        """Queued requests that continue a row finished since the last fill, taken off the queue, with that row."""
        row_of = {res.key: b for b, res in self.resident.items()}
        found = [(row_of[r.continues], r) for r in self.queue if r.continues is not None and r.continues in row_of]
        for _, request in found:
            self.queue.remove(request)
        return found

    def _fill(self, b: int, request: Request, resident: _Resident | None) -> list[Completion]:
        row = self._prefill(b, request, resident)
        if row.flushing and not self.keep_hidden:
            return [self._finish(b, row)]
        return []

    def _pack(self) -> int:
        """Move busy rows down into idle ones so that rows 0..n-1 are the busy ones; return n. A decode step then
        computes only those: once the queue runs dry the last answers finish in a shrinking batch rather than
        beside idle rows decoding dummies (a 32-row step costs 2x a 4-row one on 2 CPU cores)."""
        busy = [b for b, r in enumerate(self.rows) if r is not None]
        for dst, src in enumerate(busy):
            if dst != src:
                self.cache.move_row(src, dst)
                self.rows[dst], self.rows[src] = self.rows[src], None
        return len(busy)

    def _prefill(self, b: int, request: Request, resident: _Resident | None) -> _Row:
        """Prefill `request` into row b, reusing the cached prefix it shares with `resident` (at least one prompt
        token is fed: its logits give the first answer token)."""
        n, device = len(request.prompt), self.target.device
        reused = 0 if resident is None else _common_prefix(resident.tokens, request.prompt[:-1])
        view = self.cache.row(b)
        view.lengths.fill_(reused)
        ids = torch.tensor([request.prompt[reused:]], dtype=torch.long, device=device)
        logits, hidden = self._forward(ids, view, torch.arange(reused, n, device=device)[None], last_logits_only=True)
        view.advance(n - reused)
        self.prompt_tokens, self.reused_tokens = self.prompt_tokens + n, self.reused_tokens + reused
        row = _Row(request, [])
        if self.keep_hidden:
            row.hidden += [resident.hidden[:reused], hidden[0]] if reused else [hidden[0]]
        self._append(row, int(self._pick(logits[:, 0])[0]))
        self.rows[b] = row
        return row

    def _append(self, row: _Row, token: int) -> None:
        row.tokens.append(token)
        row.stop_hit = token in self.stop
        row.flushing = row.stop_hit or len(row.tokens) >= row.request.max_new_tokens

    def _pick(self, logits: Tensor) -> Tensor:
        if self.params.greedy:
            return logits.argmax(-1)
        return sample(warp(logits, self.params), self.generator)

    def _finish(self, b: int, row: _Row) -> Completion:
        self.rows[b] = None
        cached = int(self.cache.lengths[b])  # with keep_hidden the last token was fed too
        self.cache.lengths[b] = 0
        hidden = torch.cat(row.hidden) if self.keep_hidden else None
        self.resident[b] = _Resident(row.request.key, (row.request.prompt + row.tokens)[:cached], hidden)
        return Completion(row.request.key, row.request.prompt, row.tokens, hidden, row.stop_hit)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
