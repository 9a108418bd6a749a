"""The calibrate stage: drafter weight quantisation chosen by measured tau (weights.py), KV-cache quantisation by
measured perplexity, tau and decode speed (kv.py), the draft budget by measured speed (budget_search.py), and the
SpecAttn layer map with its top-p (specattn_sweep.py, layer_map.py). Every phase measures in the runtime, as serving
will run."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from tqdm import tqdm

from export.calibrate.budget_search import calibrate_budget
from export.calibrate.kv import calibrate_kv
from export.calibrate.specattn_sweep import calibrate_specattn
from export.calibrate.weights import calibrate_quant
from runtime.bundle_reader import KV_QUANT, kv_engine_fields
from runtime.drafters import DRAFT_VOCAB, drafter_module, get_kind, served_drafter
from runtime.drafters.ngram import load_corpus
from runtime.files import read_tensors
from runtime.host_memory import release_freed_memory
from runtime.speculation.draft_budget import ServedBudget
from runtime.speculation.tau_probe import TauProbe
from runtime.target.model import Transformer
from runtime.target.model_config import ModelConfig

NOT_APPLICABLE = "not applicable"


class CalibrateContext(Protocol):
    """What calibrate needs of the stage context the pipeline runs it with (pipeline.stages.context.StageContext)."""
    cfg: Any  # the run's pipeline.config.Config
    out: Path
    target_dir: Path

    def input(self, stage: str) -> Path: ...
    def load_target(self, max_seq_len: int | None = ..., precision: str = ..., *,
                    min_seq_len: int = ...) -> Transformer: ...
    def configured_budget(self) -> ServedBudget: ...
    def stop_ids(self) -> tuple[int, ...]: ...
    def tau_probe(self, prompts: list[list[int]], new_tokens: int) -> TauProbe: ...
    def validation_set(self) -> Any: ...  # prepare's held-out rows: len() and row(i) -> (token ids, mask)
    def validation_prompts(self, n: int) -> list[list[int]]: ...
    def lookup_corpus_file(self) -> Path | None: ...
    def result(self, outputs: dict, metrics: dict, message: str) -> Any: ...


@dataclass(frozen=True)
class CalibrateSettings:
    tau_prompts: int = 4
    tau_new_tokens: int = 32
    budget_new_tokens: int = 0  # 0: validate's max_new_tokens (the lookup branch gains as a reply grows)
    # the chosen budget's tau should clear validate.gate.min_tau by this fraction on these few prompts, so that it
    # clears it on validate's prompts too
    budget_tau_margin: float = 0.1
    # a draft budget is timed if it could win running this much faster than predicted (export.calibrate.predict)
    budget_prediction_margin: float = 0.1


SETTINGS = CalibrateSettings()


def calibration_rows(ts: Any, n: int, max_tokens: int) -> list[torch.Tensor]:
    rows = [ts.row(i)[0][:max_tokens] for i in range(len(ts))]
    rows = [r for r in rows if r.numel() >= 3][:n]  # a row needs two shared keys to say anything
    if not rows:
        raise ValueError(f"calibrate: no validation row has >= 3 tokens ({len(ts)} rows)")
    return rows


def long_rows(ts: Any, n: int, context: int) -> list[torch.Tensor]:
    """Up to n rows of `context` tokens: the held-out conversations one after another, cut into pieces."""
    stream = torch.cat([ts.row(i)[0] for i in range(len(ts))])
    rows = [r for r in stream[: n * context].split(context) if r.numel() == context]
    if not rows:
        raise ValueError(f"calibrate.context={context}: the validation split holds {stream.numel()} tokens, not one "
                         f"row of {context} (lower calibrate.context or hold out more conversations)")
    return rows


def long_prompts(ts: Any, prompts: list[list[int]], context: int) -> list[list[int]]:
    """Each prompt after the other held-out conversations, joined and cut to fill `context` tokens before it: a
    reply drafted at that context. A prompt's own conversation is left out, or the lookup would copy its reply."""
    rows = [ts.row(i)[0].tolist() for i in range(len(ts))]
    out = []
    for p in prompts:
        history = [t for r in rows if r[: len(p)] != p for t in r][-(context - len(p)):] if context > len(p) else []
        if len(history) + len(p) < context:
            raise ValueError(f"calibrate.context={context}: the validation split holds {len(history)} tokens besides "
                             f"a {len(p)}-token prompt's conversation, fewer than the context")
        out.append(history + p)
    return out


