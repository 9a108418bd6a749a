"""Every drafter kind drafts for a batch: one place that turns a kind's Drafter into a BatchDrafter.

A kind whose draft forwards batch (Drafter.batched) drafts every row in one forward a depth; any other kind drafts
with one Drafter per row, each with its own state, proposing and committing in turn. Both are what the batch engine
drives; a row's trees are what its kind's Drafter would propose for that sequence alone.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.drafter import BatchDrafter, Drafter
from runtime.speculation.sampling import SamplingParams
from runtime.speculation.tree import DraftTree


class PerRowDrafters(BatchDrafter):
    """One Drafter per row, made by `new_drafter` when a row first needs one."""

    def __init__(self, new_drafter: Callable[[], Drafter], rows: int, first: Drafter | None = None,
                 prepare: Callable[[Drafter], None] = lambda d: None):
        self.new_drafter, self.prepare = new_drafter, prepare
        self.drafters: list[Drafter | None] = [first] + [None] * (rows - 1)
        self.row_cache: Callable[[int], Any] | None = None  # read_target_cache's
        if first is not None:
            prepare(first)
        probe = first or self._at(0)
        self.vocab_size, self.needs_features = probe.vocab_size, probe.needs_features
        self.feature_layers = probe.feature_layers

    def _at(self, row: int) -> Drafter:
        if self.drafters[row] is None:
            self.drafters[row] = self.new_drafter()
            self.prepare(self.drafters[row])
            self._bind(row)
        return self.drafters[row]

    def _bind(self, row: int) -> None:
        """Row's drafter reads the target's cache of that row, where it can and the engine offers it."""
        if self.row_cache is not None and self.drafters[row] is not None:
            self.drafters[row].read_target_cache(self.row_cache(row))

    def read_target_cache(self, row_cache: Callable[[int], Any]) -> None:
        self.row_cache = row_cache
        for row in range(len(self.drafters)):
            self._bind(row)

    def reset(self, row: int, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        self._at(row).reset(tokens, features)

    def propose(self, rows: list[int], budgets: list[DraftBudget], params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[DraftTree]:
        return [self._at(r).propose(b, p, g) for r, b, p, g in zip(rows, budgets, params, generators)]

    def commit(self, rows: list[int], tokens: list[torch.Tensor], features: list[torch.Tensor | None]) -> None:
        for r, t, f in zip(rows, tokens, features):
            self._at(r).commit(t, f)

    def move(self, src: int, dst: int) -> None:
        self.drafters[dst], self.drafters[src] = self.drafters[src], self.drafters[dst]
        self._bind(dst)  # the engine moved the row's cache too
        self._bind(src)


def batch_drafter(new_drafter: Callable[[], Drafter], rows: int, static: tuple[bool, bool] | None = None,
                  first: Drafter | None = None) -> BatchDrafter:
    """The BatchDrafter of `new_drafter`'s kind for `rows` rows: its batched form where it has one (and `static` is
    None: batched forwards have no static step yet), else one drafter per row (`first`, if given, is row 0's).
    `static`: (use_graph, compile) for Drafter.use_static, each row's draft steps at static shapes."""
    first = first or new_drafter()
    batched = first.batched(rows) if static is None else None
    if batched is not None:
        return batched
    prepare = (lambda d: d.use_static(*static)) if static is not None else (lambda d: None)
    return PerRowDrafters(new_drafter, rows, first, prepare)
