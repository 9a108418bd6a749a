"""The draft budget that commits the most tokens a second on the device that serves, found by timing each candidate
there through the engine that will serve it: at batch 1 among a bundle's device candidates (choose_on_device, through
the Engine), and at each batch size among smaller budgets and plain decoding (measure_policy: a BatchPolicy, through
the BatchEngine).

tau does not depend on the device or the batch (greedy verification accepts the same tokens), but what a wider tree
costs does. So the budget calibrate chooses for its CPU is smaller than a GPU wants; and alone a verify of a few
tokens costs about a decode, since both stream every weight once, while with B rows a step verifies B trees and once
the products are compute-bound a wider tree costs what it adds: the tree that commits the most tokens a second
shrinks as B grows, and above some B plain batched decoding commits more than any. A candidate's rate is
rows * tau / (ms a step), its tau calibrate's where the bundle measured it, else the one its timing run reached. Each
candidate is timed at its full budget without adapting (the most its step costs), with drafting, the lookup branch,
verify and rollback as served, and the fastest of a few timed runs counts.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from tqdm import tqdm

from runtime.serving.batch_engine import BatchEngine, BatchRequest
from runtime.speculation.decode_stats import tokens_per_forward
from runtime.speculation.draft_budget import BatchPolicy, ServedBudget
from runtime.speculation.drafter import Drafter
from runtime.speculation.engine import Engine, EngineConfig
from runtime.target.model import Transformer

ENGINE_NEW_TOKENS = 64  # tokens each timing generation at batch 1 runs
ENGINE_REPEATS = 3  # timed generations a candidate at batch 1
BATCH_NEW_TOKENS = 32  # tokens each row of a batched timing run generates
BATCH_REPEATS = 2  # timed batched runs per candidate and batch size


# ------------------------------------------------------------------ shared: time, rate, keep the fastest

def fastest_of(repeats: int, time_once: Callable[[], float | None]) -> float:
    """The least ms of `repeats` timed runs (None: a run that timed no step): other work on the host only slows a
    run down, so the fastest is the closest to what the device costs."""
    best = math.inf
    for _ in range(repeats):
        ms = time_once()
        if ms is not None:
            best = min(best, ms)
    return best


def tokens_per_s(rows: int, tau: float, step_ms: float) -> float:
    """The rate a candidate is chosen by: `rows` sequences each committing `tau` tokens a step of `step_ms`."""
    return 1e3 * rows * tau / step_ms


def fastest_option(options: list[dict]) -> int:
    """The index of the option that commits the most tokens a second."""
    return max(range(len(options)), key=lambda i: options[i]["tokens_per_s"])


def timing_bar(total: int, desc: str, unit: str) -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit)


# ------------------------------------------------------------------ batch 1: the Engine, among device candidates

def ms_per_step(engine: Engine, prompt: list[int], new_tokens: int = ENGINE_NEW_TOKENS,
                repeats: int = ENGINE_REPEATS) -> float:
    """ms per decode or verify step of `engine` generating greedily from `prompt`, prefill left out, after one
    untimed generation (which captures the CUDA graphs or compiles)."""
    engine.generate(prompt, new_tokens)
    return fastest_of(repeats, lambda: engine.generate(prompt, new_tokens).metrics.ms_per_forward)


def choose_on_device(target: Transformer, new_drafter: Callable[[], Drafter],
                     candidates: list[tuple[ServedBudget, float]], prompt: list[int],
                     make_config: Callable[[ServedBudget], EngineConfig], new_tokens: int = ENGINE_NEW_TOKENS,
                     repeats: int = ENGINE_REPEATS) -> tuple[int, dict]:
    """Time our autoregressive decode and a step of every (budget, tau) candidate on `target`'s device; `make_config`
    gives the engine config serving runs a budget with. Returns the index of the candidate with the most tokens/s
    (tau / ms per step), and a report of all."""
    if not candidates:
        raise ValueError("choose_on_device: no candidate budgets")
    plain = replace(make_config(candidates[0][0]), sparse=None)  # no drafter: the budget is not read
    ar_ms = ms_per_step(Engine(target, None, plain), prompt, new_tokens, repeats)
    rows = []
    with timing_bar(len(candidates), f"draft budget on {target.device.type}", "budget") as bar:
        for budget, tau in candidates:
            engine = Engine(target, new_drafter(), make_config(replace(budget, adaptive=False)))
            ms = ms_per_step(engine, prompt, new_tokens, repeats)
            bar.update()
            rows.append({"budget": budget.spec, "adaptive": budget.adaptive, "tau": tau, "step_ms": ms,
                         "tokens_per_s": tokens_per_s(1, tau, ms), "speedup": tau * ar_ms / ms})
    best = fastest_option(rows)
    return best, {"device": target.device.type, "prompt_tokens": len(prompt), "new_tokens": new_tokens,
                  "ar_step_ms": ar_ms, "chosen": rows[best]["budget"], "candidates": rows}


def describe(report: dict) -> str:
    """One line: the budget choose_on_device chose, and what it and the others were measured at."""
    best = next(r for r in report["candidates"] if r["budget"] == report["chosen"])
    others = ", ".join(f"{r['budget']} {r['speedup']:.2f}x" for r in report["candidates"] if r is not best)
    return (f"draft budget on {report['device']}: {best['budget']}" + " adaptive" * best["adaptive"]
            + f" (tau {best['tau']:.2f}, {best['step_ms']:.2f} ms a step against {report['ar_step_ms']:.2f} ms a "
            f"decode token: ~{best['speedup']:.2f}x our AR)" + f"; others {others}" * bool(others))


# ------------------------------------------------------------------ batch N: the BatchEngine, by batch size

def batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... and max_batch itself: the sizes measure_policy times; between two of them the smaller one's
    choice holds."""
    return sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch} | {max_batch})


