"""Choosing the draft budget on the serving device (runtime/serving/budget_tuner.py): each candidate's step timed
through the engine as serving configures it, the most tokens/s (calibrated tau / ms a step) kept."""
import math

import pytest
import torch

from runtime.drafters.shared.eagle_drafting import EagleDrafter
from runtime.serving.budget_tuner import choose_on_device, describe, fastest_of, ms_per_step, tokens_per_s
from runtime.speculation.draft_budget import DraftBudget, ServedBudget
from runtime.speculation.engine import Engine, EngineConfig
from runtime.target.loading import from_pretrained
from train.recipes.eagle import build_eagle

ROWS = [{"depth": 1, "width": 3, "nodes": 3, "adaptive": True, "lookup": 0, "max_tree": 0},
        {"depth": 3, "width": 2, "nodes": 6, "adaptive": False, "lookup": 4, "max_tree": 5},
        {"depth": 2, "width": 1, "nodes": 2, "adaptive": False, "lookup": 0, "max_tree": 0}]


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return from_pretrained(tiny_llama_dir, max_seq_len=128)


@pytest.fixture(scope="module")
def new_drafter(target):
    torch.manual_seed(0)
    eagle = build_eagle(target, None, from_target=True).eval().requires_grad_(False)
    return lambda: EagleDrafter(eagle, 128)


def candidates(taus: list[float]) -> list[tuple[ServedBudget, float]]:
    return [(ServedBudget.from_dict(row), tau) for row, tau in zip(ROWS, taus)]


@pytest.mark.parametrize("winner", [0, 1, 2])
def test_the_candidate_with_the_most_tokens_a_second_wins(target, new_drafter, winner):
    taus = [1.2] * len(ROWS)
    taus[winner] = 80.0  # far more than any difference in step cost on this host can outweigh
    configs = []

    def served(budget: ServedBudget) -> EngineConfig:
        configs.append(cfg := EngineConfig(max_seq_len=128, **budget.engine_fields()))
        return cfg

    best, report = choose_on_device(target, new_drafter, candidates(taus), list(range(3, 11)), served, new_tokens=12,
                                    repeats=1)
    assert best == winner and report["chosen"] == ServedBudget.from_dict(ROWS[winner]).spec
    rows = report["candidates"]
    assert [r["budget"] for r in rows] == ["1x3/3", "3x2/6+4@5", "2x1/2"] and report["ar_step_ms"] > 0
    for r, tau in zip(rows, taus):
        assert r["tau"] == tau and r["step_ms"] > 0
        assert r["tokens_per_s"] == pytest.approx(1e3 * tau / r["step_ms"])
        assert r["speedup"] == pytest.approx(tau * report["ar_step_ms"] / r["step_ms"])
    assert best == max(range(len(rows)), key=lambda i: rows[i]["tokens_per_s"])
    # our AR first, then each candidate at its whole budget: an adaptive one is timed without adapting
    assert [(c.budget, c.adaptive, c.lookup, c.max_tree) for c in configs[1:]] == [
        (DraftBudget(1, 3, 3), False, 0, 0), (DraftBudget(3, 2, 6), False, 4, 5), (DraftBudget(2, 1, 2), False, 0, 0)]
    assert rows[0]["adaptive"] and report["device"] == "cpu"
    line = describe(report)
    assert line.startswith(f"draft budget on cpu: {report['chosen']}") and "others" in line


def test_a_step_is_timed_without_the_prefill_and_per_target_forward(target, new_drafter):
    engine = Engine(target, new_drafter(), EngineConfig(max_seq_len=128, **ServedBudget.from_dict(ROWS[1]).engine_fields()))
    ms = ms_per_step(engine, list(range(3, 11)), new_tokens=12, repeats=2)
    m = engine.generate(list(range(3, 11)), 12).metrics
    assert 0 < ms < 1e3 * m.total_s  # one step, not a generation
    with pytest.raises(ValueError, match="no candidate budgets"):
        choose_on_device(target, new_drafter, [], [1, 2], lambda b: EngineConfig(**b.engine_fields()))


def test_the_fastest_timed_run_counts_and_a_run_that_timed_no_step_does_not():
    times = iter([5.0, None, 3.0, 4.0])
    assert fastest_of(4, lambda: next(times)) == 3.0
    assert fastest_of(2, lambda: None) == math.inf
    assert tokens_per_s(4, 2.5, 20.0) == 500.0  # 4 rows, 2.5 tokens each, a step every 20 ms
