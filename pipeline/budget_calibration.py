"""Draft budget calibration: the draft tree the engine should grow, chosen by tokens/s measured on this machine.

How big a tree pays depends on the drafter's acceptance and on what the hardware charges for a wider verify and
a deeper draft: on the 2-core CPU a 24-node verify costs 1.9x a one-token decode, so a drafter accepting ~50% per
depth is fastest with a 4-node tree (1.25x over plain decoding) and slower than plain decoding with 24 nodes
(0.82x). Each candidate runs the engine as serving will (the chosen KV scheme, greedy) on held-out prompts that
validate does not time; the fastest that clears validate's gate (tau and speedup) becomes draft_budget.json, which
export ships and validate and serving read (runtime.bundle.Bundle.engine_settings). Both floors matter: the fastest
budget on the CPU is often a one-token chain, whose tau (at most 2) may fall below gate.min_tau when a larger tree's
would not, and for a weak drafter the only tree whose tau clears the floor with room to spare may be slower than
plain decoding.

Each tree is also tried with the n-gram lookup branch (EngineConfig.lookup): a target that repeats itself or its
prompt gets those nodes accepted whatever the drafter proposed, and the timing says whether the wider verify pays.
"""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.validate import time_method
from runtime.drafter import DraftBudget
from runtime.engine import Engine, EngineConfig
from runtime.model import Transformer
from runtime.sampling import SamplingParams

# (depth, width, nodes): chains and small trees up to the configured budget, which is also tried adaptively
LADDER = ((1, 1, 1), (2, 1, 2), (2, 2, 4), (3, 2, 6), (4, 2, 8), (4, 3, 12), (5, 4, 16))


def candidates(configured: DraftBudget, lookups: tuple[int, ...] = (0,)) -> list[tuple[DraftBudget, bool, int]]:
    """(budget, adaptive, lookup) triples: the ladder's rungs within the configured budget, then the configured one
    fixed and adaptive (EngineConfig.adaptive shrinks the depth to recent acceptance and may stop drafting), each
    with every lookup branch size."""
    out = [DraftBudget(depth=d, width=w, nodes=n) for d, w, n in LADDER
           if d <= configured.depth and w <= configured.width and n <= configured.max_nodes]
    out = [b for b in out if b != configured] + [configured]
    trees = [(b, False) for b in out] + [(configured, True)]
    return [(b, adaptive, lookup) for lookup in lookups for b, adaptive in trees]


def choose_budget(sweep: list[dict], min_tau: float, min_speedup: float = 0.0, tau_margin: float = 0.0) -> dict:
    """The fastest sweep entry that clears validate's gate floors (tau >= min_tau, speedup >= min_speedup) with
    `tau_margin` to spare, since these few prompts are not validate's; else the fastest that clears the floors
    themselves (a weak drafter's only tree with the margin may be slower than plain decoding); else the fastest of
    all (validate will then fail the gate whatever the budget, and says so)."""
    for tau_floor in (min_tau * (1 + tau_margin), min_tau):
        ok = [r for r in sweep if r["tau"] >= tau_floor and r["speedup"] >= min_speedup]
        if ok:
            return max(ok, key=lambda r: r["tokens_per_s"])
    return max(sweep, key=lambda r: r["tokens_per_s"])


def calibrate_budget(out: Path, target: Transformer, new_drafter, prompts: list[list[int]], configured: DraftBudget,
                     new_tokens: int, kv: dict, stop_ids: tuple[int, ...],
                     min_tau: float = 0.0, min_speedup: float = 0.0, tau_margin: float = 0.0,
                     lookups: tuple[int, ...] = (0,)) -> tuple[dict[str, str], dict, str]:
    """Time our autoregressive decode and every candidate on `prompts` (`new_drafter()` gives a fresh drafter, `kv`
    the KV EngineConfig fields); choose one by choose_budget; write draft_budget.json and .png to `out`; return
    (outputs, metrics, message)."""
    max_seq_len = max(map(len, prompts)) + new_tokens + configured.max_nodes + max(lookups) + 1

    def tokens_per_s(drafter, budget: DraftBudget, adaptive: bool, lookup: int) -> tuple[float, float]:
        engine = Engine(target, drafter, EngineConfig(max_seq_len=max_seq_len, budget=budget, adaptive=adaptive,
                                                      lookup=lookup, **kv))

        def run(ids, params, gen):
            g = engine.generate(ids, new_tokens, params, gen, stop_ids)
            return g.tokens, g.metrics

        run(prompts[0], SamplingParams(), None)  # warm-up: allocator, the tree-verify path
        timed = time_method(run, prompts, SamplingParams(), seed=0)
        return timed.tokens_per_s, timed.tau(len(prompts))

    ar_rate, _ = tokens_per_s(None, configured, False, 0)
    sweep = []
    for budget, adaptive, lookup in candidates(configured, lookups):
        rate, tau = tokens_per_s(new_drafter(), budget, adaptive, lookup)
        sweep.append({"depth": budget.depth, "width": budget.width, "nodes": budget.max_nodes, "adaptive": adaptive,
                      "lookup": lookup, "tokens_per_s": rate, "speedup": rate / ar_rate, "tau": tau})
    best = choose_budget(sweep, min_tau, min_speedup, tau_margin)
    chosen = {k: best[k] for k in ("depth", "width", "nodes", "adaptive", "lookup")}
    report = {"chosen": chosen, "min_tau": min_tau, "min_speedup": min_speedup, "tau_margin": tau_margin,
              "tokens_per_s_ar": ar_rate,
              "dtype": str(target.dtype).removeprefix("torch."), "prompts": len(prompts),
              "new_tokens": new_tokens, "sweep": sweep}
    (out / "draft_budget.json").write_text(json.dumps(report, indent=2) + "\n")
    plot_budgets(sweep, out / "draft_budget.png")
    label = f"depth {best['depth']} width {best['width']} nodes {best['nodes']}" + " adaptive" * best["adaptive"] \
        + f" + lookup {best['lookup']}" * bool(best["lookup"])
    metrics = {"budget_speedup": best["speedup"], "budget_tokens_per_s": best["tokens_per_s"],
               "budget_nodes": float(best["nodes"]), "budget_lookup": float(best["lookup"]),
               "budget_tokens_per_s_ar": ar_rate}
    return ({"draft_budget": "draft_budget.json", "draft_budget_plot": "draft_budget.png"}, metrics,
            f"draft budget {label}: {best['speedup']:.2f}x over our AR (tau {best['tau']:.2f}"
            + (")" if best["tau"] >= min_tau and best["speedup"] >= min_speedup else
               f"; none reaches tau {min_tau:.2f} at {min_speedup:.2f}x)"))


def plot_budgets(sweep: list[dict], path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6, 0.5 * len(sweep)), 3.5))
    ax = fig.add_subplot()
    labels = [f"{r['depth']}x{r['width']}/{r['nodes']}" + ("\nadaptive" if r["adaptive"] else "")
              + (f"\n+lookup {r['lookup']}" if r.get("lookup") else "") for r in sweep]
    colors = [("tab:green" if r.get("lookup") else "tab:blue", "tab:olive" if r.get("lookup") else "tab:orange")
              [r["adaptive"]] for r in sweep]
    ax.bar(range(len(sweep)), [r["speedup"] for r in sweep], color=colors)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(sweep)), labels, fontsize="x-small")
    ax.set(xlabel="draft budget (depth x width / nodes)", ylabel="speedup over our AR (x)",
           title="Draft budget: measured speedup")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path
