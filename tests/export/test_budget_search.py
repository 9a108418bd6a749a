"""The draft budget search: its candidates and device ladder, successive halving, the prediction from replayed tau
and measured step costs, which candidates could win, and the choice among those timed."""
import pytest

from export.calibrate.budget_search import (candidates, choose_budget, device_ladder, halving_runs, preference,
                                     successive_halving)
from export.calibrate.predict import could_win, predict
from runtime.speculation.draft_budget import DraftBudget, ServedBudget


def test_the_device_ladder_stays_within_the_configured_budget_and_drops_caps_it_cannot_reach():
    full = device_ladder(DraftBudget(6, 4, 24), 16)
    assert [(c.tree.depth, c.tree.width, c.tree.max_nodes, c.max_tree) for c in full] == [
        (2, 3, 6, 15), (3, 3, 9, 15), (4, 2, 8, 15), (4, 4, 16, 31), (6, 4, 24, 31), (6, 4, 24, 0)]
    assert all(not c.adaptive and c.lookup == 16 for c in full)
    no_lookup = device_ladder(DraftBudget(6, 4, 24), 0)  # 24 nodes never reach a cap of 31: one uncut 6x4/24
    assert [(c.tree.depth, c.tree.width, c.tree.max_nodes, c.max_tree) for c in no_lookup] == [
        (2, 3, 6, 0), (3, 3, 9, 0), (4, 2, 8, 0), (4, 4, 16, 0), (6, 4, 24, 0)]
    assert [(c.tree.depth, c.tree.width, c.max_tree) for c in device_ladder(DraftBudget(3, 3, 9), 4)] == [
        (2, 3, 0), (3, 3, 0)]


def test_the_budget_is_the_fastest_that_clears_the_gate_floors():
    sweep = [{"tokens_per_s": 30.0, "speedup": 1.3, "tau": 1.4}, {"tokens_per_s": 28.0, "speedup": 1.2, "tau": 1.8},
             {"tokens_per_s": 25.0, "speedup": 1.1, "tau": 2.2}]
    assert choose_budget(sweep, 1.5, tau_margin=0.1) is sweep[1]  # the one-token chain is fastest but fails on tau
    assert choose_budget(sweep, 0.0) is sweep[0]
    assert choose_budget(sweep, 1.5, min_speedup=1.25) is sweep[0]  # none clears both floors: the fastest of all
    assert choose_budget(sweep, 3.0) is sweep[0]  # none clears tau: the fastest, and validate reports the tau
    # a weak drafter: only the big tree clears tau with the margin, and it is slower than plain decoding; a tree
    # that clears the gate's own floors wins (measured: 4x2/8 at tau 1.56, 1.25x, against 5x4/16 at 1.71, 0.93x)
    weak = [{"tokens_per_s": 19.1, "speedup": 1.25, "tau": 1.56}, {"tokens_per_s": 14.2, "speedup": 0.93, "tau": 1.71}]
    assert choose_budget(weak, 1.5, min_speedup=1.0, tau_margin=0.1) is weak[0]
    assert choose_budget(weak, 1.5, min_speedup=0.9, tau_margin=0.1) is weak[1]


def test_successive_halving_drops_the_less_preferred_half_each_round():
    rates = [10.0, 30.0, 20.0, 40.0, 25.0]  # tokens per second of candidates 0..4; plain decoding (None) 15
    calls = []

    def run(i, prompt):
        calls.append((prompt, i))
        return 10 / (15.0 if i is None else rates[i]), 10, 5

    def rank(t, base):
        return t["new_tokens"] / t["seconds"] / (base["new_tokens"] / base["seconds"])

    totals, baseline = successive_halving(5, ["a", "b", "c", "d", "e"], run, rank, per_round=2)
    assert [t["prompts"] for t in totals] == [2, 5, 2, 5, 4]  # 5 -> 3 (3, 1, 4) -> 2 (3, 1) after each round
    assert len(calls) == halving_runs(5, 5, per_round=2) == 2 * 6 + 2 * 4 + 3  # what its progress bar counts
    assert calls[:6] == [("a", None), ("a", 0), ("a", 1), ("a", 2), ("a", 3), ("a", 4)]  # interleaved per prompt
    assert calls[12:16] == [("c", None), ("c", 3), ("c", 1), ("c", 4)]  # the preferred first
    assert baseline["prompts"] == 5 and totals[3]["baseline"]["prompts"] == 5 and totals[0]["baseline"]["prompts"] == 2
    assert rank(totals[3], totals[3]["baseline"]) == pytest.approx(40 / 15)
    calls.clear()
    totals, _ = successive_halving(3, list("abcdefgh"), run, rank, per_round=2)  # two finalists run every prompt
    assert [t["prompts"] for t in totals] == [2, 8, 8] and len(calls) == halving_runs(3, 8, per_round=2)


