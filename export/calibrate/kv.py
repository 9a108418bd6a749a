"""QuantSpec KV-cache quantisation chosen by measurement: for each scheme, the target's perplexity on the
calibration rows read through the quantised cache, tau with the target's and the drafter's caches quantised
(the drafter reads hier-int4's upper plane only), and the time of a decode step in the precision validate and
serving run, on this device. The most compressed scheme within both accuracy tolerances and the slowdown bound
wins: compression saves memory, but where the history is dequantised on every read (the CPU torch path) it costs
the speed the gate measures.

Perplexity is teacher-forced in chunks no longer than QuantizedKVCache.exact_depth() allows, so every query reads
the history exactly as it would when decoding one token at a time.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from export.calibrate.specattn_sweep import QUERY_SLICE, hidden_nll, perplexity, sliced_forward
from export.calibrate.timing import interleaved_ms
from runtime.bundle_reader import KV_QUANT, NO_KV_QUANT
from runtime.host_memory import returning_large_blocks
from runtime.speculation.drafter import Drafter
from runtime.speculation.tau_probe import TauProbe
from runtime.target.model import Transformer
from runtime.target.quant_kv_cache import KVQuant, new_kv_cache


@torch.inference_mode()
def quantized_nll(target: Transformer, ids: torch.Tensor, quant: KVQuant | None) -> torch.Tensor:
    """Next-token NLL [T-1] of one row with the KV history stored as `quant` says (None: full precision)."""
    c = target.config
    cache = new_kv_cache(c.n_layers, 1, c.n_kv_heads, ids.numel(), c.head_dim, quant, target.dtype, target.device)
    ids = ids.to(target.device)
    return hidden_nll(target, sliced_forward(target, ids, cache=cache).hidden, ids)  # a long row's logits would not fit


@torch.inference_mode()
def decode_ms(target: Transformer, quants: dict[str, KVQuant | None], context: int, rounds: int = 5,
              steps: int = 4) -> dict[str, float]:
    """Median milliseconds of a one-token decode forward after `context` cached tokens, per named cache storage
    (None: full precision), timed in interleaved rounds (timing.interleaved_ms)."""
    c, device = target.config, target.device
    ids = torch.randint(0, c.vocab_size, (1, context + 1), generator=torch.Generator().manual_seed(0)).to(device)
    position = torch.tensor([[context]], device=device)

    def decode(quant: KVQuant | None):
        cache = new_kv_cache(c.n_layers, 1, c.n_kv_heads, context + 1, c.head_dim, quant, target.dtype, device)
        # in slices, each advancing the cache: the committed history below a block boundary moves into the codes
        target.prefill(ids[:, :context], cache, chunk=QUERY_SLICE)
        # the slot after the history is rewritten by every call, never committed
        return lambda: target(ids[:, context:], cache, position, last_logits_only=True)

    return interleaved_ms({name: decode(quant) for name, quant in quants.items()}, device, rounds, steps)


def accurate(candidates: list[dict], tau_tolerance: float, ppl_tolerance: float) -> list[dict]:
    """The candidates within both accuracy tolerances (tau drop, perplexity change)."""
    return [c for c in candidates if c["tau_drop"] <= tau_tolerance and c["ppl_change"] <= ppl_tolerance]


def choose_kv_scheme(candidates: list[dict], tau_tolerance: float, ppl_tolerance: float,
                     max_slowdown: float) -> str:
    """The scheme whose target reads are smallest among those within both accuracy tolerances and decoding at
    most `max_slowdown` slower than a full-precision cache; NO_KV_QUANT if none."""
    ok = [c for c in accurate(candidates, tau_tolerance, ppl_tolerance) if c["slowdown"] <= max_slowdown]
    return min(ok, key=lambda c: (c["target_bits"], c["draft_bits"]))["scheme"] if ok else NO_KV_QUANT


@returning_large_blocks()  # a long row's perplexity: its large temporaries outgrow one another slice after slice
def calibrate_kv(out: Path, target: Transformer, drafter: Drafter, rows: list[torch.Tensor], *, schemes: list[str],
                 recent: int, tau_tolerance: float, ppl_tolerance: float, probe: TauProbe,
                 dense_tau: float, decode_context: int,
                 max_slowdown: float) -> tuple[dict[str, str], dict[str, float], str]:
    """Writes kv_quant.json (every candidate's measurements and the choice; export ships it in the bundle, whose
    Bundle.kv_settings() the runtime's engines apply) to `out`. `dense_tau`: measured by the same probe with a
    full-precision cache (calibrate's unquantised drafter tau). The target is in the precision validate and
    serving run; its decode step is timed after `decode_context` tokens."""
    bar = tqdm(total=2 + 2 * len(schemes), desc="calibrate: KV schemes", unit="step")
    bar.set_postfix_str("full-precision perplexity")
    dense_ppl = perplexity([quantized_nll(target, r, None) for r in rows])
    bar.update()
    bar.set_postfix_str("decode steps")
    times = decode_ms(target, {NO_KV_QUANT: None, **{s: KVQuant(s, recent) for s in schemes}}, decode_context)
    bar.update()
    head_dim, candidates = target.config.head_dim, []
    for scheme in schemes:
        quant = KVQuant(scheme, recent)
        bar.set_postfix_str(f"{scheme} perplexity")
        ppl = perplexity([quantized_nll(target, r, quant) for r in rows])
        bar.update()
        bar.set_postfix_str(f"{scheme} tau")
        tau = probe.measure(target, drafter, kv=quant)["tau"]
        bar.update()
        candidates.append({"scheme": scheme, "perplexity": ppl, "ppl_change": ppl / dense_ppl - 1, "tau": tau,
                           "tau_drop": (dense_tau - tau) / dense_tau, "target_bits": quant.read_bits(head_dim),
                           "draft_bits": KVQuant(scheme, recent, reader="draft").read_bits(head_dim),
                           "decode_ms": times[scheme], "slowdown": times[scheme] / times[NO_KV_QUANT] - 1})
    bar.close()
    chosen = choose_kv_scheme(candidates, tau_tolerance, ppl_tolerance, max_slowdown)
    report = {"chosen": chosen, "recent": recent, "dense_perplexity": dense_ppl, "dense_tau": dense_tau,
              "full_precision_bits": 8 * target.dtype.itemsize, "tau_tolerance": tau_tolerance,
              "ppl_tolerance": ppl_tolerance, "rows": len(rows), "decode_dtype": str(target.dtype).removeprefix("torch."),
              "decode_context": decode_context, "full_precision_decode_ms": times[NO_KV_QUANT],
              "max_slowdown": max_slowdown, "candidates": candidates}
    (out / KV_QUANT).write_text(json.dumps(report, indent=2) + "\n")
    metrics = {f"kv_{c['scheme']}_{k}": c[k] for c in candidates for k in ("ppl_change", "tau", "slowdown")}
    return {"kv_quant": KV_QUANT}, metrics, kv_message(candidates, chosen, tau_tolerance, ppl_tolerance, max_slowdown)


def kv_message(candidates: list[dict], chosen: str, tau_tolerance: float, ppl_tolerance: float,
               max_slowdown: float) -> str:
    best = next((c for c in candidates if c["scheme"] == chosen), None)
    if best:
        return (f"KV {chosen}: {best['target_bits']:.1f} bits/value, perplexity {best['ppl_change']:+.2%}, "
                f"tau {best['tau']:.2f}, decode {best['slowdown']:+.0%}")
    too_slow = accurate(candidates, tau_tolerance, ppl_tolerance)  # no accurate scheme was chosen: all too slow
    if too_slow:  # say what compression would have cost: the user may prefer memory over speed
        slow = ", ".join(f"{c['scheme']} {c['slowdown']:+.0%}" for c in too_slow)
        return (f"KV: full precision (within the accuracy tolerances but decoding slower here: {slow}; "
                f"calibrate.kv_max_slowdown={max_slowdown:g})")
    return "KV: no scheme within tolerance, cache stays full precision"
