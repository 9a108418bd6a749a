"""Replayed verification: a draft budget's tau for the cost of its drafting alone.

Greedy speculative decoding is lossless, so every budget commits the tokens the target's own greedy reply holds:
once that reply is known, a verify needs no target forward. A ReplayTarget stands in for the target in an Engine
and answers each forward from the reply: row r's logits point at the reply's token after r's position, its hidden
state is the target's at that position (one forward over prompt and reply). The node a greedy verify accepts is
then the one the target's would accept, and everything else runs as served and is timed by the engine: the
drafter, the lookup branch, the cap, adaptive depth, the cache's rollback. Only the verify's forward is skipped;
the ReplayTarget records each one's row count, to be charged at measured step costs (export.calibrate.predict).

Hidden states from one forward over the whole reply can differ in the last bits from those of a step at a time,
which may flip a near-tie among the drafter's candidates: a replayed tau is a prediction, close to the real one.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch

from runtime.speculation.decode_stats import tokens_per_forward
from runtime.speculation.engine import Engine
from runtime.speculation.sampling import SamplingParams
from runtime.target.kv_cache import KVCache
from runtime.target.model import ForwardOutput, Taps, Transformer


@dataclass(frozen=True)
class Reference:
    prompt: list[int]
    reply: list[int]  # the target's greedy reply: new tokens, ending at a stop id or at the length asked for
    hidden: torch.Tensor  # [len(prompt) + len(reply), features] what the drafter reads of the target, every position
    prefill_s: float  # the real engine's prefill of this prompt


@torch.inference_mode()
def reference(engine: Engine, prompt: list[int], new_tokens: int, stop_ids: tuple[int, ...]) -> Reference:
    """The reply `engine` (any greedy budget of the target: all give the same tokens) generates, and what its
    drafter reads of the target (the hidden states or the streams it fuses) over prompt and reply."""
    g = engine.generate(prompt, new_tokens, SamplingParams(), None, stop_ids)
    ids = torch.tensor([prompt + g.tokens], device=engine.target.device)
    out = engine.target(ids, engine.target.new_cache(1, ids.shape[1]), torch.arange(ids.shape[1])[None].to(
        ids.device), taps=engine.taps, no_logits=True)
    return Reference(prompt, g.tokens, out.features(engine.features)[0], g.metrics.prefill_s)


class ReplayTarget:
    """What an Engine reads of its target, answering every forward from a Reference (see the module docstring).
    `verify_rows` counts the forwards after each prefill by their row count, `verify_s` the time spent answering
    them (not the engine's own: the replay subtracts it)."""

    def __init__(self, target: Transformer):
        self.target, self.config, self.max_seq_len = target, target.config, target.max_seq_len
        self.device, self.dtype = target.device, target.dtype
        self.verify_rows: Counter[int] = Counter()
        self.verify_s = 0.0
        self.sequence = torch.zeros(0, dtype=torch.long)
        self.hidden = torch.zeros(0, target.config.dim)

    def load(self, ref: Reference) -> None:
        self.sequence = torch.tensor(ref.prompt + ref.reply, device=self.device)
        self.hidden = ref.hidden

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache:
        return self.target.new_cache(batch, max_len)

    def prefill(self, tokens: torch.Tensor, cache, *, chunk: int | None = None, features: tuple[int, ...] | None = (),
                progress=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Transformer.prefill's answer from the reference: the prompt's last logits and the drafter's features."""
        positions = cache.lengths[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
        out = self(tokens, cache, positions, taps=Taps.entering(features or ()), last_logits_only=True)
        cache.advance(tokens.shape[1])
        return out.logits, None if features is None else out.features(features)

    def __call__(self, tokens: torch.Tensor, cache, positions: torch.Tensor, tree_mask: torch.Tensor | None = None,
                 *, taps: Taps = Taps(), last_logits_only: bool = False, kv_keep=None) -> ForwardOutput:
        """Transformer.forward's answer; of the hidden states only what the drafter reads, which `taps` asks for."""
        start, last = time.perf_counter(), len(self.sequence) - 1
        cache.slots(tokens.shape[1])  # as a forward takes them: a quantised history's window grows to hold them
        position = positions[0].clamp(max=last)
        # a row past the reply's end follows its stop id: whatever it predicts is cut from the reply
        after = (position[-1:] if last_logits_only else position) + 1
        logits = torch.zeros(1, after.numel(), self.config.vocab_size, device=self.device)
        logits[0, torch.arange(after.numel()), self.sequence[after.clamp(max=last)]] = 1.0
        if not last_logits_only:
            self.verify_rows[tokens.shape[1]] += 1
            self.verify_s += time.perf_counter() - start
        read = self.hidden[position][None]
        streams = taps.hidden_layers  # the reference holds them concatenated, as ForwardOutput.features gives them
        if not streams:
            return ForwardOutput(logits, read)
        return ForwardOutput(logits, None, dict(zip(streams, read.split(self.config.dim, -1))))


def replay(target: ReplayTarget, engine: Engine, refs: list[Reference], new_tokens: int,
           stop_ids: tuple[int, ...]) -> dict:
    """Run `engine` (built on `target`) greedily on every reference. Returns tau, the forwards and new tokens, the
    seconds the engine spent drafting, rolling back and around its verify forwards (building their inputs, reading
    the verdict), and the verify forwards by row count."""
    target.verify_rows, target.verify_s = Counter(), 0.0
    forwards = tokens = 0
    draft_s = rollback_s = verify_s = 0.0
    for ref in refs:
        target.load(ref)
        g = engine.generate(ref.prompt, new_tokens, SamplingParams(), None, stop_ids)
        if g.tokens != ref.reply:  # the replayed verify commits the reply by construction
            raise RuntimeError(f"replay: the engine committed {g.tokens[:8]}... against the reply {ref.reply[:8]}...")
        m = g.metrics
        forwards, tokens = forwards + m.target_forwards, tokens + m.new_tokens
        draft_s, rollback_s, verify_s = draft_s + m.draft_s, rollback_s + m.rollback_s, verify_s + m.verify_s
    return {"tau": tokens_per_forward(tokens, len(refs), forwards), "prompts": len(refs), "forwards": forwards,
            "new_tokens": tokens, "draft_s": draft_s, "rollback_s": rollback_s,
            "overhead_s": max(0.0, verify_s - target.verify_s), "verify_rows": dict(sorted(target.verify_rows.items()))}
