"""The batched engine: every row equals its batch-1 decode (greedy) or keeps the target's distribution (sampled),
whatever drafter kind drafts and however rows join, leave and share steps; the batch policy it follows."""
import itertools
from collections import Counter

import pytest
import torch
from support.helpers import NoisyOracle, assert_three_tokens_follow_the_target, perturbed

from runtime.drafters.eagle3 import Eagle3Model, aux_layers
from runtime.drafters.lm import LMDrafter
from runtime.drafters.medusa import MedusaDrafter
from runtime.drafters.ngram import NgramDrafter
from runtime.drafters.quantspec import QuantSpecDrafter, shared_copy
from runtime.drafters.shared.eagle_drafting import EagleDrafter
from runtime.serving.batch_engine import BatchEngine, BatchRequest
from runtime.serving.budget_tuner import batch_sizes, measure_policy
from runtime.serving.served_engine import smaller_budgets
from runtime.speculation.draft_budget import BatchPolicy, DraftBudget, ServedBudget
from runtime.speculation.engine import Engine, EngineConfig
from runtime.speculation.sampling import SamplingParams
from runtime.target.attention import SpecAttnConfig
from runtime.target.loading import from_pretrained
from runtime.target.model import Transformer
from train.recipes.eagle import build_eagle
from train.recipes.lm import build_lm
from train.recipes.medusa import build_medusa

PROMPTS = [[5, 17, 33, 5, 17, 42, 8, 5, 17, 33, 61, 2, 9], [1, 2, 3, 4, 5, 6], [9, 9, 8, 7], [40, 41, 40, 41, 40],
           [3], [7, 70, 7, 70, 7, 70, 12]]
NEW_TOKENS = [40, 25, 33, 50, 10, 30]


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return from_pretrained(tiny_llama_dir, max_seq_len=128)


class RowOracle(NoisyOracle):
    """NoisyOracle for whichever prompt its row gets: it knows each prompt's greedy continuation and hides the right
    token among wrong siblings at a random place, so accepted paths leave the tree's first nodes (compaction)."""

    def __init__(self, vocab_size: int, references: list[list[int]], seed: int):
        super().__init__(vocab_size, [], p_right=0.7, width=3, seed=seed)
        self.references = references

    def reset(self, tokens, features):
        super().reset(tokens, features)
        self.reference = next(r for r in self.references if r[:tokens.numel() - 1] == tokens.tolist()[:-1])


def drafter_factory(kind: str, target: Transformer):
    if kind == "oracle":
        references = [p + t for p, t in zip(PROMPTS, batch1(target, lengths=[n + 8 for n in NEW_TOKENS]))]
        seeds = itertools.count()
        return lambda: RowOracle(target.config.vocab_size, references, next(seeds))
    if kind == "ngram":
        return lambda: NgramDrafter(target.config.vocab_size)
    if kind == "eagle":
        model = perturbed(build_eagle(target, None))
        return lambda: EagleDrafter(model, 128)
    if kind == "medusa":
        heads = perturbed(build_medusa(target, num_heads=3, keep_ids=None))
        return lambda: MedusaDrafter(heads)
    if kind == "quantspec":
        return lambda: QuantSpecDrafter(shared_copy(target, "int8"))
    model = perturbed(build_lm(target, layers=1, init="target"))
    return lambda: LMDrafter(model, 128)


def batch1(target, prompts=PROMPTS, lengths=NEW_TOKENS, stop_ids=()):
    engine = Engine(target, None, EngineConfig(max_seq_len=128))
    return [engine.generate(p, n, stop_ids=stop_ids).tokens for p, n in zip(prompts, lengths)]


@pytest.fixture(scope="module")
def peaked(tiny_model_dir):
    """Untied, with a large init: peaked next tokens that depend on the whole context (the tied tiny model mostly
    repeats its last token, which a wrong KV slot would not change)."""
    return from_pretrained(tiny_model_dir("llama", initializer_range=0.3), max_seq_len=128)


