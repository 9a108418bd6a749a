"""QuantSpec drafter: the target drafts for itself through a quantised copy of its own weights (int4 where our
kernel runs, else int8); nothing is trained.

The copy (runtime.target.quantized_copy.quantized_copy) is made from the target in memory when the drafter is built,
deterministically, so a bundle stores only the scheme, never weights: the target fingerprint it pins fixes them.
All drafters of one target and scheme share the copy (a batch's rows, a served engine's rebuilds).

Drafting is the LM drafter's (runtime.drafters.lm.LMDrafter) over the copy, reading the target's own KV cache, as
QuantSpec does: the engine hands it over (read_target_cache), so the prompt and every accepted token are already
there, written by the target's prefill and verify, and each propose runs the root and then grows the tree within the
budget (calibrate picks it) in slots past the committed length, which the verify overwrites. With calibrate's
"hier-int4" KV the draft reads the upper int4 plane of that history, the target both planes
(runtime.target.quant_kv_cache).
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
from runtime.target.attention import draft_attention_dtype
from runtime.target.model import Transformer
from runtime.target.quant_kv_cache import reading_as
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
    owns_cache = False

    def __init__(self, draft: QuantizedTransformer):
        """`draft`: the target's quantised copy; it scores drafts with its own quantised head over the full
        vocabulary. It has no KV cache until an engine gives it the target's (read_target_cache)."""
        self.model, self.head, self.vocab = draft, draft.output, None
        self.vocab_size = draft.config.vocab_size
        self.cache = None
        self.pending: list[Tensor] = []
        self.tree = None
        self.attention = None

    def read_target_cache(self, cache) -> bool:
        self.cache = cache
        return True

    def reset(self, tokens: Tensor, features: Tensor | None = None) -> None:
        """The target's cache holds the prompt: only the root is the draft's to run."""
        self.pending, self.tree, self.attention = [tokens[-1:].long()], None, None

    def commit(self, tokens: Tensor, features: Tensor | None = None) -> None:
        """The verify left the accepted tokens' KV in the target's cache: only the new root is the draft's, as after
        reset."""
        self.reset(tokens)

    def propose(self, budget: DraftBudget, params: SamplingParams,
                generator: torch.Generator | None = None) -> DraftTree:
        if self.cache is None:
            raise ValueError("a quantspec drafter reads the target's KV cache: drive it through an engine "
                             "(Engine, BatchEngine), which hands it over")
        with threads(DRAFT_THREADS), reading_as(self.cache, KV_READER), draft_attention_dtype():
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
        return QuantSpecDrafter(shared_copy(target, weight_scheme(config)))


KIND = QuantSpecKind()
