"""A draft budget's speed predicted from measured step costs: the target's forward over n rows, timed once per n
the budgets verify (export.calibrate.timing.verify_ms), and each budget's replayed generations
(export.calibrate.replay: tau, the seconds it drafted, rolled back and spent around each verify, and its verifies
by row count).

    predicted tokens/s = new tokens / (prefill + forwards x (draft + verify + rollback per step))

which for long replies is tau / (draft + verify + rollback per step). Plain decoding is predicted the same way,
from its own replay (one-row verifies, nothing drafted), so a budget's predicted speedup divides like terms.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable

from tqdm import tqdm

from export.calibrate.replay import Reference, ReplayTarget, replay
from export.calibrate.timing import verify_ms
from runtime.speculation.draft_budget import ServedBudget
from runtime.speculation.engine import Engine
from runtime.target.model import Transformer


def predict(replayed: dict, costs: dict[int, float], prefill_s: float) -> dict:
    """The predicted row of a replayed budget (replay's dict, with `overhead_s`: the engine's time around its
    verifies) from `costs` (verify_ms) and the real prefill seconds of the same prompts."""
    forwards = max(1, replayed["forwards"])
    forward_s = sum(k * costs[n] for n, k in replayed["verify_rows"].items()) / 1e3
    step = {"draft_ms": replayed["draft_s"], "verify_ms": forward_s + replayed["overhead_s"],
            "rollback_ms": replayed["rollback_s"]}
    step = {k: 1e3 * s / forwards for k, s in step.items()}
    seconds = prefill_s + forwards * sum(step.values()) / 1e3
    return {"tau": replayed["tau"], **step, "predicted_tokens_per_s": replayed["new_tokens"] / seconds}


def could_win(predicted: list[dict], preference: Callable[[dict], tuple], margin: float, least: int = 2) -> list[int]:
    """Indices of the predicted rows that could be chosen: those the `preference` key (choose_budget's) would rank
    at least level with the best prediction if they ran `margin` faster than predicted (the others could not win
    unless a prediction were off by more), and at least the `least` best predictions."""
    ranked = sorted(range(len(predicted)), key=lambda i: preference(predicted[i]), reverse=True)
    best = preference(predicted[ranked[0]])

    def optimistic(r: dict) -> dict:
        return {**r, "tokens_per_s": r["tokens_per_s"] * (1 + margin), "speedup": r["speedup"] * (1 + margin)}

    keep = [i for i in ranked if preference(optimistic(predicted[i])) >= best]
    return sorted(set(keep) | set(ranked[:least]))


def predict_budgets(target: Transformer, make_engine: Callable[[ReplayTarget, ServedBudget | None], Engine],
                    budgets: list[ServedBudget], refs: list[Reference], new_tokens: int, stop_ids: tuple[int, ...],
                    rounds: int = 5) -> tuple[list[dict], dict, dict]:
    """Replay plain decoding (`make_engine(t, None)`) and every budget on `refs`, time the target's forward over each
    row count they verified, and predict. Returns (each budget's prediction, plain decoding's, the step costs)."""
    replay_target = ReplayTarget(target)
    plain = replay(replay_target, make_engine(replay_target, None), refs, new_tokens, stop_ids)
    replayed = [replay(replay_target, make_engine(replay_target, b), refs, new_tokens, stop_ids)
                for b in tqdm(budgets, desc="calibrate: replay budgets", unit="budget", mininterval=1.0)]
    sizes = sorted({n for r in [plain, *replayed] for n in r["verify_rows"]})
    context = round(statistics.mean(len(r.prompt) + len(r.reply) / 2 for r in refs))
    with tqdm(total=rounds, desc=f"calibrate: time verifies of {sizes[0]}-{sizes[-1]} rows", unit="round") as bar:
        costs = verify_ms(target, sizes, context, rounds, progress=bar.update)
    prefill_s = sum(r.prefill_s for r in refs)
    ar = predict(plain, costs, prefill_s)
    rows = []
    for budget, r in zip(budgets, replayed):
        p = predict(r, costs, prefill_s)
        rows.append({**budget.to_dict(), **p, "prompts": r["prompts"],
                     "predicted_speedup": p["predicted_tokens_per_s"] / ar["predicted_tokens_per_s"]})
    return rows, ar, {"context": context, "verify_ms": {str(n): ms for n, ms in costs.items()}}