def rows_equal_batch1(target, new_drafter, fields: dict, batched: bool) -> None:
    """Six requests through three rows: rows join as others finish, trees of different sizes share a verify, one
    request ends early on a stop id; every row's tokens are its batch-1 decode's."""
    stop = batch1(target)[0][20]
    want = batch1(target, stop_ids=(stop,))
    for budget in (DraftBudget(4), DraftBudget(3, 2, 5)):
        cfg = EngineConfig(max_seq_len=100, budget=budget, **fields)
        engine = BatchEngine(target, new_drafter, cfg, max_batch=3)
        assert type(engine.drafter).__name__ == ("BatchEagle" if batched else "PerRowDrafters")
        engine.step_times = []
        out = engine.generate([BatchRequest(i, p, n, stop_ids=(stop,)) for i, (p, n) in
                               enumerate(zip(PROMPTS, NEW_TOKENS))])
        assert [g.tokens for g in out] == want
        assert max(n for n, _ in engine.step_times) == 3 and not engine.busy
        assert sum(g.metrics.draft_nodes for g in out) > 0
        assert sum(g.metrics.target_forwards for g in out) < sum(len(g.tokens) - 1 for g in out)  # drafts accepted


@pytest.mark.parametrize("kind,fields", [
    ("ngram", {}), ("eagle", {"lookup": 4}), ("eagle", {"static_verify": True}), ("medusa", {}), ("lm", {"lookup": 3}),
    ("quantspec", {}),
], ids=["ngram", "eagle-batched-lookup", "eagle-per-row-static", "medusa", "lm-lookup", "quantspec"])
def test_every_row_equals_its_batch1_greedy_decode(target, kind, fields):
    rows_equal_batch1(target, drafter_factory(kind, target), fields,
                      batched=kind == "eagle" and not fields.get("static_verify"))


def test_quantspec_rows_draft_over_their_own_row_of_the_target_cache_as_rows_move(target):
    """Each row's draft reads the target's cache of its row, also after a finished row's neighbours moved down; a
    draft reading another row's, or an emptied one, would agree with the target far less often."""
    new_drafter = drafter_factory("quantspec", target)
    cfg = EngineConfig(max_seq_len=100, budget=DraftBudget(4), speed_check=False)
    engine = BatchEngine(target, new_drafter, cfg, max_batch=3)
    lengths = (6, 60, 60)  # the first row ends early, the other two move down and go on
    for i, n in enumerate(lengths):
        engine.submit(BatchRequest(i, PROMPTS[i], n))
    done, moved, keys = {}, False, []
    while engine.busy:
        done.update(engine.step())
        before, keys = keys, [r and r.request.key for r in engine.rows]
        moved |= any(k is not None and k in before and before.index(k) != b for b, k in enumerate(keys))
        for b, row in enumerate(engine.rows):
            if row is not None:
                assert engine.drafter.drafters[b].cache.k.data_ptr() == engine.cache.row(b).k.data_ptr()
    assert moved
    alone = Engine(target, new_drafter(), cfg)
    for i, n in enumerate(lengths):
        single = alone.generate(PROMPTS[i], n)
        assert done[i].tokens == single.tokens
        assert done[i].metrics.tau >= single.metrics.tau - 0.5, i


def test_rows_accepting_paths_off_their_first_nodes_keep_only_those(peaked):
    """The oracle hides the right token among wrong siblings, so accepted nodes are rarely the tree's first ones:
    each row's cache must keep exactly its accepted path's KV, on a target whose answer depends on all of it."""
    assert len(set(batch1(peaked)[0])) > 20  # a varied answer
    rows_equal_batch1(peaked, drafter_factory("oracle", peaked), {}, batched=False)


def test_plain_batched_decoding_equals_batch1(target):
    out = BatchEngine(target, None, EngineConfig(max_seq_len=100), max_batch=4).generate(
        [BatchRequest(i, p, n) for i, (p, n) in enumerate(zip(PROMPTS, NEW_TOKENS))])
    assert [g.tokens for g in out] == batch1(target)
    assert all(g.metrics.tau == 1.0 and g.metrics.draft_nodes == 0 for g in out)


