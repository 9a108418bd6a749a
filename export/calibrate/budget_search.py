"""Draft budget calibration: the draft tree the engine should grow, chosen by tokens/s measured on this machine.

How big a tree pays depends on the drafter's acceptance and on what the hardware charges for a wider verify and
a deeper draft: on a 2-core CPU a wide verify costs well over a one-token decode, so a drafter accepting half its
nodes per depth is fastest with a small tree, and slower than plain decoding with a wide one. The fastest budget
that clears validate's gate (tau and speedup) becomes draft_budget.json, which export ships and validate and serving
read (runtime.serving.served_engine). Both floors matter: the fastest budget on the CPU is often a one-token chain,
whose tau (at most 2) may fall below gate.min_tau when a larger tree's would not, and for a weak drafter the only tree
whose tau clears the floor with room to spare may be slower than plain decoding.

Each tree is also tried with the n-gram lookup branch (EngineConfig.lookup): a target that repeats itself or its
prompt gets those nodes accepted whatever the drafter proposed, and the timing says whether the wider verify pays.

Timing every candidate would take most of calibrate, so each is first predicted (export.calibrate.predict): its tau
and drafting cost from a replay of the target's replies (export.calibrate.replay), its verify at the measured cost
of a forward over that many rows. Only the candidates that could win (within a margin of the best prediction) are
timed, running the engine as serving will (the chosen KV scheme, greedy) on held-out prompts that validate does not
time, by successive halving: all on the first two prompts, the preferred half on two more, and so on down to two
finalists, each prompt running plain decoding and every remaining candidate back to back. The finalists run twelve
prompts at validate's reply length: how much the branch gains depends on how much the prompts repeat and on how
long the reply grows, and fewer or shorter prompts picked worse budgets (docs/logs/cpu-2026-11.md,
"Budgets timed at validate's reply length (2026-11-26)").

A GPU wants a bigger tree than the CPU (a wider verify costs it little more), and tau does not depend on the device:
so draft_budget.json also lists device_candidates, the chosen budget and DEVICE_LADDER's trees with their replayed
tau on every prompt, among which serving on a GPU chooses by timing a step of each there (runtime.serving.budget_tuner).
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from export.calibrate.predict import could_win, predict_budgets
from export.calibrate.replay import reference
from runtime.speculation.decode_stats import tokens_per_forward
from runtime.speculation.draft_budget import DraftBudget, ServedBudget
from runtime.speculation.engine import Engine, EngineConfig
from runtime.speculation.sampling import SamplingParams
from runtime.target.model import Transformer

# (depth, width, nodes): chains and small trees up to the configured budget, which is also tried adaptively
LADDER = ((1, 1, 1), (1, 3, 3), (2, 1, 2), (2, 2, 4), (2, 3, 6), (3, 2, 6), (4, 2, 8), (4, 3, 12), (5, 4, 16))
# EngineConfig.max_tree caps tried on trees with the lookup branch, each on the rungs of this many nodes: a verify
# of 6 or 12 rows fills the CPU kernel's 6-row tiles (kernels/cpu_gemm.py), and the cap keeps the likeliest nodes of
# the drafter's and the lookup's
TREE_CAPS = {5: range(2, 7), 11: range(4, 13)}
# (depth, width, nodes, max_tree) trees a GPU may prefer, whose tau calibrate measures on every prompt for the
# serving device to time (runtime.serving.budget_tuner): a GPU verifies a bucket of rows at about one cost
# (runtime.speculation.cuda_graphs.BUCKETS), so the caps fill a bucket with the root (16, 32); 0: uncut
DEVICE_LADDER = ((2, 3, 6, 15), (3, 3, 9, 15), (4, 2, 8, 15), (4, 4, 16, 31), (6, 4, 24, 31), (6, 4, 24, 0))
PROMPTS_PER_ROUND = 2  # successive halving: every candidate runs the first 2 prompts, the better half 2 more, ...
PREDICTION_MARGIN = 0.1  # a candidate is timed if it could win running this much faster than predicted
# the tree that generates the target's replies to replay: every greedy budget commits the same tokens, and a small
# tree with the lookup branch (cut to a 6-row verify) commits them fastest on a CPU
REPLY_TREE = DraftBudget(depth=2, width=2, nodes=4)
# what draft_budget.json's sweep rows repeat of their candidate's prediction
PREDICTED = ("predicted_tokens_per_s", "predicted_speedup", "draft_ms", "verify_ms", "rollback_ms")


def candidates(configured: DraftBudget, lookups: tuple[int, ...] = (0,)) -> list[ServedBudget]:
    """The ladder's rungs within the configured budget, then the configured one fixed and adaptive (the engine
    shrinks the depth to recent acceptance and may stop drafting), each with every lookup branch size; with a
    lookup branch, fixed rungs also cut to TREE_CAPS."""
    out = [b for b in (DraftBudget(depth=d, width=w, nodes=n) for d, w, n in LADDER) if b.fits(configured)]
    out = [b for b in out if b != configured] + [configured]
    trees = [(b, False) for b in out] + [(configured, True)]
    cut = [(b, cap) for cap, sizes in TREE_CAPS.items() for b in out if b.max_nodes in sizes]
    return [ServedBudget(b, adaptive, lookup) for lookup in lookups for b, adaptive in trees] + \
        [ServedBudget(b, False, lookup, cap) for lookup in lookups if lookup for b, cap in cut]


def device_ladder(configured: DraftBudget, lookup: int) -> list[ServedBudget]:
    """DEVICE_LADDER's trees within the configured budget, with the lookup branch; a cap the tree and branch cannot
    reach is none."""
    out = []
    for d, w, n, cap in DEVICE_LADDER:
        b = DraftBudget(depth=d, width=w, nodes=n)
        c = ServedBudget(b, False, lookup, cap if cap < n + lookup else 0)
        if b.fits(configured) and c not in out:
            out.append(c)
    return out


def preference(row: dict, min_tau: float, min_speedup: float = 0.0, tau_margin: float = 0.0) -> tuple:
    """Sort key of a sweep entry, higher is better: clears validate's gate floors (tau >= min_tau, speedup >=
    min_speedup) with `tau_margin` to spare, since these few prompts are not validate's; else clears the floors
    themselves (a weak drafter's only tree with the margin may be slower than plain decoding); then tokens/s."""
    fast_enough = row["speedup"] >= min_speedup
    return (fast_enough and row["tau"] >= min_tau * (1 + tau_margin), fast_enough and row["tau"] >= min_tau,
            row["tokens_per_s"])


def choose_budget(sweep: list[dict], min_tau: float, min_speedup: float = 0.0, tau_margin: float = 0.0) -> dict:
    """The most preferred sweep entry: the fastest that clears the floors with the margin, else the fastest that
    clears them, else the fastest of all (validate will then fail the gate whatever the budget, and says so)."""
    return max(sweep, key=lambda r: preference(r, min_tau, min_speedup, tau_margin))


def successive_halving(n: int, prompts: list, run: Callable[[int | None, object], tuple[float, int, int]],
                       rank: Callable[[dict, dict], tuple], per_round: int = PROMPTS_PER_ROUND) -> tuple[list, dict]:
    """Time n candidates and plain decoding (index None) on `prompts`, `per_round` prompts a round; after each
    round but the last, the less preferred half (by `rank(totals, baseline)`) stops, down to two finalists. Every
    prompt runs plain decoding and each remaining candidate back to back, so a machine that slows down slows all
    alike. `run` gives (seconds, new tokens, target forwards). Returns each candidate's totals (with the baseline's
    over the same prompts) and the baseline's totals over all prompts."""
    zero = {"seconds": 0.0, "new_tokens": 0, "forwards": 0, "prompts": 0}
    totals, baseline, alive = [dict(zero) for _ in range(n)], dict(zero), list(range(n))
    rounds = [prompts[i:i + per_round] for i in range(0, len(prompts), per_round)]
    for r, chunk in enumerate(rounds):
        for ids in chunk:
            for i, t in [(None, baseline)] + [(i, totals[i]) for i in alive]:
                seconds, tokens, forwards = run(i, ids)
                t.update(seconds=t["seconds"] + seconds, new_tokens=t["new_tokens"] + tokens,
                         forwards=t["forwards"] + forwards, prompts=t["prompts"] + 1)
        for i in alive:
            totals[i]["baseline"] = dict(baseline)
        if r < len(rounds) - 1:
            alive = sorted(alive, key=lambda i: rank(totals[i], baseline), reverse=True)[:survivors(len(alive))]
    return totals, baseline


def survivors(alive: int) -> int:
    """How many of `alive` candidates successive halving keeps after a round: the better half, at least two."""
    return max(2, (alive + 1) // 2)


def halving_runs(n: int, prompts: int, per_round: int = PROMPTS_PER_ROUND) -> int:
    """Generations successive_halving runs for n candidates on `prompts` prompts, plain decoding's included."""
    runs, alive = 0, n
    for start in range(0, prompts, per_round):
        runs += min(per_round, prompts - start) * (1 + alive)
        alive = min(alive, survivors(alive))
    return runs


def calibrate_budget(out: Path, target: Transformer, new_drafter, prompts: list[list[int]], configured: DraftBudget,
                     new_tokens: int, engine_fields: dict, stop_ids: tuple[int, ...],
                     min_tau: float = 0.0, min_speedup: float = 0.0, tau_margin: float = 0.0,
                     lookups: tuple[int, ...] = (0,), margin: float = PREDICTION_MARGIN) -> tuple[dict[str, str], dict, str]:
    """Predict every candidate and DEVICE_LADDER's trees on `prompts` (`new_drafter()` gives a fresh drafter,
    `engine_fields` further EngineConfig fields: the KV scheme, the lookup corpus); time our autoregressive decode
    and the candidates that could win (`margin`: could_win) by successive halving; choose among those timed on
    every prompt by choose_budget; write draft_budget.json and .png to `out`; return (outputs, metrics, message)."""
    max_seq_len = max(map(len, prompts)) + new_tokens + configured.max_nodes + max(lookups) + 1
    cands = candidates(configured, lookups)
    ladder = [c for c in device_ladder(configured, max(lookups)) if c not in cands]

    def engine(t, drafter, budget: ServedBudget) -> Engine:
        return Engine(t, drafter, EngineConfig(max_seq_len=max_seq_len, **budget.engine_fields(), **engine_fields))

    reply_tree = REPLY_TREE if REPLY_TREE.fits(configured) else configured
    replier = engine(target, new_drafter(), ServedBudget(reply_tree, lookup=max(lookups), max_tree=min(TREE_CAPS)))
    refs = [reference(replier, ids, new_tokens, stop_ids)
            for ids in tqdm(prompts, desc="calibrate: the target's replies", unit="prompt", mininterval=1.0)]
    predicted, plain_predicted, step_costs = predict_budgets(
        target, lambda t, b: engine(t, None, ServedBudget(configured)) if b is None else engine(t, new_drafter(), b),
        cands + ladder, refs, new_tokens, stop_ids)

    def rank(r: dict) -> tuple:
        return preference(r, min_tau, min_speedup, tau_margin)

    timed = could_win([as_rates(p) for p in predicted[:len(cands)]], rank, margin)
    engines = [engine(target, new_drafter(), cands[i]) for i in timed]
    plain = engine(target, None, ServedBudget(configured))
    for e in tqdm([plain] + engines, desc="calibrate: warm up budgets", unit="budget", mininterval=1.0):
        e.generate(prompts[0], min(new_tokens, 16), SamplingParams(), None, stop_ids)  # the tree-verify path too
    bar = tqdm(total=halving_runs(len(timed), len(prompts)), desc="calibrate: time budgets", unit="generation",
               mininterval=1.0)

    def run(i: int | None, ids: list[int]) -> tuple[float, int, int]:
        start = time.perf_counter()
        g = (plain if i is None else engines[i]).generate(ids, new_tokens, SamplingParams(), None, stop_ids)
        bar.update(1)
        return time.perf_counter() - start, len(g.tokens), g.metrics.target_forwards

    def row(t: dict, base: dict) -> dict:
        rate = t["new_tokens"] / t["seconds"]
        return {"tokens_per_s": rate, "speedup": rate / (base["new_tokens"] / base["seconds"]),
                "tau": tokens_per_forward(t["new_tokens"], t["prompts"], t["forwards"]), "prompts": t["prompts"]}

    totals, baseline = successive_halving(len(timed), prompts, run, lambda t, base: rank(row(t, base)))
    bar.close()
    sweep = [{**cands[i].to_dict(), **row(t, t["baseline"]), **{k: predicted[i][k] for k in PREDICTED}}
             for i, t in zip(timed, totals)]
    ar_rate = baseline["new_tokens"] / baseline["seconds"]
    best = choose_budget([r for r in sweep if r["prompts"] == len(prompts)], min_tau, min_speedup, tau_margin)
    chosen = ServedBudget.from_dict(best)
    # the chosen budget and bigger trees, tau on every prompt: a serving GPU times a step of each and chooses
    replayed = {ServedBudget.from_dict(p): p for p in predicted}
    device = [{**chosen.to_dict(), "tau": best["tau"], "prompts": best["prompts"]}] + [
        {**c.to_dict(), "tau": replayed[c]["tau"], "prompts": len(prompts)}
        for c in device_ladder(configured, max(lookups)) if c != chosen]
    report = {"chosen": chosen.to_dict(), "min_tau": min_tau, "min_speedup": min_speedup, "tau_margin": tau_margin,
              "tokens_per_s_ar": ar_rate, "dtype": str(target.dtype).removeprefix("torch."), "prompts": len(prompts),
              "prompts_per_round": PROMPTS_PER_ROUND, "new_tokens": new_tokens, "sweep": sweep,
              "device_candidates": device, "prediction_margin": margin,
              "predicted_tokens_per_s_ar": plain_predicted["predicted_tokens_per_s"], "step_costs": step_costs,
              "predictions": [{**p, "timed": i in timed} for i, p in enumerate(predicted[:len(cands)])]}
    (out / "draft_budget.json").write_text(json.dumps(report, indent=2) + "\n")
    plot_budgets(report["predictions"], sweep, device, out / "draft_budget.png")
    metrics = {"budget_speedup": best["speedup"], "budget_tokens_per_s": best["tokens_per_s"],
               "budget_nodes": float(best["nodes"]), "budget_lookup": float(best["lookup"]),
               "budget_tokens_per_s_ar": ar_rate, "budget_timed": float(len(timed))}
    return ({"draft_budget": "draft_budget.json", "draft_budget_plot": "draft_budget.png"}, metrics,
            f"draft budget {chosen.label()}: {best['speedup']:.2f}x over our AR (tau {best['tau']:.2f}"
            + ("" if best["tau"] >= min_tau and best["speedup"] >= min_speedup else
               f"; none reaches tau {min_tau:.2f} at {min_speedup:.2f}x")
            + f"; {len(timed)} of {len(cands)} predicted to be within {margin:.0%} of the best, timed)")


def as_rates(predicted: dict) -> dict:
    """A prediction in a sweep row's terms, for preference()."""
    return {"tau": predicted["tau"], "tokens_per_s": predicted["predicted_tokens_per_s"],
            "speedup": predicted["predicted_speedup"]}


def plot_budgets(predictions: list[dict], sweep: list[dict], device: list[dict], path: Path) -> Path:
    """Left: each candidate's predicted speedup over our AR on this machine, and the measured one of those timed.
    Right: the device candidates' tau, which a serving GPU weighs against its own step times."""
    from matplotlib.figure import Figure

    widths = [max(6, 0.35 * len(predictions)), max(3, 0.5 * len(device))]
    fig = Figure(figsize=(sum(widths), 4))
    ax, tau_ax = fig.subplots(1, 2, width_ratios=widths)
    labels = [ServedBudget.from_dict(r).spec + " adaptive" * r["adaptive"] for r in predictions]
    colors = [("tab:green" if r.get("lookup") else "tab:blue", "tab:olive" if r.get("lookup") else "tab:orange")
              [r["adaptive"]] for r in predictions]
    ax.bar(range(len(predictions)), [r["predicted_speedup"] for r in predictions], color=colors, alpha=0.5,
           label="predicted")
    where = {ServedBudget.from_dict(r): i for i, r in enumerate(predictions)}
    ax.scatter([where[ServedBudget.from_dict(r)] for r in sweep], [r["speedup"] for r in sweep], color="black",
               marker="D", zorder=3, label="measured (timed)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(predictions)), labels, fontsize="x-small", rotation=60, ha="right")
    ax.set(xlabel="draft budget (depth x width / nodes + lookup nodes @ most nodes a verify)",
           ylabel="speedup over our AR (x)", title="Draft budget: predicted and measured speedup")
    ax.legend(loc="best", fontsize="small")
    tau_ax.bar(range(len(device)), [r["tau"] for r in device], color=["tab:red"] + ["tab:purple"] * (len(device) - 1))
    tau_ax.set_xticks(range(len(device)), [ServedBudget.from_dict(r).spec for r in device], fontsize="x-small",
                      rotation=60, ha="right")
    tau_ax.set(ylabel="tau (tokens per target forward)", title="Device candidates (red: chosen here)")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path
