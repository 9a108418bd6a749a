"""How an engine speculates: the draft budget, adaptation and fall-back, the speed check, SpecAttn, quantised KV,
static (graphed) steps, the lookup branch and the draft window, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from runtime.drafters.ngram import Corpus
from runtime.speculation.draft_budget import DraftBudget
from runtime.target.attention import SpecAttnConfig
from runtime.target.quant_kv_cache import KVQuant


@dataclass(frozen=True)
class EngineConfig:
    max_seq_len: int = 2048  # target KV cache length: prompt + new tokens must fit
    budget: DraftBudget = field(default_factory=lambda: DraftBudget(depth=5))
    adaptive: bool = True  # adapt the draft depth to recent acceptance and fall back when drafting does not pay
    min_depth: int = 1
    ema_decay: float = 0.7  # weight of the past in the moving average of accepted tokens per step
    warmup_steps: int = 8  # speculative steps before the fallback rule may fire
    fallback_tau: float = 1.3  # below this average of tokens per target forward, decode plainly
    # after warmup_steps speculative steps, time one plain decode step (on the Engine's clock); while speculation
    # commits fewer tokens a second than that, pause it for warmup_steps plain steps, twice as many after each pause
    # (at a long context a verify costs more than a decode, yet a reply may turn predictable later). Served engines
    # check; a batched engine decides by batch size instead (runtime.serving.budget_tuner).
    speed_check: bool = False
    sparse: SpecAttnConfig | None = None  # SpecAttn sparse verification; None: dense
    kv_scheme: str | None = None  # quantised KV history (runtime.target.quant_kv_cache): int8 | int4 | hier-int4
    kv_recent: int = 64  # newest committed tokens kept in full precision when kv_scheme is set
    # verify at bucketed static shapes, each bucket a CUDA graph on a CUDA target
    # (runtime.speculation.cuda_graphs.StaticVerifier; off CUDA the static step runs eagerly, reading the whole cache:
    # for tests), and an EAGLE drafter's greedy trees likewise (runtime.drafters.shared.eagle_static; not while SpecAttn
    # needs its attention). Full-precision KV only.
    static_verify: bool = False
    # fuse each static step's kernels with torch.compile (inductor) before it is captured
    # (runtime.speculation.cuda_graphs.compile_step): fewer launches a step where launches bound it; needs static_verify
    compile_static: bool = False
    # greedy only: up to this many nodes continuing a match of the sequence's own recent tokens (runtime.drafters.ngram)
    # are merged into each draft tree; a target that repeats itself gets them accepted whatever the drafter proposed
    lookup: int = 0
    # greedy only: where it beats the sequence's own match, the lookup branch continues a match in this corpus
    # (runtime.drafters.ngram: a frozen trie, a bundle's lookup corpus of the target's own answers to training
    # prompts, drafts where the sequence has no match; runtime.serving.reply_corpus adds served replies to one)
    lookup_corpus: Corpus | None = field(default=None, compare=False, repr=False)
    # greedy only: most nodes a verify holds, the drafter's and the lookup's together, keeping the likeliest
    # (DraftTree.best); 0: no limit. Where a verify's cost grows in steps (our CPU kernel's 6-row tiles), a tree
    # that fills its last step beats one that spills into the next.
    max_tree: int = 0
    # a drafter reads only the prompt's last draft_window tokens (0: all of them): drafters train on rows of a few
    # hundred tokens, and their first pass over a long prompt costs more than speculation gains on a short reply.
    # Not with SpecAttn, which maps the drafter's attention onto every key of the prefix.
    draft_window: int = 0

    def __post_init__(self):
        if not isinstance(self.budget, DraftBudget):
            raise ValueError(f"EngineConfig: budget={self.budget!r}, expected a DraftBudget")
        if self.max_seq_len < 2:
            raise ValueError(f"EngineConfig: max_seq_len={self.max_seq_len}, expected >= 2")
        if not 1 <= self.min_depth <= self.budget.depth:
            raise ValueError(f"EngineConfig: min_depth={self.min_depth}, expected 1..budget.depth={self.budget.depth}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"EngineConfig: ema_decay={self.ema_decay}, expected 0 <= ema_decay < 1")
        if self.warmup_steps < 0 or self.fallback_tau < 0:
            raise ValueError(f"EngineConfig: warmup_steps={self.warmup_steps} and fallback_tau={self.fallback_tau} "
                             "must be >= 0")
        if self.sparse is not None and not isinstance(self.sparse, SpecAttnConfig):
            raise ValueError(f"EngineConfig: sparse={self.sparse!r}, expected a SpecAttnConfig or None")
        if self.kv_scheme is not None:
            KVQuant(self.kv_scheme, self.kv_recent)  # a clear error for a bad scheme or window, here
        if self.lookup_corpus is not None and not isinstance(self.lookup_corpus, Corpus):
            raise ValueError(f"EngineConfig: lookup_corpus={self.lookup_corpus!r}, expected a Corpus or None")
        for name in ("lookup", "max_tree", "draft_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"EngineConfig: {name}={v!r}, expected an int >= 0 (0 = off)")
        if self.draft_window and self.sparse is not None:
            raise ValueError(f"EngineConfig: draft_window={self.draft_window} with SpecAttn (sparse), whose drafter "
                             "attention must cover every key of the prefix: set draft_window=0")
        if self.compile_static and not self.static_verify:
            raise ValueError("EngineConfig: compile_static compiles the static steps, so it needs static_verify=True")
        if self.static_verify and self.kv_scheme is not None:
            raise ValueError(f"EngineConfig: static_verify needs a full-precision KV cache, got kv_scheme="
                             f"{self.kv_scheme!r}")

    @property
    def kv_quant(self) -> KVQuant | None:
        return None if self.kv_scheme is None else KVQuant(self.kv_scheme, self.kv_recent)
