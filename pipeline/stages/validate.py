"""The validate stage: load the exported bundle the way serving does, measure it on held-out prompts, gate it.

Every number comes from one process on the same prompts: our speculative engine, our autoregressive engine
(the same model, cache and verifier without a drafter) and HF transformers `generate`, each warmed up once
before timing; HF's methods first, in a phase of their own (its model is freed before ours loads), ours after,
back to back on each prompt; for an lm drafter also HF assisted generation (`generate(assistant_model=...)`, HF's own
speculative decoding) driving the same drafter LM converted to an HF model, and for a bundle that drafts with
the n-gram lookup branch also HF prompt lookup decoding (`generate(prompt_lookup_num_tokens=...)`, HF's own
drafter-free counterpart of that branch). Greedy losslessness (speculative
tokens == autoregressive tokens) is always measured, so temperature 0 is added when the config lists only
sampling temperatures. Headline metrics are the worst case over the temperatures measured; the gate reads them.
Then, untimed and greedy, the drafter runs once more with the whole configured tree and lookup branch
(`tau_configured`): what it can reach, where the served budget is the fastest calibrate found.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from pipeline.config import GateCfg
from pipeline.errors import DraftsmithError
from pipeline.home import digest_json, write_json_atomic
from pipeline.runstore import StageResult
from pipeline.stages.context import StageContext
from pipeline.stages.versus_champion import compare_with_champion
from runtime.speculation.decode_stats import Metrics
from runtime.speculation.engine import Engine
from runtime.speculation.sampling import SamplingParams

REPORT_JSON, REPORT_MD = "report.json", "report.md"
PROMPTS_JSONL = "prompts.jsonl"  # the prompts as token ids, which `pipeline bench --prompts` reads
ACCEPTANCE_PNG, SPEEDUP_PNG = "acceptance_by_depth.png", "speedup.png"
METHODS = ("spec", "ar", "hf")  # our speculative engine, our autoregressive engine, HF generate
HEADLINE = ("tau", "speedup", "speedup_hf", "tokens_per_s", "tokens_per_s_ar", "tokens_per_s_hf")  # worst case
ASSISTED = "hf_assisted"  # lm drafters only: HF assisted generation driving the same drafter LM
LOOKUP = "hf_lookup"  # bundles with the lookup branch: HF prompt lookup decoding of as many tokens
PEERS = {ASSISTED: "HF assisted generation", LOOKUP: "HF prompt lookup"}  # measured only where they apply
PEER_HEADLINE = tuple(f"{k}_{peer}" for peer in PEERS for k in ("speedup", "tokens_per_s"))

Generate = Callable[[list[int], SamplingParams, torch.Generator], tuple[list[int], Metrics | None]]


@dataclass(frozen=True)
class Timed:
    """One method at one temperature over all prompts."""
    tokens: list[list[int]]
    new_tokens: int
    seconds: float
    target_forwards: int  # 0 for HF generate, whose forwards we do not see
    acceptance_by_depth: list[float]  # mean over prompts of the engine's per-depth acceptance
    kv_saved: float = 0.0  # mean over prompts of the share of KV reads SpecAttn skipped

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds

    def tau(self, prompts: int) -> float:  # the first token of each prompt comes from the prefill
        return (self.new_tokens - prompts) / max(self.target_forwards, 1)


def time_methods(methods: dict[str, Generate], prompts: list[list[int]], params: SamplingParams,
                 seed: int, repeats: int = 1, desc: str = "validate") -> dict[str, Timed]:
    """Every method over all prompts, the methods back to back on each prompt, the fastest of `repeats` runs of
    each (pipeline.bench.harness.interleaved), with a progress bar named `desc`."""
    from tqdm import tqdm

    from pipeline.bench.harness import interleaved

    outputs = {name: [] for name in methods}
    seconds = dict.fromkeys(methods, 0.0)
    forwards = dict.fromkeys(methods, 0)
    by_depth = {name: [] for name in methods}
    kv_saved = {name: [] for name in methods}
    runs = {name: lambda ids, gen, run=run: run(ids, params, gen) for name, run in methods.items()}
    with tqdm(total=len(methods) * len(prompts) * repeats, desc=desc, unit="run") as bar:
        measured = list(interleaved(runs, prompts, seed, repeats, progress=bar))
    for name, elapsed, tokens, metrics in measured:
        seconds[name] += elapsed
        outputs[name].append(tokens)
        if metrics is not None:
            forwards[name] += metrics.target_forwards
            by_depth[name].append(metrics.acceptance_by_depth)
            kv_saved[name].append(metrics.kv_saved)
    return {name: Timed(outputs[name], sum(map(len, outputs[name])), seconds[name], forwards[name],
                        mean_by_depth(by_depth[name]), sum(kv_saved[name]) / max(len(kv_saved[name]), 1))
            for name in methods}


def mean_by_depth(by_depth: list[list[float]]) -> list[float]:
    """Per-depth acceptance averaged over prompts; a depth that a prompt never offered (e.g. after the engine fell
    back) has no rate: average the others."""
    depths = max(map(len, by_depth), default=0)
    return [sum(a[d] for a in by_depth if len(a) > d) / sum(len(a) > d for a in by_depth) for d in range(depths)]


def gate_reasons(metrics: dict, gate: GateCfg, sparse: bool = False) -> list[str]:
    reasons = []
    if metrics["tau"] < gate.min_tau:
        reasons.append(f"tau {metrics['tau']:.3f} < gate.min_tau {gate.min_tau}")
    if metrics["speedup"] < gate.min_speedup:
        reasons.append(f"speedup over our autoregressive decode {metrics['speedup']:.3f} < gate.min_speedup "
                       f"{gate.min_speedup}")
    if gate.require_lossless and not metrics["lossless"]:
        reasons.append(f"greedy speculative output differs from autoregressive output on "
                       f"{metrics['lossy_prompts']} prompt(s) (gate.require_lossless)"
                       + "; the bundle's SpecAttn sparse verification (specattn.json) is lossy by design: "
                       "set gate.require_lossless=false to accept it" * sparse)
    return reasons


def measure(ctx: StageContext, prompts: list[list[int]], temperatures: list[float]) -> dict:
    """Per temperature: each method's Timed numbers, plus the bundle's kind and the device facts. HF's methods run
    first, in a phase of their own (pipeline.bench.harness.with_hf): HF's model is freed before ours loads, so the
    two are never resident together."""
    from pipeline.bench.harness import device_name, fitting_context, with_hf
    from pipeline.sources import target_fingerprint
    from runtime.bundle_reader import read_bundle
    from runtime.serving.served_engine import served_engine
    from runtime.target.precision import float_dtype

    bundle = read_bundle(ctx.input("export") / "bundle", target_fingerprint(ctx.target_dir))  # refuses tampering
    v, configured = ctx.cfg.validate, ctx.configured_budget()
    served_budget = bundle.served_budget(configured)
    longest = max(served_budget.tree.max_nodes, configured.tree.max_nodes + configured.lookup)
    limit = fitting_context(ctx.target_dir, prompts, v.max_new_tokens)  # a clear error for a prompt too long
    max_seq_len = min(limit, max(map(len, prompts)) + v.max_new_tokens + longest + 1)
    stop_ids, seed = ctx.stop_ids(), ctx.cfg.run.seed
    dtype = float_dtype(v.precision, torch.device("cpu"))
    hf_timed = with_hf(ctx.target_dir, dtype, "cpu", lambda hf: timed_phase(
        hf_methods(hf, bundle, served_budget.lookup, dtype, v.max_new_tokens, stop_ids), prompts, temperatures, seed,
        v.repeats, "validate: HF"))
    target = ctx.load_target(max_seq_len, v.precision)
    served = served_engine(bundle, target, max_seq_len, fallback=configured)  # what serving runs on this device
    engines = {"spec": served.engine, "ar": served.plain()}
    timed = timed_phase({name: ours(e, v.max_new_tokens, stop_ids) for name, e in engines.items()}, prompts,
                        temperatures, seed, v.repeats, "validate")
    timed = {t: {**timed[t], **hf_timed[t]} for t in temperatures}
    # the drafter's reach: greedy with the whole configured tree and lookup branch, which the served budget
    # trades for speed where a wide verify costs more than it gains (untimed; a fresh drafter, the same KV)
    full = served_engine(bundle, target, max_seq_len, budget=configured, speed_check=False,
                         new_drafter=served.new_drafter).engine
    configured_tree = time_methods({"full": ours(full, v.max_new_tokens, stop_ids)}, prompts, SamplingParams(), seed,
                                   desc="validate: the configured tree")["full"]
    return {"kind": bundle.kind, "dtype": str(target.dtype).removeprefix("torch."), "device": device_name(),
            "budget": budget_dict(engines["spec"]), "timed": timed,
            "sparse": None if served.engine.cfg.sparse is None else asdict(served.engine.cfg.sparse),
            "configured_tree": {"budget": budget_dict(full), "timed": configured_tree}}


def ours(engine: Engine, max_new_tokens: int, stop_ids: tuple[int, ...]) -> Generate:
    def run(ids, params, gen):
        out = engine.generate(ids, max_new_tokens, params, gen, stop_ids)
        return out.tokens, out.metrics
    return run


def hf_methods(hf, bundle, lookup: int, dtype: torch.dtype, max_new_tokens: int,
               stop_ids: tuple[int, ...]) -> dict[str, Generate]:
    """HF generate on `hf`, and its peers where the bundle has them: HF assisted generation with the bundle's drafter
    LM, HF prompt lookup of `lookup` tokens where the engine drafts with the lookup branch."""
    from pipeline.bench.harness import hf_generate
    from runtime.drafters import get_kind, hf_assistant

    methods: dict[str, Generate] = {
        "hf": lambda ids, params, gen: (hf_generate(hf, ids, max_new_tokens, params, stop_ids, gen), None)}
    assistant = hf_assistant(bundle, dtype)
    if assistant is not None:  # HF's defaults decide how far the assistant drafts (num_assistant_tokens & co)
        methods[ASSISTED] = lambda ids, params, gen: (
            hf_generate(hf, ids, max_new_tokens, params, stop_ids, gen, assistant=assistant), None)
    if lookup and get_kind(bundle.kind).weighted:  # the engine's lookup branch drafts beside a weighted drafter
        methods[LOOKUP] = lambda ids, params, gen: (
            hf_generate(hf, ids, max_new_tokens, params, stop_ids, gen, prompt_lookup=lookup), None)
    return methods


def timed_phase(methods: dict[str, Generate], prompts: list[list[int]], temperatures: list[float], seed: int,
                repeats: int, desc: str) -> dict[float, dict[str, Timed]]:
    """Each temperature's time_methods of `methods`, after a warm-up of each on a whole generation (allocator,
    kernels, caches, the tree-verify path); progress bars named `desc`."""
    from tqdm import tqdm

    for run in tqdm(list(methods.values()), desc=f"{desc}: warm-up", unit="method"):
        run(prompts[0], SamplingParams(), torch.Generator().manual_seed(0))
    return {t: time_methods(methods, prompts, SamplingParams(temperature=t), seed, repeats, f"{desc}: T={t:g}")
            for t in temperatures}


def greedy_tau(engine: Engine, prompts: list[list[int]], max_new_tokens: int, stop_ids: tuple[int, ...], seed: int,
               desc: str) -> float:
    """Tau of `engine` over `prompts`, greedy and untimed (a progress bar named `desc`)."""
    def run(ids, params, gen):
        out = engine.generate(ids, max_new_tokens, params, gen, stop_ids)
        return out.tokens, out.metrics
    return time_methods({"spec": run}, prompts, SamplingParams(), seed, desc=desc)["spec"].tau(len(prompts))


def budget_dict(engine: Engine) -> dict:
    """The draft budget `engine` runs (its lookup branch as the engine uses it: a weightless drafter has none), and
    whether the branch drafts from a corpus."""
    from runtime.speculation.draft_budget import ServedBudget

    budget = ServedBudget.of(engine.cfg)
    lookup = budget.lookup if engine.lookup is not None else 0
    return {**budget.to_dict(), "lookup": lookup, "lookup_corpus": bool(lookup) and engine.lookup.corpus is not None}


def budget_label(budget: dict) -> str:
    from runtime.speculation.draft_budget import ServedBudget

    return ServedBudget.from_dict(budget).label(budget.get("lookup_corpus", False))


def lossy_prompts(spec: Timed, ar: Timed) -> int:
    """Prompts on which greedy speculation's tokens differ from our autoregressive decode's."""
    return sum(a != b for a, b in zip(spec.tokens, ar.tokens))


def per_temperature(t: float, timed: dict[str, Timed], prompts: int) -> dict:
    spec, ar, hf = (timed[m] for m in METHODS)
    row = {"temperature": t, "tau": spec.tau(prompts), "acceptance_by_depth": spec.acceptance_by_depth,
           "tokens_per_s": spec.tokens_per_s, "tokens_per_s_ar": ar.tokens_per_s, "tokens_per_s_hf": hf.tokens_per_s,
           "speedup": spec.tokens_per_s / ar.tokens_per_s, "speedup_hf": spec.tokens_per_s / hf.tokens_per_s,
           "new_tokens": {m: run.new_tokens for m, run in timed.items()}}
    for peer in PEERS:
        if peer in timed:
            row |= {f"tokens_per_s_{peer}": timed[peer].tokens_per_s,
                    f"speedup_{peer}": spec.tokens_per_s / timed[peer].tokens_per_s}
    if t == 0.0:
        row["lossy_prompts"] = lossy_prompts(spec, ar)
    if spec.kv_saved:
        row["kv_saved"] = spec.kv_saved
    return row


def write_report_md(path: Path, report: dict) -> None:
    peers = [(peer, label) for peer, label in PEERS.items() if f"speedup_{peer}" in report["temperatures"][0]]
    extra_head = "".join(f" {label} tok/s | speedup vs {label} |" for _, label in peers)
    full = report["configured_tree"]
    lines = [f"# Validation of a {report['drafter_kind']} drafter", "",
             f"{report['prompts']} held-out prompts, {report['max_new_tokens']} new tokens"
             + (f" (the fastest of {report['repeats']} runs each)" if report["repeats"] > 1 else "")
             + f", {report['dtype']} on {report['device']}; draft budget {budget_label(report['budget'])} (as served)",
             "",
             "| T | tau | spec tok/s | our AR tok/s | HF tok/s | speedup vs our AR | speedup vs HF |" + extra_head,
             "|---|---|---|---|---|---|---|" + "---|---|" * len(peers)]
    for r in report["temperatures"]:
        extra = "".join(f" {r[f'tokens_per_s_{peer}']:.1f} | {r[f'speedup_{peer}']:.2f}x |" for peer, _ in peers)
        lines.append(f"| {r['temperature']:g} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['tokens_per_s_ar']:.1f} "
                     f"| {r['tokens_per_s_hf']:.1f} | {r['speedup']:.2f}x | {r['speedup_hf']:.2f}x |" + extra)
    gate = report["gate"]
    if report.get("versus_champion"):
        m, vs = report["metrics"], report["versus_champion"]
        lines += ["", f"Beside the champion, greedy, each with its own served budget: tau {m['traffic_tau']:.2f} on "
                  f"{vs['traffic_prompts']} held-out recent traffic prompts and {m['base_tau']:.2f} on the base prompts"
                  + (f"; the champion (version {m['compared_with_version']}) {m['champion_traffic_tau']:.2f} and "
                     f"{m['champion_base_tau']:.2f}" if vs["champion"] else "; there is no champion yet") + "."]
    if report["sparse"] is not None:
        lines += ["", f"SpecAttn sparse verification (top-p {report['sparse']['top_p']:g}, layer map in "
                  f"`layer_map.json`): {100 * report['metrics']['kv_saved']:.1f}% of the KV reads skipped. It is lossy "
                  "by design: the speculative output is the sparse target's."]
    lines += ["", f"Greedy lossless: {'yes' if report['metrics']['lossless'] else 'NO'}", "",
              f"With the configured tree ({budget_label(full['budget'])}), greedy, untimed: tau {full['tau']:.2f}, "
              f"lossless {'yes' if not full['lossy_prompts'] else 'NO'}. This is the drafter's reach; the calibrated "
              "budget above gives some of it up where a smaller verify is faster.", "",
              f"Gate: {'passed' if gate['passed'] else 'FAILED: ' + '; '.join(gate['reasons'])}", "",
              f"The prompts are in `{PROMPTS_JSONL}`; `pipeline bench --target <target> --drafter <bundle> --prompts "
              f"{PROMPTS_JSONL} --dtype {report['dtype']}` times the same methods on them again.", ""]
    path.write_text("\n".join(lines))


def write_plots(out: Path, rows: list[dict], configured: dict) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    curves = [(r["acceptance_by_depth"], f"served budget, T={r['temperature']:g}", "-") for r in rows]
    curves.append((configured["acceptance_by_depth"], "configured tree, T=0", "--"))
    for acc, label, style in curves:
        ax.plot(range(1, len(acc) + 1), acc, style, marker="o", label=label)
    ax.set(xlabel="draft depth", ylabel="acceptance rate", ylim=(0, 1.05), title="Acceptance by depth")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / ACCEPTANCE_PNG, dpi=100)

    fig = Figure(figsize=(5, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    x = list(range(len(rows)))
    bars = [("speedup", "vs our autoregressive"), ("speedup_hf", "vs HF generate")]
    bars += [(f"speedup_{peer}", f"vs {label}") for peer, label in PEERS.items() if f"speedup_{peer}" in rows[0]]
    width = 0.8 / len(bars)
    for j, (key, label) in enumerate(bars):
        ax.bar([i + (j - (len(bars) - 1) / 2) * width for i in x], [r[key] for r in rows], width=width, label=label)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(x, [f"T={r['temperature']:g}" for r in rows])
    ax.set(ylabel="speedup (x)", title="Speculative decoding speedup")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / SPEEDUP_PNG, dpi=100)


def run_validate(ctx: StageContext) -> StageResult:
    v = ctx.cfg.validate
    prompts = ctx.validation_prompts(v.num_prompts)
    if not prompts:
        raise DraftsmithError(f"validate: {ctx.input('prepare') / 'val.safetensors'} has no row with a prompt before "
                              "its first assistant token")
    temperatures = list(dict.fromkeys([0.0, *map(float, v.temperatures)]))  # greedy first: losslessness
    measured = measure(ctx, prompts, temperatures)
    rows = [per_temperature(t, measured["timed"][t], len(prompts)) for t in temperatures]
    lossy = rows[0]["lossy_prompts"]
    full = measured["configured_tree"]
    configured = {"budget": full["budget"], "tau": full["timed"].tau(len(prompts)),
                  "acceptance_by_depth": full["timed"].acceptance_by_depth,
                  "lossy_prompts": lossy_prompts(full["timed"], measured["timed"][0.0]["ar"])}
    metrics = {k: min(r[k] for r in rows) for k in HEADLINE + PEER_HEADLINE if k in rows[0]}
    metrics |= {"lossless": lossy == 0, "lossy_prompts": lossy, "tau_configured": configured["tau"]}
    sparse = measured["sparse"]
    if sparse is not None:
        metrics["kv_saved"] = min(r.get("kv_saved", 0.0) for r in rows)
    reasons = gate_reasons(metrics, v.gate, sparse is not None)
    versus = compare_with_champion(ctx, prompts, lambda engine, ids, desc: greedy_tau(
        engine, ids, v.max_new_tokens, ctx.stop_ids(), ctx.cfg.run.seed, desc))
    if versus is not None:
        metrics |= versus.pop("metrics")
    report = {"metrics": metrics, "gate": {"passed": not reasons, "reasons": reasons, **v.gate.model_dump()},
              "temperatures": rows, "drafter_kind": measured["kind"], "prompts": len(prompts),
              "max_new_tokens": v.max_new_tokens, "repeats": v.repeats, "dtype": measured["dtype"],
              "device": measured["device"], "budget": measured["budget"], "sparse": sparse,
              "configured_tree": configured, "versus_champion": versus,
              "validation_digest": digest_json({"prompt_ids": prompts, "temperatures": temperatures,
                                                "max_new_tokens": v.max_new_tokens})}
    write_json_atomic(ctx.out / REPORT_JSON, report)
    (ctx.out / PROMPTS_JSONL).write_text("".join(json.dumps({"ids": ids}) + "\n" for ids in prompts))
    write_report_md(ctx.out / REPORT_MD, report)
    write_plots(ctx.out, rows, configured)
    summary = (f"tau {metrics['tau']:.2f}, {metrics['speedup']:.2f}x over our AR, {metrics['speedup_hf']:.2f}x over "
               f"HF generate, lossless {metrics['lossless']}; tau {configured['tau']:.2f} with the configured tree "
               f"({budget_label(configured['budget'])})")
    summary += "".join(f", {metrics[f'speedup_{peer}']:.2f}x over {label}" for peer, label in PEERS.items()
                       if f"speedup_{peer}" in metrics)
    if versus is not None:
        summary += f"; tau {metrics['traffic_tau']:.2f} on recent traffic, {metrics['base_tau']:.2f} on the base prompts" \
            + (f" (the champion's {metrics['champion_traffic_tau']:.2f} and {metrics['champion_base_tau']:.2f})"
               if versus["champion"] else " (no champion yet)")
    if sparse is not None:
        summary += f"; SpecAttn top-p {sparse['top_p']:g} skipped {100 * metrics['kv_saved']:.1f}% of KV reads"
    return StageResult(status="completed" if not reasons else "gate_failed",
                       outputs={"report": REPORT_JSON, "report_md": REPORT_MD, "prompts": PROMPTS_JSONL,
                                "plots": [ACCEPTANCE_PNG, SPEEDUP_PNG]},
                       metrics={k: float(val) for k, val in metrics.items()},
                       message=summary if not reasons else f"gate failed: {'; '.join(reasons)} ({summary})")
