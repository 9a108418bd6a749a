"""Drafter weight quantisation chosen by measured tau: only the drafter's weights are quantised, so the target's
perplexity is unchanged; what a scheme can cost is acceptance, so each is judged by the tau it reaches."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from runtime.drafters import DRAFT_VOCAB, drafter_module, served_drafter
from runtime.host_memory import release_freed_memory, returning_large_blocks
from runtime.speculation.tau_probe import TauProbe
from runtime.target.model import Transformer
from runtime.weight_quant import QuantScheme, dequantize_state_dict, quantize_state_dict, relative_errors


def stored_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def choose_scheme(candidates: list[dict], tolerance: float) -> str:
    """The smallest stored scheme whose relative tau drop is within `tolerance`; "fp32" when none is."""
    ok = [c for c in candidates if "tau_drop" in c and c["tau_drop"] <= tolerance]
    return min(ok, key=lambda c: c["bytes"])["scheme"] if ok else "fp32"


@returning_large_blocks()  # each matrix's quantising temporaries, each scheme's copy: of every size, freed in turn
def calibrate_quant(out: Path, target: Transformer, config: dict, load: Callable[[], dict[str, torch.Tensor]],
                    probe: TauProbe, schemes: list[str], tolerance: float) -> dict:
    """Measure tau for fp32 and each scheme, write quant.json (+ quant.safetensors unless fp32 wins) to `out`.
    `load` reads the fp32 tensors from their file each time they are needed: a scheme's tau is measured with them
    let go, beside its own restored copy alone."""

    def tau_of(weights: dict[str, torch.Tensor]) -> float:
        module, vocab = drafter_module(config, target, weights), {k: v for k, v in weights.items() if k == DRAFT_VOCAB}
        weights.clear()  # the module holds them alone, so packing frees each plain weight: a 0.5B sibling's are 2.5 GB
        drafter = served_drafter(config, module, target, vocab)
        release_freed_memory()  # the plain weights packing let go, and a scheme's dequantising buffers
        tau = probe.measure(target, drafter)["tau"]
        del module, drafter
        release_freed_memory()  # this drafter, before the next one is built
        return tau

    candidates = []
    bar = tqdm(["fp32", *schemes], desc="calibrate: drafter weight schemes", unit="scheme")
    for name in bar:
        if name == "fp32":
            weights = load()
            fp32_bytes = stored_bytes(weights)
            fp32_tau = tau_of(weights)
            continue
        scheme, tensors = QuantScheme.parse(name), load()
        try:
            quantized = quantize_state_dict(tensors, scheme)
        except ValueError as e:  # e.g. an input dim that is not a multiple of the group size
            candidates.append({"scheme": name, "skipped": str(e)})
            continue
        rel_error = max(relative_errors(tensors, quantized, scheme).values(), default=0.0)
        del tensors
        release_freed_memory()  # the plain copy, before the restored one takes its place
        restored, size = dequantize_state_dict(quantized, scheme, dtype=target.dtype), stored_bytes(quantized)
        del quantized  # quantised again for the chosen scheme alone, so no packed copy stands beside a drafter
        tau = tau_of(restored)
        candidates.append({"scheme": name, "tau": tau, "tau_drop": (fp32_tau - tau) / fp32_tau,
                           "rel_error": rel_error, "bytes": size})
    chosen = choose_scheme(candidates, tolerance)
    report = {"chosen": chosen, "fp32_tau": fp32_tau, "fp32_bytes": fp32_bytes,
              "tau_tolerance": tolerance, "tau_prompts": len(probe.prompts), "candidates": candidates,
              "target_perplexity": "unchanged: only drafter weights are quantised"}
    (out / "quant.json").write_text(json.dumps(report, indent=2) + "\n")
    release_freed_memory()  # every scheme's drafter copies: a 0.5B sibling's are 2 GB each
    if chosen != "fp32":  # quantising is deterministic: these are the bits whose tau was measured
        save_file(quantize_state_dict(load(), chosen), str(out / "quant.safetensors"), metadata={"scheme": chosen})
        release_freed_memory()  # the plain copy it was quantised from
    return report
