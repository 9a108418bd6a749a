"""QuantSpec KV-cache quantisation chosen by measurement: for each scheme, the target's perplexity on the
calibration rows read through the quantised cache, and tau with the target's and the drafter's caches quantised
(the drafter reads hier-int4's upper plane only). The most compressed scheme within both tolerances wins.

Perplexity is teacher-forced in chunks no longer than QuantizedKVCache.exact_depth() allows, so every query reads
the history exactly as it would when decoding one token at a time.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.distill import measure_tau
from pipeline.specattn_calibration import next_token_nll, perplexity
from runtime.bundle import KV_QUANT, NO_KV_QUANT
from runtime.drafter import DraftBudget, Drafter
from runtime.model import Transformer
from runtime.quant_kv_cache import KVQuant, QuantizedKVCache, new_kv_cache


@torch.inference_mode()
def quantized_nll(target: Transformer, ids: torch.Tensor, quant: KVQuant | None) -> torch.Tensor:
    """Next-token NLL [T-1] of one row with the KV history stored as `quant` says (None: full precision)."""
    c, T = target.config, ids.numel()
    cache = new_kv_cache(c.n_layers, 1, c.n_kv_heads, T, c.head_dim, quant, target.dtype, target.device)
    logits, start = [], 0
    while start < T:
        n = T - start if not isinstance(cache, QuantizedKVCache) else min(T - start, cache.exact_depth() + 1)
        chunk = ids[start:start + n].to(target.device)
        logits.append(target(chunk[None], cache, torch.arange(start, start + n, device=target.device)[None])[0])
        cache.advance(n)
        start += n
    return next_token_nll(torch.cat(logits, dim=1), ids.to(target.device))


def choose_kv_scheme(candidates: list[dict], tau_tolerance: float, ppl_tolerance: float) -> str:
    """The scheme whose target reads are smallest among those within both tolerances; NO_KV_QUANT if none."""
    ok = [c for c in candidates if c["tau_drop"] <= tau_tolerance and c["ppl_change"] <= ppl_tolerance]
    return min(ok, key=lambda c: (c["target_bits"], c["draft_bits"]))["scheme"] if ok else NO_KV_QUANT


def calibrate_kv(out: Path, target: Transformer, drafter: Drafter, rows: list[torch.Tensor], *, schemes: list[str],
                 recent: int, tau_tolerance: float, ppl_tolerance: float, tau_prompts: list[list[int]],
                 budget: DraftBudget, tau_new_tokens: int,
                 dense_tau: float) -> tuple[dict[str, str], dict[str, float], str]:
    """Writes kv_quant.json (every candidate's measurements and the choice; export ships it in the bundle, whose
    Bundle.kv_settings() the runtime's engines apply) to `out`. `dense_tau`: measured on the same prompts and budget
    with a full-precision cache (calibrate's fp32 drafter tau)."""
    dense_ppl = perplexity([quantized_nll(target, r, None) for r in rows])
    head_dim, candidates = target.config.head_dim, []
    for scheme in schemes:
        quant = KVQuant(scheme, recent)
        ppl = perplexity([quantized_nll(target, r, quant) for r in rows])
        tau = measure_tau(target, drafter, tau_prompts, budget, tau_new_tokens, kv=quant)["tau"]
        candidates.append({"scheme": scheme, "perplexity": ppl, "ppl_change": ppl / dense_ppl - 1, "tau": tau,
                           "tau_drop": (dense_tau - tau) / dense_tau, "target_bits": quant.read_bits(head_dim),
                           "draft_bits": KVQuant(scheme, recent, reader="draft").read_bits(head_dim)})
    chosen = choose_kv_scheme(candidates, tau_tolerance, ppl_tolerance)
    report = {"chosen": chosen, "recent": recent, "dense_perplexity": dense_ppl, "dense_tau": dense_tau,
              "full_precision_bits": 8 * target.dtype.itemsize, "tau_tolerance": tau_tolerance,
              "ppl_tolerance": ppl_tolerance, "rows": len(rows), "candidates": candidates}
    (out / KV_QUANT).write_text(json.dumps(report, indent=2) + "\n")
    metrics = {f"kv_{c['scheme']}_{k}": c[k] for c in candidates for k in ("ppl_change", "tau")}
    best = next((c for c in candidates if c["scheme"] == chosen), None)
    message = (f"KV {chosen}: {best['target_bits']:.1f} bits/value, perplexity {best['ppl_change']:+.2%}, "
               f"tau {best['tau']:.2f}" if best else "KV: no scheme within tolerance, cache stays full precision")
    return {"kv_quant": KV_QUANT}, metrics, message
