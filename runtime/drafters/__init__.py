"""The drafter kinds, one module each in this package (its `KIND`, a runtime.speculation.drafter.DrafterKind), found by
name; `shared/` holds the code several kinds use (the draft head, EAGLE drafting, batched drafting).

distill saves what `drafter_config`/`drafter_tensors` give, calibrate rebuilds modules with `drafter_module`, and
the bundle reader (`build_drafter`) goes through the same two functions, so what is measured is what is served;
a bundle whose weights calibrate quantised is restored from its codes first (`bundle_weights`).
"""
from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from typing import Any, Callable

import torch
from torch import nn

from runtime.bundle_reader import Bundle, BundleError
from runtime.host_memory import release_freed_memory
from runtime.speculation.drafter import Drafter, DrafterKind
from runtime.target.model import Transformer
from runtime.weight_quant import dequantize_state_dict

DRAFT_VOCAB = "draft_vocab"  # tensor name of the reduced draft vocabulary (target token ids), if any
WEIGHT_QUANT = "weight_quant"  # drafter config key: the scheme of the bundle's packed weights (absent: plain)
TREE_ROOM = 64  # drafter positions beyond the target's length by default: room for the draft tree's nodes


def kind_names() -> tuple[str, ...]:
    """Every kind, by its module's name (nothing is imported); `shared/` holds code several kinds use."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.ispkg))


@cache
def get_kind(name: str) -> DrafterKind:
    if name not in kind_names():
        raise ValueError(f"drafter kind {name!r} is not one of {', '.join(kind_names())}")
    return importlib.import_module(f"{__name__}.{name}").KIND


def drafter_config(kind: str, module: nn.Module | None, draft_vocab: int, settings) -> dict:
    """drafter_config.json for a trained module (None for a weightless kind): with the tensors, everything
    drafter_module needs. `settings`: the run's drafter section."""
    return get_kind(kind).config(module, draft_vocab, settings)


def drafter_tensors(module: nn.Module, keep_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The tensors a bundle stores: the module's weights, a tied one once (safetensors stores no aliases), and the
    reduced draft vocabulary, if any."""
    tensors, seen = {}, set()
    for name, t in module.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            tensors[name] = t.detach().contiguous()
    if keep_ids is not None:
        tensors[DRAFT_VOCAB] = keep_ids
    return tensors


def drafter_module(config: dict, target: Transformer, tensors: dict[str, torch.Tensor],
                   max_len: int | None = None) -> nn.Module:
    """The trained module of a drafter (eval mode, the target's dtype and device) from its config and tensors."""
    kind, max_len = get_kind(config["kind"]), max_len or target.max_seq_len + TREE_ROOM
    module = with_weights(kind, kind.module(config, target, max_len, tensors.get(DRAFT_VOCAB)), tensors)
    return module.to(device=target.device, dtype=target.dtype).eval()


def with_weights(kind: DrafterKind, module: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """`module` with the trained `tensors` loaded; ValueError where they do not fit it."""
    weights = {k: v for k, v in tensors.items() if k != DRAFT_VOCAB}
    groups: dict[int, list[str]] = {}  # the names of each parameter: a tied one has several, and is stored once
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    # assign: the module holds the caller's tensors, not a copy beside them (2 GB more for a 0.5B sibling in fp32)
    missing, unexpected = module.load_state_dict(weights, strict=False, assign=True)
    loaded = set()
    for names in groups.values():
        source = next((n for n in names if n in weights), None)
        for n in names if source else ():
            owner, _, leaf = n.rpartition(".")
            setattr(module.get_submodule(owner), leaf, module.get_parameter(source))  # tied again
            loaded.add(n)
    missing = [m for m in missing if m not in loaded]
    if missing or unexpected:
        raise ValueError(f"weights do not fit a {kind.name} drafter (missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]})")
    return module


def hf_assistant(bundle: Bundle, dtype: torch.dtype) -> nn.Module | None:
    """The HF causal LM that HF assisted generation drives as the bundle's drafter, in `dtype` on the CPU, from the
    bundle alone (validate times HF while our target is not loaded); None for kinds without one."""
    kind = get_kind(bundle.kind)
    module = kind.hf_assistant(bundle.drafter_config)
    if module is None:
        return None
    config, tensors = bundle_weights(bundle, dtype)
    try:
        module = with_weights(kind, module, tensors)
    except ValueError as e:  # weights that do not describe its kind
        raise BundleError(f"bundle {bundle.dir}: {e}") from None
    del tensors
    hf = kind.hf_causal_lm(module.to(dtype).eval())
    del module
    release_freed_memory()  # the file's codes, the restored weights HF copied: a sibling's are gigabytes
    return hf


def served_drafter(config: dict, module: nn.Module | None, target: Transformer, tensors: dict[str, torch.Tensor],
                   max_len: int | None = None) -> Drafter:
    """The Drafter the engine drives around a trained module (None for a weightless kind), as a bundle's reader
    builds it: a reduced draft vocabulary read from its tensors."""
    return get_kind(config["kind"]).drafter(module, config, target, max_len or target.max_seq_len + TREE_ROOM,
                                            tensors.get(DRAFT_VOCAB))


def bundle_weights(bundle: Bundle, dtype: torch.dtype) -> tuple[dict, dict[str, torch.Tensor]]:
    """(drafter config, tensors) of a bundle, its packed weights restored when calibrate quantised them; no tensors
    for a weightless kind."""
    cfg = dict(bundle.drafter_config)
    try:
        kind = get_kind(cfg.get("kind"))
    except ValueError as e:
        raise BundleError(f"bundle {bundle.dir}: {e}") from None
    if not kind.weighted:
        return cfg, {}
    scheme = cfg.pop(WEIGHT_QUANT, None)
    tensors = bundle.tensors()
    if scheme is not None:
        try:
            tensors = dequantize_state_dict(tensors, scheme, dtype)
        except ValueError as e:
            raise BundleError(f"bundle {bundle.dir}: {WEIGHT_QUANT}={scheme!r}: {e}") from None
    return cfg, tensors


def build_drafter(bundle: Bundle, target: Transformer, max_len: int) -> Drafter:
    """The Drafter a bundle serves, every file of it checked by the reader first."""
    return drafter_factory(bundle, target, max_len)()


def drafter_factory(bundle: Bundle, target: Transformer, max_len: int) -> Callable[[], Drafter]:
    """New Drafters of a bundle, each with its own state around one module loaded once: serving makes one per batch
    row and per budget it falls back to, and a sibling LM's weights are gigabytes."""
    config, tensors = bundle_weights(bundle, target.dtype)
    vocab = {k: v for k, v in tensors.items() if k == DRAFT_VOCAB}

    def checked(make: Callable[[], Any]) -> Any:
        try:
            return make()
        except (ValueError, TypeError, KeyError) as e:  # a config or weights that do not describe its kind
            raise BundleError(f"bundle {bundle.dir}: {e}") from None

    module = checked(lambda: drafter_module(config, target, tensors, max_len)
                     if get_kind(config["kind"]).weighted else None)
    del tensors  # the module holds them
    release_freed_memory()  # the file's codes and what restoring them let go
    return lambda: checked(lambda: served_drafter(config, module, target, vocab, max_len))
