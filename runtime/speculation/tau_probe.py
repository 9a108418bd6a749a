"""How the stages measure a drafter's real tau: greedy speculative generation through the engine."""
from __future__ import annotations

from dataclasses import dataclass

from runtime.drafters.ngram import NgramDrafter
from runtime.speculation.decode_stats import tokens_per_forward
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.drafter import Drafter
from runtime.speculation.engine import Engine, EngineConfig
from runtime.speculation.sampling import SamplingParams
from runtime.target.attention import SpecAttnConfig
from runtime.target.model import Transformer
from runtime.target.quant_kv_cache import KVQuant


@dataclass(frozen=True)
class TauProbe:
    """Up to `new_tokens` per prompt, greedy, with the draft budget and no fallback, ending at a stop id as serving
    does."""
    prompts: list[list[int]]
    budget: DraftBudget
    new_tokens: int
    stop_ids: tuple[int, ...] = ()

    def measure(self, target: Transformer, drafter: Drafter, sparse: SpecAttnConfig | None = None,
                kv: KVQuant | None = None, lookup: int = 0, corpus: NgramDrafter | None = None) -> dict:
        """With `sparse` the target verifies with SpecAttn, and the KV reads it saved (mean over prompts) are
        reported too; with `kv` the target's and the drafter's KV histories are quantised; with `lookup` the n-gram
        lookup branch joins the drafter's trees, drafting from `corpus` where a reply has no match."""
        engine = Engine(target, drafter, EngineConfig(
            max_seq_len=target.max_seq_len, budget=self.budget, adaptive=False, sparse=sparse,
            kv_scheme=kv and kv.scheme, kv_recent=kv.recent if kv else EngineConfig.kv_recent, lookup=lookup,
            lookup_corpus=corpus))
        forwards = tokens = 0
        saved = []
        for ids in self.prompts:
            m = engine.generate(ids, self.new_tokens, SamplingParams(), None, self.stop_ids).metrics
            forwards, tokens = forwards + m.target_forwards, tokens + m.new_tokens
            saved.append(m.kv_saved)
        tau = {"tau": tokens_per_forward(tokens, len(self.prompts), forwards), "tau_prompts": len(self.prompts),
               "tau_tokens": tokens - len(self.prompts)}
        return tau if sparse is None else {**tau, "kv_saved": sum(saved) / max(len(saved), 1)}
