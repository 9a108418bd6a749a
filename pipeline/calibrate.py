"""The calibrate stage: drafter weight quantisation chosen by measured tau, KV-cache quantisation chosen by measured
perplexity, tau and decode speed (pipeline.kv_calibration), and the SpecAttn layer map.

Quantisation touches only the drafter: the target's weights and therefore its perplexity are unchanged; what a
scheme can cost is acceptance, so each candidate is judged by the tau it reaches in the runtime.
The SpecAttn layer map and its top-p sweep (KV reads saved vs perplexity change and tau, measured with sparse
verification in the runtime) live in pipeline.specattn_calibration.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file

from runtime.weight_quant import QuantScheme, dequantize_state_dict, quantize_state_dict, relative_errors
from pipeline.distill import TauProbe, draft_budget, load_target, lookup_corpus, tau_probe
from pipeline.budget_calibration import calibrate_budget
from pipeline.kv_calibration import calibrate_kv
from pipeline.runstore import StageResult
from pipeline.specattn_calibration import calibrate_specattn
from pipeline.stages import StageContext
from runtime.drafters import ATTENDING, WEIGHTED, drafter_module as build_drafter_model, served_drafter
from runtime.bench import generation_stop_ids
from runtime.bundle import KV_QUANT, kv_engine_fields
from runtime.model import Transformer
from runtime.precision import float_dtype
from train.data import TokenizedSet, prompts_from

NOT_APPLICABLE = "not applicable"


@dataclass(frozen=True)
class CalibrateSettings:
    schemes: tuple[str, ...] = ("int8", "int4-g128", "int4-g64", "int4-g32")
    tau_prompts: int = 4
    tau_new_tokens: int = 32
    budget_prompts: int = 12  # the draft budget finalists run (successive halving); not validate's where val allows
    # 0: validate's max_new_tokens. The lookup branch gains as a reply grows (it matches the reply's own n-grams):
    # at 64 tokens 2x2/4 + lookup 8 cut to 5 led the 2-chain by 1.5%, at validate's 128 by 5% (AMD, 16 val rows)
    budget_new_tokens: int = 0
    # the chosen budget's tau should clear validate.gate.min_tau by this fraction on these few prompts, so that it
    # clears it on validate's prompts too (budget_calibration.choose_budget)
    budget_tau_margin: float = 0.1


SETTINGS = CalibrateSettings()


# ---------------------------------------------------------------- drafter weights


def stored_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def choose_scheme(candidates: list[dict], tolerance: float) -> str:
    """The smallest stored scheme whose relative tau drop is within `tolerance`; "fp32" when none is."""
    ok = [c for c in candidates if "tau_drop" in c and c["tau_drop"] <= tolerance]
    return min(ok, key=lambda c: c["bytes"])["scheme"] if ok else "fp32"


def calibrate_quant(ctx: StageContext, target: Transformer, config: dict, tensors: dict[str, torch.Tensor],
                    probe: TauProbe, s: CalibrateSettings) -> dict:
    """Measure tau for fp32 and each scheme, write quant.json (+ quant.safetensors unless fp32 wins)."""
    kind = config["kind"]

    def tau_of(weights: dict[str, torch.Tensor]) -> float:
        model = build_drafter_model(config, target, weights)
        return probe.measure(target, served_drafter(kind, model, target, weights))["tau"]

    fp32_tau = tau_of(tensors)
    candidates, packed = [], {}
    for name in s.schemes:
        scheme = QuantScheme.parse(name)
        try:
            packed[name] = quantize_state_dict(tensors, scheme)
        except ValueError as e:  # e.g. an input dim that is not a multiple of the group size
            candidates.append({"scheme": name, "skipped": str(e)})
            continue
        restored = dequantize_state_dict(packed[name], scheme, dtype=target.dtype)
        tau = tau_of(restored)
        candidates.append({"scheme": name, "tau": tau, "tau_drop": (fp32_tau - tau) / fp32_tau,
                           "rel_error": max(relative_errors(tensors, restored).values(), default=0.0),
                           "bytes": stored_bytes(packed[name])})
    tolerance = ctx.cfg.calibrate.tau_tolerance
    chosen = choose_scheme(candidates, tolerance)
    report = {"chosen": chosen, "fp32_tau": fp32_tau, "fp32_bytes": stored_bytes(tensors),
              "tau_tolerance": tolerance, "tau_prompts": len(probe.prompts), "candidates": candidates,
              "target_perplexity": "unchanged: only drafter weights are quantised"}
    (ctx.out / "quant.json").write_text(json.dumps(report, indent=2) + "\n")
    if chosen != "fp32":
        save_file(packed[chosen], str(ctx.out / "quant.safetensors"), metadata={"scheme": chosen})
    return report


# ---------------------------------------------------------------- the stage


def calibration_rows(ts: TokenizedSet, n: int, max_tokens: int) -> list[torch.Tensor]:
    rows = [ts.row(i)[0][:max_tokens] for i in range(len(ts))]
    rows = [r for r in rows if r.numel() >= 3][:n]  # a row needs two shared keys to say anything
    if not rows:
        raise ValueError(f"calibrate: no validation row has >= 3 tokens ({len(ts)} rows)")
    return rows


def budget_prompts(ctx: StageContext, val: TokenizedSet, s: CalibrateSettings) -> list[list[int]]:
    """Validation prompts after the ones validate times (the first validate.num_prompts), so the budget is not
    chosen on the prompts it is then judged on; the first ones when the split has no others."""
    n = ctx.cfg.validate.num_prompts
    return prompts_from(val, n + s.budget_prompts)[n:] or prompts_from(val, s.budget_prompts)


def corpus_field(ctx: StageContext, target) -> dict:
    """The EngineConfig field of the lookup corpus export will ship: {} without one."""
    corpus = lookup_corpus(ctx, target.config.vocab_size)
    return {} if corpus is None else {"lookup_corpus": corpus}


def run_calibrate(ctx: StageContext, s: CalibrateSettings = SETTINGS) -> StageResult:
    distill = ctx.input("distill")
    config = json.loads((distill / "drafter_config.json").read_text())
    kind = config["kind"]
    if kind not in WEIGHTED:
        (ctx.out / "quant.json").write_text(json.dumps({"chosen": NOT_APPLICABLE, "candidates": []}) + "\n")
        return StageResult(outputs={"quant": "quant.json"}, metrics={},
                           message=f"{kind} drafter has no weights: quantisation and layer map not applicable")
    target = load_target(ctx)
    tensors = load_file(str(distill / "drafter.safetensors"))
    val = TokenizedSet.load(ctx.input("prepare") / "val.safetensors")
    prompts = prompts_from(val, s.tau_prompts)
    if not prompts:
        raise ValueError("calibrate: the validation split has no row with a prompt before its assistant turn")
    probe = tau_probe(ctx, prompts, s.tau_new_tokens)
    quant = calibrate_quant(ctx, target, config, tensors, probe, s)
    outputs = {"quant": "quant.json"}
    if quant["chosen"] != "fp32":
        outputs["quant_weights"] = "quant.safetensors"
    metrics = {"fp32_tau": quant["fp32_tau"], "quant_bytes_ratio": next(
        (c["bytes"] / quant["fp32_bytes"] for c in quant["candidates"] if c["scheme"] == quant["chosen"]), 1.0)}
    metrics.update({f"tau_{c['scheme']}": c["tau"] for c in quant["candidates"] if "tau" in c})
    message = f"quant: {quant['chosen']} (fp32 tau {quant['fp32_tau']:.2f}); "
    c = ctx.cfg.calibrate
    model = build_drafter_model(config, target, tensors)
    rows = calibration_rows(val, c.prompts, c.tokens)
    # KV decode steps and draft budgets are timed in the precision validate and serving run: on an AMX CPU bf16
    # verifies a tree at relatively less cost than fp32, which moves the fastest budget
    precision = ctx.cfg.validate.precision
    timed = target if float_dtype(precision, target.device) == target.dtype else load_target(ctx, precision=precision)
    timed_model = model if timed is target else build_drafter_model(config, timed, tensors)
    kv_outputs, kv_metrics, kv_message = calibrate_kv(
        ctx.out, target, served_drafter(kind, model, target, tensors), rows, schemes=c.kv_schemes, recent=c.kv_recent,
        tau_tolerance=c.tau_tolerance, ppl_tolerance=c.ppl_tolerance, probe=probe, dense_tau=quant["fp32_tau"],
        timed=timed, decode_context=min(c.tokens, timed.max_seq_len - 1),  # rows are cut to c.tokens: may be larger
        max_slowdown=c.kv_max_slowdown)
    outputs |= kv_outputs
    metrics |= kv_metrics
    message += kv_message + "; "
    gate = ctx.cfg.validate.gate
    budget_outputs, budget_metrics, budget_message = calibrate_budget(
        ctx.out, timed, lambda: served_drafter(kind, timed_model, timed, tensors), budget_prompts(ctx, val, s),
        draft_budget(ctx), s.budget_new_tokens or ctx.cfg.validate.max_new_tokens,
        kv_engine_fields(json.loads((ctx.out / KV_QUANT).read_text())) | corpus_field(ctx, target),
        generation_stop_ids(ctx.target_dir), min_tau=gate.min_tau, min_speedup=gate.min_speedup,
        tau_margin=s.budget_tau_margin, lookups=tuple(sorted({0, ctx.cfg.drafter.lookup})))
    outputs |= budget_outputs
    metrics |= budget_metrics
    message += budget_message + "; "
    if kind in ATTENDING:
        spec_outputs, spec_metrics, spec_message = calibrate_specattn(
            ctx.out, target, model, served_drafter(kind, model, target, tensors), rows,
            dense_first=c.dense_first, top_p=c.top_p, ppl_tolerance=c.ppl_tolerance, probe=probe)
        outputs |= spec_outputs
        metrics |= spec_metrics
        message += spec_message
    else:
        message += f"SpecAttn not applicable (a {kind} drafter has no attention to select keys by)"
    return StageResult(outputs=outputs, metrics=metrics, message=message)