def test_budget_candidates_stay_within_the_configured_budget():
    wide = DraftBudget(depth=6, width=4, nodes=24)
    assert candidates(wide)[-2:] == [ServedBudget(wide), ServedBudget(wide, adaptive=True)]
    assert len(candidates(wide)) == 11
    chain = DraftBudget(depth=3, width=1)  # nodes 0: depth * width
    trees = [(DraftBudget(1, 1, 1), False), (DraftBudget(2, 1, 2), False), (chain, False), (chain, True)]
    assert candidates(chain) == [ServedBudget(b, adaptive) for b, adaptive in trees]
    cut = [ServedBudget(DraftBudget(2, 1, 2), False, 8, 5), ServedBudget(chain, False, 8, 5)]  # 2..6 nodes, cut to 5
    assert candidates(chain, (0, 8)) == [ServedBudget(b, adaptive, n) for n in (0, 8) for b, adaptive in trees] + cut


def test_a_budgets_predicted_speed_charges_each_verify_its_measured_cost():
    replayed = {"tau": 2.5, "prompts": 2, "forwards": 10, "new_tokens": 27, "draft_s": 0.05, "rollback_s": 0.01,
                "overhead_s": 0.02, "verify_rows": {1: 2, 5: 8}}
    costs = {1: 20.0, 5: 30.0, 7: 45.0}  # ms of a target forward over n rows
    p = predict(replayed, costs, prefill_s=0.1)
    assert p["tau"] == 2.5
    assert p["draft_ms"] == pytest.approx(5.0) and p["rollback_ms"] == pytest.approx(1.0)
    assert p["verify_ms"] == pytest.approx((2 * 20.0 + 8 * 30.0) / 10 + 2.0)  # the forwards', and the engine's around
    step_s = (p["draft_ms"] + p["verify_ms"] + p["rollback_ms"]) / 1e3
    assert p["predicted_tokens_per_s"] == pytest.approx(27 / (0.1 + 10 * step_s))


def test_only_candidates_that_could_win_are_timed():
    def rank(r):
        return preference(r, min_tau=1.5, min_speedup=1.0, tau_margin=0.1)

    rows = [{"tau": 2.0, "tokens_per_s": 40.0, "speedup": 1.6},  # the best prediction
            {"tau": 2.4, "tokens_per_s": 37.0, "speedup": 1.48},  # within 10% of it
            {"tau": 2.9, "tokens_per_s": 20.0, "speedup": 0.8},  # predicted far slower
            {"tau": 1.2, "tokens_per_s": 44.0, "speedup": 1.76},  # faster, but its tau fails the gate whatever its speed
            {"tau": 1.9, "tokens_per_s": 35.0, "speedup": 1.4}]  # 14% slower: out at a 10% margin, in at 20%
    assert could_win(rows, rank, 0.1) == [0, 1]
    assert could_win(rows, rank, 0.2) == [0, 1, 4]
    assert could_win(rows, rank, 0.0, least=3) == [0, 1, 4]  # at least the `least` best predictions
    weak = [{"tau": 1.7, "tokens_per_s": 15.0, "speedup": 0.97}, {"tau": 1.8, "tokens_per_s": 12.0, "speedup": 0.8},
            {"tau": 1.4, "tokens_per_s": 20.0, "speedup": 1.3}]  # none clears both floors as predicted
    # the fastest prediction (choose_budget's fallback), and 0.97x, which would clear both floors 5% faster than
    # predicted (then it wins); 0.8x could not
    assert could_win(weak, rank, 0.05, least=1) == [0, 2]
