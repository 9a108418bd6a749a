"""Build a drafter from a verified bundle: the one place that knows every drafter kind."""
from __future__ import annotations

import torch

from runtime.bundle import Bundle, BundleError
from runtime.draft_head import DraftHead
from runtime.drafter import Drafter
from runtime.model import Transformer

KINDS = ("ngram", "eagle", "medusa")
DRAFT_VOCAB = "draft_vocab"  # tensor name of the reduced draft vocabulary (target token ids), if any


def draft_head(target: Transformer, tensors: dict) -> DraftHead:
    return DraftHead(target.output.weight, tensors.get(DRAFT_VOCAB))


def load_weights(module: torch.nn.Module, tensors: dict, bundle: Bundle) -> None:
    weights = {k: v for k, v in tensors.items() if k != DRAFT_VOCAB}
    missing, unexpected = module.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise BundleError(f"bundle {bundle.dir}: weights do not fit a {bundle.kind} drafter "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")


def build_drafter(bundle: Bundle, target: Transformer, max_len: int) -> Drafter:
    cfg = dict(bundle.drafter_config)
    kind = cfg.pop("kind")
    if kind == "ngram":
        from runtime.ngram import NgramDrafter

        return NgramDrafter(target.config.vocab_size, **cfg)
    tensors = bundle.tensors()
    if kind == "eagle":
        from runtime.eagle import EagleDrafter, EagleModel

        model = EagleModel(target.config, target.tok_embeddings.weight, draft_head(target, tensors), max_len)
        load_weights(model, tensors, bundle)
        return EagleDrafter(model.to(target.dtype).eval(), max_len)
    if kind == "medusa":
        from runtime.medusa import MedusaConfig, MedusaDrafter, MedusaHeads

        heads = MedusaHeads(MedusaConfig(**cfg), draft_head(target, tensors))
        load_weights(heads, tensors, bundle)
        return MedusaDrafter(heads.to(target.dtype).eval())
    raise BundleError(f"bundle {bundle.dir}: drafter kind {kind!r} is not one of {KINDS}")