def budget_prompts(num_validate: int, ctx: CalibrateContext, n: int) -> list[list[int]]:
    """`n` validation prompts after the ones validate times (its first `num_validate`), so the budget is not chosen
    on the prompts it is then judged on; the first ones when the split has no others."""
    return ctx.validation_prompts(num_validate + n)[num_validate:] or ctx.validation_prompts(n)


def weight_quant(out: Path, target: Transformer, config: dict, load: Callable[[], dict], probe: TauProbe,
                 c) -> tuple[dict, dict, str]:
    """The drafter weights' scheme (weights.py): calibrate's outputs, metrics and message so far."""
    quant = calibrate_quant(out, target, config, load, probe, list(c.weight_schemes), c.tau_tolerance)
    outputs = {"quant": "quant.json"}
    if quant["chosen"] != "fp32":
        outputs["quant_weights"] = "quant.safetensors"
    metrics = {"fp32_tau": quant["fp32_tau"], "quant_bytes_ratio": next(
        (c["bytes"] / quant["fp32_bytes"] for c in quant["candidates"] if c["scheme"] == quant["chosen"]), 1.0)}
    metrics.update({f"tau_{c['scheme']}": c["tau"] for c in quant["candidates"] if "tau" in c})
    return outputs, metrics, f"quant: {quant['chosen']} (fp32 tau {quant['fp32_tau']:.2f}); "