def test_rows_join_and_leave_between_steps(target):
    """Plain decoding (a token a row a step): request 2 takes request 0's row the step after it ends, and request 1
    finishes alone once request 2 has left."""
    engine = BatchEngine(target, None, EngineConfig(max_seq_len=100), max_batch=2)
    engine.step_times = []
    for i, n in enumerate((5, 60, 12)):
        engine.submit(BatchRequest(i, PROMPTS[i], n))
    finished_at = {}
    while engine.busy:
        for key in engine.step():
            finished_at[key] = len(engine.step_times)
    assert finished_at == {0: 4, 2: 15, 1: 59}  # the prefill gives each its first token
    assert [n for n, _ in engine.step_times] == [2] * 15 + [1] * 44
    engine = BatchEngine(target, drafter_factory("ngram", target), EngineConfig(max_seq_len=100), max_batch=2)
    engine.submit(BatchRequest("a", PROMPTS[0], 30))
    engine.submit(BatchRequest("b", PROMPTS[1], 30))
    engine.step()
    assert engine.cancel("a") and engine.running == 1 and not engine.cancel("a")
    done = {}
    while engine.busy:
        done.update(engine.step())
    assert list(done) == ["b"] and done["b"].tokens == batch1(target, [PROMPTS[1]], [30])[0]
    with pytest.raises(ValueError, match="already queued or running"):
        engine.submit(BatchRequest("c", PROMPTS[0], 5))
        engine.submit(BatchRequest("c", PROMPTS[0], 5))


def test_bad_settings_and_requests_are_refused(target):
    with pytest.raises(ValueError, match="full-precision KV cache"):
        BatchEngine(target, None, EngineConfig(max_seq_len=64, kv_scheme="int8"), max_batch=2)
    with pytest.raises(ValueError, match="max_batch=0"):
        BatchEngine(target, None, EngineConfig(max_seq_len=64), max_batch=0)
    engine = BatchEngine(target, None, EngineConfig(max_seq_len=32), max_batch=2)
    with pytest.raises(ValueError, match="does not fit the KV cache of max_seq_len=32"):
        engine.submit(BatchRequest(0, list(range(30)), 5))
    with pytest.raises(ValueError, match=r"contains \[96\]"):
        engine.submit(BatchRequest(0, [1, 96], 3))


def test_sampled_rows_keep_the_target_distribution_beside_a_greedy_row(target):
    """Five rows a step: two prompts sampled twice each (Medusa's drawn trees, verified against q) and a greedy one.
    Each sampled prompt's first three tokens follow the target's exact probabilities (chi-square); the greedy row
    is its batch-1 decode every time."""
    params = SamplingParams(temperature=1.0, top_k=2)
    prompts = [PROMPTS[0][:6], PROMPTS[3], PROMPTS[1]]
    greedy = batch1(target, [prompts[2]], [3])[0]
    cfg = EngineConfig(max_seq_len=32, budget=DraftBudget(depth=2, width=2), adaptive=False)
    engine = BatchEngine(target, drafter_factory("medusa", target), cfg, max_batch=5)
    gen = torch.Generator().manual_seed(0)
    trials = 300
    counts = [Counter(), Counter()]
    for trial in range(trials):
        sampled = [BatchRequest((trial, r), prompts[r % 2], 3, params, generator=gen) for r in range(4)]
        out = engine.generate(sampled + [BatchRequest((trial, 4), prompts[2], 3)])
        for r in range(4):
            counts[r % 2][tuple(out[r].tokens)] += 1
        assert out[4].tokens == greedy
    n = 2 * trials
    for prompt, seen in zip(prompts, counts):
        assert_three_tokens_follow_the_target(target, prompt, params, seen, n)


