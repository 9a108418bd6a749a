"""QuantSpec drafter: the target drafts for itself through a quantised copy of its own weights (int4 where our
kernel runs, else int8); nothing is trained.

The copy (runtime.target.quantized_copy.quantized_copy) is made from the target in memory when the drafter is built,
deterministically, so a bundle stores only the scheme, never weights: the target fingerprint it pins fixes them.
All drafters of one target and scheme share the copy (a batch's rows, a served engine's rebuilds); each keeps its
own KV cache.

Drafting is the LM drafter's (runtime.drafters.lm.LMDrafter) over the copy: its cache holds the committed tokens,
the tokens committed since the last proposal run first, then the tree grows within the budget (calibrate picks it).
The KV scheme is the engine's, as for every drafter with a cache: with calibrate's "hier-int4" the draft reads the
upper int4 plane of its history and the target both planes (runtime.target.quant_kv_cache).

Why a KV cache of its own rather than reading the target's: the Drafter interface gives a drafter no access to the
engine's cache, and at the contexts a CPU serves, the draft's own cache costs one int8 prefill of the prompt.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch import Tensor

from runtime.drafters.lm import LMDrafter
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.drafter import DrafterKind
from runtime.speculation.sampling import SamplingParams
from runtime.speculation.tree import DraftTree
from runtime.target.model import Taps, Transformer
from runtime.target.quantized_copy import SCHEMES, QuantizedTransformer, default_scheme, quantized_copy

KV_READER = "draft"  # a hierarchical int4 KV history is read through its upper plane
# threads a draft forward runs on at most; None: torch's. On a quiet 2-core host two drafted faster than one (int4 and
# int8), on a host shared with other work one did (docs/qwen.md, "QuantSpec with int4 weights: our kernel")
DRAFT_THREADS: int | None = None
_COPIES: "weakref.WeakKeyDictionary[Transformer, dict[str, QuantizedTransformer]]" = weakref.WeakKeyDictionary()


def shared_copy(target: Transformer, scheme: str) -> QuantizedTransformer:
    """The copy of `target` in `scheme`, made once per target object and scheme."""
    copies = _COPIES.setdefault(target, {})
    if scheme not in copies:
        copies[scheme] = quantized_copy(target, scheme)
    return copies[scheme]


class QuantSpecDrafter(LMDrafter):
    def __init__(self, draft: QuantizedTransformer, max_len: int):
        """`draft`: the target's quantised copy; it scores drafts with its own quantised head over the full
        vocabulary."""
        self.model, self.head, self.vocab = draft, draft.output, None
        self.vocab_size = draft.config.vocab_size
        # the target's room for a tree (EngineConfig.max_seq_len) bounds the draft's slots: no room past its length
        self.cache = draft.new_cache(1, min(max_len, draft.max_seq_len))
        self.pending: list[Tensor] = []
        self.tree = None
        self.attention = None
        self.taps = Taps(attention_layers=tuple(range(draft.config.n_layers)))

    def propose(self, budget: DraftBudget, params: SamplingParams,
                generator: torch.Generator | None = None) -> DraftTree:
        with threads(DRAFT_THREADS):
            return super().propose(budget, params, generator)


@contextlib.contextmanager
def threads(n: int | None):
    """torch's intra-op threads at most `n` (None: as they are) inside, as they were after."""
    before = torch.get_num_threads()
    torch.set_num_threads(min(n or before, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def weight_scheme(config: dict) -> str:
    """The scheme a drafter config names; one naming none (`pipeline bench --drafter quantspec`) gets this host's
    default."""
    return config.get("weights", default_scheme())


def check_config(config: dict) -> None:
    """A one-line error for a bundle's drafter config that does not describe this kind's scheme."""
    weights = weight_scheme(config)
    if weights not in SCHEMES:
        raise ValueError(f"quantspec weights {weights!r}: expected one of {', '.join(SCHEMES)}")
    reader = config.get("kv_reader", KV_READER)
    if reader != KV_READER:
        raise ValueError(f"quantspec kv_reader {reader!r}: expected {KV_READER!r}")


class QuantSpecKind(DrafterKind):
    name = "quantspec"
    weighted = False
    calibrates = True

    def config(self, module, draft_vocab, settings):
        weights = getattr(settings, "quant_weights", "auto")
        return {"kind": self.name, "weights": default_scheme() if weights == "auto" else weights,
                "kv_reader": KV_READER}

    def drafter(self, module, config, target, max_len, keep_ids):
        check_config(config)
        return QuantSpecDrafter(shared_copy(target, weight_scheme(config)), max_len)


KIND = QuantSpecKind()
