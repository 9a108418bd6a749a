"""The one place that knows every drafter kind: config + tensors -> module -> runtime Drafter, and back.

distill saves what `drafter_config`/`drafter_tensors` give, calibrate rebuilds modules with `drafter_module`, and
the bundle reader (`build_drafter`) goes through the same two functions, so what is measured is what is served;
a bundle whose weights calibrate quantised is restored from its codes first (`bundle_weights`).
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.bundle import Bundle, BundleError
from runtime.draft_head import DraftHead
from runtime.drafter import Drafter
from runtime.eagle import EagleConfig, EagleDrafter, EagleModel
from runtime.lm_drafter import LMConfig, LMDrafter
from runtime.medusa import MedusaConfig, MedusaDrafter, MedusaHeads
from runtime.model import Transformer
from runtime.ngram import NgramDrafter
from runtime.weight_quant import dequantize_state_dict

KINDS = ("ngram", "eagle", "medusa", "lm")
WEIGHTED = ("eagle", "medusa", "lm")
ATTENDING = ("eagle", "lm")  # kinds whose attention can select the target's keys (SpecAttn, draft_attention)
DRAFT_VOCAB = "draft_vocab"  # tensor name of the reduced draft vocabulary (target token ids), if any
WEIGHT_QUANT = "weight_quant"  # drafter config key: the scheme of the bundle's packed weights (absent: plain)
TREE_ROOM = 64  # drafter positions beyond the target's length by default: room for the draft tree's nodes


def no_weights(kind: str) -> ValueError:
    return ValueError(f"drafter kind {kind!r} has no weights (expected one of {WEIGHTED})")


def draft_head(target: Transformer, tensors: dict) -> DraftHead:
    return DraftHead(target.output.weight, tensors.get(DRAFT_VOCAB))


def drafter_config(kind: str, module: nn.Module, draft_vocab: int) -> dict:
    """drafter_config.json for a trained module: with the tensors, everything drafter_module needs."""
    if kind == "eagle":
        return EagleConfig(draft_vocab).to_dict()
    if kind == "medusa":
        return module.cfg.to_dict()
    if kind == "lm":
        return LMConfig(module.config, draft_vocab).to_dict()
    raise no_weights(kind)


def drafter_tensors(module: nn.Module, keep_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The tensors a bundle stores: the module's weights and the reduced draft vocabulary, if any."""
    tensors = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    if isinstance(module, Transformer) and module.config.tie_embeddings:
        del tensors["output.weight"]  # safetensors stores no aliases; drafter_module ties it again
    if keep_ids is not None:
        tensors[DRAFT_VOCAB] = keep_ids
    return tensors


def drafter_module(config: dict, target: Transformer, tensors: dict[str, torch.Tensor],
                   max_len: int | None = None) -> nn.Module:
    """The trained module of a drafter (eval mode, the target's dtype and device) from its config and tensors."""
    kind, max_len = config["kind"], max_len or target.max_seq_len + TREE_ROOM
    weights = {k: v for k, v in tensors.items() if k != DRAFT_VOCAB}
    if kind == "eagle":
        module = EagleModel(target.config, target.tok_embeddings.weight, draft_head(target, tensors), max_len)
    elif kind == "medusa":
        module = MedusaHeads(MedusaConfig(**{k: v for k, v in config.items() if k != "kind"}),
                             draft_head(target, tensors))
    elif kind == "lm":
        module = Transformer(LMConfig.from_dict(config).model, max_len)
        if module.config.tie_embeddings and "tok_embeddings.weight" in weights:
            weights.setdefault("output.weight", weights["tok_embeddings.weight"])
    else:
        raise no_weights(kind)
    missing, unexpected = module.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"weights do not fit a {kind} drafter (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return module.to(device=target.device, dtype=target.dtype).eval()


def runtime_drafter(kind: str, module: nn.Module, target: Transformer, max_len: int | None = None,
                    keep_ids: torch.Tensor | None = None) -> Drafter:
    """The Drafter the engine drives around a trained module; `keep_ids` is the lm's reduced draft vocabulary
    (eagle and medusa carry theirs in the module's head)."""
    max_len = max_len or target.max_seq_len + TREE_ROOM
    if kind == "eagle":
        return EagleDrafter(module, max_len)
    if kind == "medusa":
        return MedusaDrafter(module)
    if kind == "lm":
        return LMDrafter(module, max_len, keep_ids)
    raise no_weights(kind)


def served_drafter(kind: str, module: nn.Module, target: Transformer, tensors: dict[str, torch.Tensor],
                   max_len: int | None = None) -> Drafter:
    """The Drafter around a trained module as a bundle's reader builds it: an lm's reduced draft vocabulary read
    from its tensors."""
    return runtime_drafter(kind, module, target, max_len, tensors.get(DRAFT_VOCAB))


def bundle_weights(bundle: Bundle, dtype: torch.dtype) -> tuple[dict, dict[str, torch.Tensor]]:
    """(drafter config, tensors) of a weighted bundle, its packed weights restored when calibrate quantised them."""
    cfg = dict(bundle.drafter_config)
    scheme = cfg.pop(WEIGHT_QUANT, None)
    tensors = bundle.tensors()
    if scheme is not None:
        try:
            tensors = dequantize_state_dict(tensors, scheme, dtype)
        except ValueError as e:
            raise BundleError(f"bundle {bundle.dir}: {WEIGHT_QUANT}={scheme!r}: {e}") from None
    return cfg, tensors


def build_drafter(bundle: Bundle, target: Transformer, max_len: int) -> Drafter:
    kind = bundle.kind
    if kind == "ngram":
        return NgramDrafter(target.config.vocab_size, **{k: v for k, v in bundle.drafter_config.items() if k != "kind"})
    if kind not in KINDS:
        raise BundleError(f"bundle {bundle.dir}: drafter kind {kind!r} is not one of {KINDS}")
    cfg, tensors = bundle_weights(bundle, target.dtype)
    try:
        module = drafter_module(cfg, target, tensors, max_len)
    except (ValueError, TypeError, KeyError) as e:  # a config or weights that do not describe this kind
        raise BundleError(f"bundle {bundle.dir}: {e}") from None
    return served_drafter(kind, module, target, tensors, max_len)