def time_batch(target: Transformer, new_drafter: Callable[[], Drafter] | None, cfg: EngineConfig,
               budget: ServedBudget | None, prompts: list[list[int]], rows: int, new_tokens: int = BATCH_NEW_TOKENS,
               repeats: int = BATCH_REPEATS) -> tuple[float, float]:
    """(ms per step while all `rows` rows run, tau) of a batched engine running `budget` without adapting (None:
    plain decoding) on `rows` requests of `prompts` (cycled), greedy, the fastest of `repeats` runs after a short
    untimed one; tau is the last run's."""
    fixed = budget and replace(budget, adaptive=False)
    fields = (fixed or ServedBudget.of(cfg)).engine_fields()
    engine = BatchEngine(target, new_drafter if fixed else None, replace(cfg, **fields), rows,
                         BatchPolicy.fixed(fixed))
    tau = 1.0

    def run(tokens: int) -> float | None:
        nonlocal tau
        engine.step_times = []
        out = engine.generate([BatchRequest(i, prompts[i % len(prompts)], tokens) for i in range(rows)])
        full = [s for n, s in engine.step_times if n == rows]
        forwards = sum(g.metrics.target_forwards for g in out)
        tau = tokens_per_forward(sum(len(g.tokens) for g in out), rows, forwards)
        return 1e3 * sum(full) / len(full) if full else None

    run(min(4, new_tokens))
    tau = 1.0  # the timed runs' own, not the short untimed one's
    return fastest_of(repeats, lambda: run(new_tokens)), tau


def measure_policy(target: Transformer, new_drafter: Callable[[], Drafter], cfg: EngineConfig,
                   candidates: list[tuple[ServedBudget, float | None]], prompts: list[list[int]], max_batch: int,
                   new_tokens: int = BATCH_NEW_TOKENS, repeats: int = BATCH_REPEATS) -> BatchPolicy:
    """At each of batch_sizes(max_batch), time plain batched decoding and every (budget, calibrated tau or None)
    candidate; keep the one committing the most tokens a second. `cfg`: the engine settings served (its budget
    fields are replaced by each candidate's)."""
    if not candidates:
        raise ValueError("measure_policy: no candidate budgets")
    longest = max(map(len, prompts)) + new_tokens + max(b.tree.max_nodes + b.lookup for b, _ in candidates) + 1
    cfg = replace(cfg, max_seq_len=min(cfg.max_seq_len, longest))  # a short cache: step costs are the same
    sizes = batch_sizes(max_batch)
    rows, chosen = [], []
    with timing_bar(len(sizes) * (1 + len(candidates)), "batch policy: time batched steps", "config") as bar:
        for n in sizes:
            ar_ms, _ = time_batch(target, None, cfg, None, prompts, n, new_tokens, repeats)
            bar.update()
            options = [{"budget": None, "tau": 1.0, "step_ms": ar_ms, "tokens_per_s": tokens_per_s(n, 1.0, ar_ms)}]
            for budget, tau in candidates:
                ms, measured = time_batch(target, new_drafter, cfg, budget, prompts, n, new_tokens, repeats)
                bar.update()
                rate_tau = measured if tau is None else tau
                options.append({"budget": budget.spec, "tau": rate_tau, "calibrated_tau": tau is not None,
                                "step_ms": ms, "tokens_per_s": tokens_per_s(n, rate_tau, ms)})
            best = fastest_option(options)
            chosen.append(None if best == 0 else candidates[best - 1][0])
            rows.append({"rows": n, "chosen": options[best]["budget"], "options": options})
    steps = tuple((n, b) for i, (n, b) in enumerate(zip(sizes, chosen)) if i == 0 or b != chosen[i - 1])
    return BatchPolicy(steps, {"device": target.device.type, "new_tokens": new_tokens, "by_batch": rows})
