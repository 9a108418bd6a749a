"""How much a row of a batch drafts, by batch size, measured on the device that serves (BatchPolicy).

Alone, a verify of a few tokens costs about a decode, since both stream every weight once; with B rows a step
verifies B trees, and once the products are compute-bound a wider tree costs what it adds. So the tree that
commits the most tokens a second shrinks as B grows, and above some B plain batched decoding commits more than any.
`measure_policy` times a batched step of each candidate budget, and of plain decoding, at batch sizes 1, 2, 4, ...
up to the largest served, as runtime.serving.device_budget does at batch 1: a candidate's rate is B * tau / (ms a step), its
tau calibrate's where the bundle measured it (greedy acceptance does not depend on the batch), else the one the
timing run reached. Between two measured sizes the smaller one's choice holds.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from tqdm import tqdm

from runtime.serving.batch_engine import BatchEngine, BatchRequest
from runtime.speculation.draft_budget import BatchPolicy, ServedBudget
from runtime.speculation.decode_stats import tokens_per_forward
from runtime.speculation.drafter import Drafter
from runtime.speculation.engine import EngineConfig
from runtime.target.model import Transformer

NEW_TOKENS = 32  # tokens each row of a timing run generates
REPEATS = 2  # timed runs per configuration; the fastest counts (other work on the host only slows one down)


def batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... and max_batch itself."""
    return sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch} | {max_batch})


def time_batch(target: Transformer, new_drafter: Callable[[], Drafter] | None, cfg: EngineConfig,
               budget: ServedBudget | None, prompts: list[list[int]], rows: int, new_tokens: int = NEW_TOKENS,
               repeats: int = REPEATS) -> tuple[float, float]:
    """(ms per step while all `rows` rows run, tau) of a batched engine running `budget` without adapting (None:
    plain decoding) on `rows` requests of `prompts` (cycled), greedy, the fastest of `repeats` runs after a short
    untimed one."""
    fixed = budget and replace(budget, adaptive=False)
    fields = (fixed or ServedBudget.of(cfg)).engine_fields()
    engine = BatchEngine(target, new_drafter if fixed else None, replace(cfg, **fields), rows,
                         BatchPolicy.fixed(fixed))

    def run(tokens: int) -> tuple[list[float], float]:
        engine.step_times = []
        out = engine.generate([BatchRequest(i, prompts[i % len(prompts)], tokens) for i in range(rows)])
        full = [s for n, s in engine.step_times if n == rows]
        forwards = sum(g.metrics.target_forwards for g in out)
        return full, tokens_per_forward(sum(len(g.tokens) for g in out), rows, forwards)

    run(min(4, new_tokens))
    best, tau = math.inf, 1.0
    for _ in range(repeats):
        steps, tau = run(new_tokens)
        if steps:
            best = min(best, 1e3 * sum(steps) / len(steps))
    return best, tau


def measure_policy(target: Transformer, new_drafter: Callable[[], Drafter], cfg: EngineConfig,
                   candidates: list[tuple[ServedBudget, float | None]], prompts: list[list[int]], max_batch: int,
                   new_tokens: int = NEW_TOKENS, repeats: int = REPEATS) -> BatchPolicy:
    """At each of batch_sizes(max_batch), time plain batched decoding and every (budget, calibrated tau or None)
    candidate; keep the one committing the most tokens a second. `cfg`: the engine settings served (its budget
    fields are replaced by each candidate's)."""
    if not candidates:
        raise ValueError("measure_policy: no candidate budgets")
    longest = max(map(len, prompts)) + new_tokens + max(b.tree.max_nodes + b.lookup for b, _ in candidates) + 1
    cfg = replace(cfg, max_seq_len=min(cfg.max_seq_len, longest))  # a short cache: step costs are the same
    sizes = batch_sizes(max_batch)
    rows, chosen = [], []
    bar = tqdm(total=len(sizes) * (1 + len(candidates)), desc="batch policy: time batched steps", unit="config")
    for n in sizes:
        ar_ms, _ = time_batch(target, None, cfg, None, prompts, n, new_tokens, repeats)
        bar.update()
        options = [{"budget": None, "tau": 1.0, "step_ms": ar_ms, "tokens_per_s": 1e3 * n / ar_ms}]
        for budget, tau in candidates:
            ms, measured = time_batch(target, new_drafter, cfg, budget, prompts, n, new_tokens, repeats)
            bar.update()
            rate_tau = measured if tau is None else tau
            options.append({"budget": budget.spec, "tau": rate_tau, "calibrated_tau": tau is not None,
                            "step_ms": ms, "tokens_per_s": 1e3 * n * rate_tau / ms})
        best = max(range(len(options)), key=lambda i: options[i]["tokens_per_s"])
        chosen.append(None if best == 0 else candidates[best - 1][0])
        rows.append({"rows": n, "chosen": options[best]["budget"], "options": options})
    bar.close()
    steps = tuple((n, b) for i, (n, b) in enumerate(zip(sizes, chosen)) if i == 0 or b != chosen[i - 1])
    return BatchPolicy(steps, {"device": target.device.type, "new_tokens": new_tokens, "by_batch": rows})