def test_the_engine_drafts_what_the_policy_says_for_its_batch_size(target):
    tree = ServedBudget(DraftBudget(3, 2, 5))
    policy = BatchPolicy(((1, tree), (2, ServedBudget(DraftBudget(1))), (3, None)))
    assert [policy.at(n) for n in (1, 2, 3, 9)] == [tree, ServedBudget(DraftBudget(1)), None, None]
    assert policy.describe() == "1: 3x2/5; 2: 1x1/1; 3+: plain decoding"
    with pytest.raises(ValueError, match="starting at 1"):
        BatchPolicy(((2, None),))
    new = drafter_factory("ngram", target)
    sizes = []  # (rows in the step, most nodes a row drafted)

    class Spy(NgramDrafter):
        def propose(self, budget, params, generator=None):
            sizes.append((engine.running, budget.max_nodes))
            return super().propose(budget, params, generator)

    engine = BatchEngine(target, lambda: Spy(target.config.vocab_size), EngineConfig(max_seq_len=100,
                         budget=DraftBudget(3, 2, 5), adaptive=False), max_batch=3, policy=policy)
    out = engine.generate([BatchRequest(i, p, n) for i, (p, n) in enumerate(zip(PROMPTS[:3], (8, 40, 20)))])
    assert [g.tokens for g in out] == batch1(target, PROMPTS[:3], (8, 40, 20))
    assert {rows for rows, _ in sizes} == {1, 2}  # three rows a step: plain decoding, no drafting
    assert all(nodes <= (5 if rows == 1 else 1) for rows, nodes in sizes)
    assert new is not None


def test_measured_policy_keeps_the_fastest_option_at_each_batch_size(target):
    assert batch_sizes(6) == [1, 2, 4, 6] and batch_sizes(1) == [1]
    cfg = EngineConfig(max_seq_len=100)
    candidates = [(ServedBudget(DraftBudget(3)), None), (ServedBudget(DraftBudget(1)), 1.5)]
    policy = measure_policy(target, drafter_factory("ngram", target), cfg, candidates, PROMPTS[:3], max_batch=4,
                            new_tokens=8, repeats=1)
    by_batch = policy.report["by_batch"]
    assert [r["rows"] for r in by_batch] == [1, 2, 4]
    for r in by_batch:
        best = max(r["options"], key=lambda o: o["tokens_per_s"])
        assert r["chosen"] == best["budget"] and policy.at(r["rows"]) == next(
            (b for b, _ in candidates if b.spec == best["budget"]), None)
        assert r["options"][2]["tau"] == 1.5 and r["options"][2]["calibrated_tau"]
        assert r["options"][0]["budget"] is None and all(o["step_ms"] > 0 for o in r["options"])


def test_a_draft_window_hands_a_drafter_only_the_prompts_last_tokens(target):
    seen = []

    class Recording(NoisyOracle):
        def reset(self, tokens, features):
            seen.append((tokens.tolist(), features.shape[0]))
            super().reset(tokens, features)

    def new():
        return Recording(target.config.vocab_size, [], p_right=0.0, width=1, seed=0)

    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]  # 13, 6 and 4 tokens: the last fits a window of 4 whole
    want = batch1(target, prompts, [10] * 3)
    cfg = EngineConfig(max_seq_len=100, budget=DraftBudget(2), draft_window=4)
    out = BatchEngine(target, new, cfg, max_batch=3).generate([BatchRequest(i, p, 10) for i, p in enumerate(prompts)])
    assert [g.tokens for g in out] == want
    assert Engine(target, new(), cfg).generate(prompts[0], 10).tokens == want[0]
    read = [(p[-4:] + [w[0]], min(len(p), 4)) for p, w in zip(prompts + prompts[:1], want + want[:1])]
    assert sorted(seen) == sorted(read)
    with pytest.raises(ValueError, match=r"draft_window=4 with SpecAttn"):
        EngineConfig(draft_window=4, sparse=SpecAttnConfig((-1, 0), top_p=0.5))


