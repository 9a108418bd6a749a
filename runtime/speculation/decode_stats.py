"""What one generation measured (Metrics), the clock its phases are timed with, and the counters an engine keeps
while decoding: the adaptive draft depth, the fallback rule and the speed check that read them (DecodeStats)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from runtime.device import synchronizer
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.engine_config import EngineConfig
from runtime.speculation.tree import DraftTree
from runtime.target.attention import kv_reads


@dataclass(frozen=True)
class Metrics:
    prompt_tokens: int
    new_tokens: int
    target_forwards: int  # decode/verify forwards after the prefill
    tau: float  # tokens committed per target forward (1.0 for plain decoding)
    # acceptance_by_depth[d]: P(the node at depth d+1 is accepted | the path reached depth d and the tree
    # offered a node at depth d+1); the per-position acceptance rate of the speculative steps
    acceptance_by_depth: list[float]
    draft_nodes: int  # nodes proposed in total
    prefill_s: float
    draft_s: float  # drafter propose + commit
    verify_s: float  # target forward over root + tree, and verification
    rollback_s: float  # compacting the target KV cache to the accepted path
    rollback_share: float  # rollback_s / total_s
    total_s: float
    tokens_per_s: float  # new tokens / total_s (prefill included)
    fell_back: bool
    fallback_step: int | None  # target forward at which speculation first stopped or paused
    plain_steps: int  # steps decoded plainly while speculating (EngineConfig.speed_check: its timed step, pauses)
    kv_saved: float  # share of the decode/verify forwards' KV reads (layers x kv heads x keys) sparsity skipped

    @property
    def ms_per_forward(self) -> float:
        """ms per decode or verify forward, the prefill left out (0 forwards: the time after the prefill)."""
        return 1e3 * (self.total_s - self.prefill_s) / max(1, self.target_forwards)


def tokens_per_forward(new_tokens: int, generations: int, forwards: int) -> float:
    """tau of `generations` generations: tokens per target forward, leaving out each one's first token, which comes
    from the prefill rather than from a decode or verify step; 1.0 without any such forward."""
    return (new_tokens - generations) / forwards if forwards else 1.0


class Clock:
    """Laps of `now` (seconds, wall clock by default; tests inject their own); waits for the device so a lap is
    charged to the phase that queued the work."""

    def __init__(self, device: torch.device, now: Callable[[], float] = time.perf_counter):
        self.sync, self.now = synchronizer(device), now
        self.start = self.last = now()

    def lap(self) -> float:
        self.sync()
        now = self.now()
        lap, self.last = now - self.last, now
        return lap

    def total(self) -> float:
        self.sync()
        return self.now() - self.start


class DecodeStats:
    """Counters of one generation, and the adaptive draft depth, fallback rule and speed check that read them."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.forwards = self.spec_steps = self.draft_nodes = 0
        self.draft_s = self.verify_s = self.rollback_s = 0.0
        self.offered = [0] * cfg.budget.depth  # steps whose path reached depth d with a child at depth d+1
        self.taken = [0] * cfg.budget.depth  # of those, steps that accepted a node at depth d+1
        self.ema_accepted = float(cfg.budget.depth)  # optimistic start: draft fully until evidence says not to
        self.fallback_step: int | None = None
        self.kv_reads = self.kv_dense_reads = 0
        # EngineConfig.speed_check: the drafted steps of the current run of them (seconds and tokens after its first,
        # which also drafts over what came before), the latest plain step's seconds, and the pause under way
        self.run_steps, self.run_s, self.run_tokens = 0, 0.0, 0
        self.plain_step_s: float | None = None
        self.pause_left, self.next_pause, self.plain_steps = 0, max(cfg.warmup_steps, 1), 0

    def budget(self, room: int) -> DraftBudget:
        b, cfg = self.cfg.budget, self.cfg
        depth = b.depth
        if cfg.adaptive:  # one node beyond what recent steps accepted: room to grow, little wasted work
            depth = max(cfg.min_depth, min(b.depth, math.ceil(self.ema_accepted) + 1))
        depth = min(depth, room)
        nodes = min(room, max(depth, b.max_nodes * depth // b.depth))
        return DraftBudget(depth=depth, width=b.width, nodes=nodes)

    def record(self, tree: DraftTree, accepted: list[int]) -> None:
        self.forwards += 1
        if not len(tree):
            return
        self.spec_steps += 1
        self.draft_nodes += len(tree)
        children = tree.children()
        path_rows = [0] + [i + 1 for i in accepted]
        for d, row in enumerate(path_rows[: len(self.offered)]):
            if children[row]:  # the tree offered a node at depth d+1 below the accepted path
                self.offered[d] += 1
                self.taken[d] += d < len(accepted)
        self.ema_accepted = self.cfg.ema_decay * self.ema_accepted + (1 - self.cfg.ema_decay) * len(accepted)

    def count_reads(self, keep: list[torch.Tensor | None] | None, n_live: int, n_layers: int, n_kv_heads: int) -> None:
        """One verify forward: every layer's kv heads read each live key, sparse layers only the kept ones."""
        if keep is None:
            reads = dense = n_layers * n_kv_heads * n_live
        else:
            device = next(k.device for k in keep if k is not None)
            reads, dense = kv_reads(keep, torch.ones(1, n_live, dtype=torch.bool, device=device), n_kv_heads)
        self.kv_reads += reads
        self.kv_dense_reads += dense

    def plain_next(self) -> bool:
        """EngineConfig.speed_check: whether the next step decodes plainly, to time it or to pause speculation."""
        warm = self.run_steps >= max(self.cfg.warmup_steps, 2)
        return self.cfg.speed_check and (self.pause_left > 0 or warm and self.plain_step_s is None)

    def time_step(self, tree: DraftTree, tokens: int, seconds: float, plain: bool) -> None:
        """A step's seconds and the tokens it committed, after record(); a drafted run that commits fewer tokens a
        second than the latest plain step pauses, a pause twice as long as the one before."""
        if plain:
            self.plain_steps += 1
            self.plain_step_s = seconds
            if self.pause_left:
                self.pause_left -= 1
                if not self.pause_left:  # a fresh run of drafted steps
                    self.run_steps, self.run_s, self.run_tokens = 0, 0.0, 0
        elif len(tree):
            self.run_steps += 1
            if self.run_steps > 1:
                self.run_s += seconds
                self.run_tokens += tokens
        losing = self.plain_step_s is not None and self.run_tokens > 0 and not self.pause_left and \
            self.run_steps >= self.cfg.warmup_steps and self.run_s / self.run_tokens > self.plain_step_s
        if losing:
            self.pause_left, self.next_pause = self.next_pause, 2 * self.next_pause
            self.fallback_step = self.fallback_step or self.forwards

    def should_fall_back(self) -> bool:
        cfg = self.cfg
        if cfg.adaptive and self.spec_steps >= cfg.warmup_steps and 1 + self.ema_accepted < cfg.fallback_tau:
            self.fallback_step = self.fallback_step or self.forwards
            return True
        return False

    def metrics(self, prompt_tokens: int, new_tokens: int, prefill_s: float, total_s: float) -> Metrics:
        return Metrics(
            prompt_tokens=prompt_tokens, new_tokens=new_tokens, target_forwards=self.forwards,
            tau=tokens_per_forward(new_tokens, 1, self.forwards),
            acceptance_by_depth=[t / o for t, o in zip(self.taken, self.offered) if o],
            draft_nodes=self.draft_nodes, prefill_s=prefill_s, draft_s=self.draft_s, verify_s=self.verify_s,
            rollback_s=self.rollback_s, rollback_share=self.rollback_s / total_s, total_s=total_s,
            tokens_per_s=new_tokens / total_s,
            fell_back=self.fallback_step is not None, fallback_step=self.fallback_step, plain_steps=self.plain_steps,
            kv_saved=1 - self.kv_reads / self.kv_dense_reads if self.kv_dense_reads else 0.0)