def run_calibrate(ctx: CalibrateContext, s: CalibrateSettings = SETTINGS):
    distill = ctx.input("distill")
    config = json.loads((distill / "drafter_config.json").read_text())
    kind = get_kind(config["kind"])
    if not kind.weighted:
        (ctx.out / "quant.json").write_text(json.dumps({"chosen": NOT_APPLICABLE, "candidates": []}) + "\n")
    if not kind.calibrates:
        return ctx.result({"quant": "quant.json"}, {},
                          f"{kind.name} drafter has no weights: quantisation and layer map not applicable")
    c, v = ctx.cfg.calibrate, ctx.cfg.validate
    configured, corpus_file = ctx.configured_budget(), ctx.lookup_corpus_file()
    with tqdm(total=2, desc="calibrate: load", unit="step") as bar:
        # in validate's precision, as serving runs: bf16 verifies a tree at relatively less cost than fp32 where it
        # is fast, which moves the fastest budget. One target measures and times, since two (fp32 beside bf16) held
        # the 1.5B twice
        bar.set_postfix_str(f"target ({v.precision})")
        # drafting after calibrate.context tokens: the whole tree past the last new token
        positions = c.context + s.tau_new_tokens + configured.tree.max_nodes + configured.lookup + 1 if c.context else 0
        limit = ModelConfig.from_dir(ctx.target_dir).max_position_embeddings
        if positions > limit:
            raise ValueError(f"calibrate.context={c.context}: drafting {s.tau_new_tokens} tokens after it needs "
                             f"{positions} positions, more than the target's context of {limit}")
        target = ctx.load_target(min_seq_len=positions, precision=v.precision)  # once: a freed copy stays resident
        bar.update()
        bar.set_postfix_str("validation rows")
        val = ctx.validation_set()
        bar.update()
    release_freed_memory()  # the loads' transient copies: held by the allocator, they would stay resident
    prompts = ctx.validation_prompts(s.tau_prompts)
    if not prompts:
        raise ValueError("calibrate: the validation split has no row with a prompt before its assistant turn")
    probe = ctx.tau_probe(prompts, s.tau_new_tokens)

    def drafter_on(t: Transformer, module):
        return served_drafter(config, module, t, vocab)

    weights_file = distill / "drafter.safetensors"
    outputs, metrics, message = (
        weight_quant(ctx.out, target, config, lambda: read_tensors(weights_file), probe, c) if kind.weighted else
        ({"quant": "quant.json"}, {}, f"{kind.name} drafter has no weights to quantise; "))
    # built after the schemes are measured, which build their own: in bf16 it is a copy beside the fp32 tensors
    model, vocab = None, {}
    if kind.weighted:
        tensors = read_tensors(weights_file)
        model, vocab = drafter_module(config, target, tensors), {k: t for k, t in tensors.items() if k == DRAFT_VOCAB}
        del tensors  # the module holds them alone, so packing frees each plain weight
        drafter_on(target, model)  # packs it, where its kind drafts from packed weights
        release_freed_memory()

    rows = calibration_rows(val, c.prompts, c.tokens)
    # KV schemes and SpecAttn pay off as the context grows: calibrate.context measures them there. Both compare
    # with the drafter's dense tau by their probe: fp32_tau is that of the short one
    long_ids, long_probe = None, probe
    dense_tau = metrics["fp32_tau"] if kind.weighted else probe.measure(target, drafter_on(target, model))["tau"]
    if c.context:
        long_ids = long_rows(val, c.prompts, c.context)
        long_probe = ctx.tau_probe(long_prompts(val, prompts, c.context), s.tau_new_tokens)
        dense_tau = long_probe.measure(target, drafter_on(target, model))["tau"]
    kv_outputs, kv_metrics, kv_message = calibrate_kv(
        ctx.out, target, drafter_on(target, model), long_ids or rows, schemes=c.kv_schemes, recent=c.kv_recent,
        tau_tolerance=c.tau_tolerance, ppl_tolerance=c.ppl_tolerance, probe=long_probe, dense_tau=dense_tau,
        decode_context=c.context or min(c.tokens, target.max_seq_len - 1),  # rows may be shorter
        max_slowdown=c.kv_max_slowdown)
    outputs |= kv_outputs
    metrics |= kv_metrics
    if c.context:
        message += f"KV and SpecAttn measured at {c.context} tokens of context; "
    message += kv_message + "; "
    engine_fields = kv_engine_fields(json.loads((ctx.out / KV_QUANT).read_text()))
    if corpus_file is not None:  # the corpus export will ship, so the budget is timed drafting from it
        engine_fields["lookup_corpus"] = load_corpus(corpus_file, configured.lookup)
    budget_outputs, budget_metrics, budget_message = calibrate_budget(
        ctx.out, target, lambda: drafter_on(target, model), budget_prompts(v.num_prompts, ctx, c.budget_prompts),
        configured.tree, s.budget_new_tokens or v.max_new_tokens, engine_fields, ctx.stop_ids(),
        min_tau=v.gate.min_tau, min_speedup=v.gate.min_speedup, tau_margin=s.budget_tau_margin,
        lookups=tuple(sorted({0, configured.lookup})), margin=s.budget_prediction_margin)
    outputs |= budget_outputs
    metrics |= budget_metrics
    message += budget_message + "; "
    if kind.attends:
        spec_outputs, spec_metrics, spec_message = calibrate_specattn(
            ctx.out, target, kind, model, drafter_on(target, model), rows, dense_first=c.dense_first, top_p=c.top_p,
            ppl_tolerance=c.ppl_tolerance, probe=long_probe, dense_tau=dense_tau, long_ids=long_ids)
        outputs |= spec_outputs
        metrics |= spec_metrics
        message += spec_message
    else:
        message += f"SpecAttn not applicable (a {kind.name} drafter has no attention to select keys by)"
    return ctx.result(outputs, metrics, message)
