"""The draft budget for the device that serves: calibrate measures each candidate tree's tau on the CPU, this times
a step of each on the device at hand and keeps the one that commits the most tokens a second.

tau does not depend on the device (greedy verification accepts the same tokens), but what a wider tree costs does,
so the budget calibrate chooses for its CPU is smaller than a GPU wants. A candidate's rate here is tau / (ms per
speculative step), each step timed through the engine as it will serve (drafting, the lookup branch, verify,
rollback), at the full budget (an adaptive candidate is timed without adapting: the most its step costs).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from tqdm import tqdm

from runtime.speculation.draft_budget import ServedBudget
from runtime.speculation.drafter import Drafter
from runtime.speculation.engine import Engine, EngineConfig
from runtime.target.model import Transformer

NEW_TOKENS = 64  # tokens each timing generation runs
REPEATS = 3  # timed generations a candidate; the fastest counts (other work on the host only slows one down)


def ms_per_step(engine: Engine, prompt: list[int], new_tokens: int = NEW_TOKENS, repeats: int = REPEATS) -> float:
    """ms per decode or verify step of `engine` generating greedily from `prompt`, prefill left out, after one
    untimed generation (which captures the CUDA graphs or compiles)."""
    engine.generate(prompt, new_tokens)
    best = math.inf
    for _ in range(repeats):
        best = min(best, engine.generate(prompt, new_tokens).metrics.ms_per_forward)
    return best


def choose_on_device(target: Transformer, new_drafter: Callable[[], Drafter],
                     candidates: list[tuple[ServedBudget, float]], prompt: list[int],
                     make_config: Callable[[ServedBudget], EngineConfig], new_tokens: int = NEW_TOKENS,
                     repeats: int = REPEATS) -> tuple[int, dict]:
    """Time our autoregressive decode and a step of every (budget, tau) candidate on `target`'s device; `make_config`
    gives the engine config serving runs a budget with. Returns the index of the candidate with the most tokens/s
    (tau / ms per step), and a report of all."""
    if not candidates:
        raise ValueError("choose_on_device: no candidate budgets")
    plain = replace(make_config(candidates[0][0]), sparse=None)  # no drafter: the budget is not read
    ar_ms = ms_per_step(Engine(target, None, plain), prompt, new_tokens, repeats)
    rows = []
    for budget, tau in tqdm(candidates, desc=f"draft budget on {target.device.type}", unit="budget"):
        engine = Engine(target, new_drafter(), make_config(replace(budget, adaptive=False)))
        ms = ms_per_step(engine, prompt, new_tokens, repeats)
        rows.append({"budget": budget.spec, "adaptive": budget.adaptive, "tau": tau, "step_ms": ms,
                     "tokens_per_s": 1e3 * tau / ms, "speedup": tau * ar_ms / ms})
    best = max(range(len(rows)), key=lambda i: rows[i]["tokens_per_s"])
    return best, {"device": target.device.type, "prompt_tokens": len(prompt), "new_tokens": new_tokens,
                  "ar_step_ms": ar_ms, "chosen": rows[best]["budget"], "candidates": rows}


def describe(report: dict) -> str:
    """One line: the budget chosen on the device, and what it and the others were measured at."""
    best = next(r for r in report["candidates"] if r["budget"] == report["chosen"])
    others = ", ".join(f"{r['budget']} {r['speedup']:.2f}x" for r in report["candidates"] if r is not best)
    return (f"draft budget on {report['device']}: {best['budget']}" + " adaptive" * best["adaptive"]
            + f" (tau {best['tau']:.2f}, {best['step_ms']:.2f} ms a step against {report['ar_step_ms']:.2f} ms a "
            f"decode token: ~{best['speedup']:.2f}x our AR)" + f"; others {others}" * bool(others))