def test_a_growing_batch_drafts_within_the_sweeps_smaller_budgets_or_the_served_one_cut():
    served = ServedBudget(DraftBudget(1, 3, 3), lookup=16, max_tree=5)  # verifies at most 5 nodes
    chain2, single = ServedBudget(DraftBudget(2, 1, 2)), ServedBudget(DraftBudget(1, 1, 1))
    sweep = [{**chain2.to_dict(), "tau": 1.6}, {**single.to_dict(), "tau": 1.4},
             {**ServedBudget(DraftBudget(1, 2, 2)).to_dict(), "tau": 1.5},
             {**ServedBudget(DraftBudget(1), adaptive=True).to_dict(), "tau": 1.9},  # adaptive: not fixed
             {**ServedBudget(DraftBudget(1, 1, 1), lookup=2).to_dict()}]  # predicted, never timed: no tau
    assert smaller_budgets(served, sweep) == [(chain2, 1.6), (single, 1.4)]  # at most 2 nodes, then 1
    cut = lambda n: (ServedBudget(DraftBudget(1, 3, 3), lookup=16, max_tree=n), None)  # noqa: E731
    assert smaller_budgets(served, sweep[:1]) == [(chain2, 1.6), cut(1)]
    assert smaller_budgets(served, []) == [cut(2), cut(1)]
    assert smaller_budgets(ServedBudget(DraftBudget(1)), sweep) == []  # one node: nothing smaller


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0)], ids=["greedy", "sampled"])
def test_batched_eagle_proposes_each_rows_own_tree(target, params):
    """EAGLE's batched forward (one causal step for every row's pending pairs, one step a depth for every row's
    expanded nodes) proposes, row by row, the tree EagleDrafter proposes for that sequence alone: rows of
    different lengths and budgets, a row that does not draft, and a second round after commits."""
    new = drafter_factory("eagle", target)
    batched, alone = new().batched(3), [new() for _ in range(3)]
    ids = torch.randint(0, 96, (3, 14), generator=torch.Generator().manual_seed(3))
    for r, n in enumerate((14, 9, 5)):
        with torch.no_grad():
            hidden = target(ids[r:r + 1, :n], target.new_cache(1, 64), torch.arange(n)[None]).hidden[0]
        batched.reset(r, ids[r, :n], hidden[:-1])
        alone[r].reset(ids[r, :n], hidden[:-1])
    budgets = {0: DraftBudget(4, 3, 10), 1: DraftBudget(2, 2, 3), 2: DraftBudget(3)}
    for rows in ([0, 1, 2], [0, 2]):
        seeds = {r: torch.Generator().manual_seed(10 + r) for r in rows}
        got = batched.propose(rows, [budgets[r] for r in rows], [params] * len(rows), [seeds[r] for r in rows])
        for r, tree in zip(rows, got):
            want = alone[r].propose(budgets[r], params, torch.Generator().manual_seed(10 + r))
            assert tree.tokens.tolist() == want.tokens.tolist() and tree.parents.tolist() == want.parents.tolist()
            torch.testing.assert_close(tree.scores, want.scores)
            if not params.greedy:
                torch.testing.assert_close(tree.q, want.q)
        committed = {r: torch.randint(0, 96, (2,), generator=torch.Generator().manual_seed(r)) for r in range(3)}
        features = {r: torch.randn(2, target.config.dim, generator=torch.Generator().manual_seed(r)) for r in range(3)}
        batched.commit(rows, [committed[r] for r in rows], [features[r] for r in rows])
        for r in rows:
            alone[r].commit(committed[r], features[r])


def test_eagle3_rows_equal_their_batch1_greedy_decode(tiny_model_dir):
    """eagle3 drafts a batch from the streams the batched verify taps: wrong or missing streams change its trees."""
    target = from_pretrained(tiny_model_dir("llama", num_hidden_layers=8), max_seq_len=128)
    model = perturbed(Eagle3Model.from_target(target, None, aux_layers(None, 8)))
    rows_equal_batch1(target, lambda: EagleDrafter(model, 128), {"lookup": 2}, batched=True)
