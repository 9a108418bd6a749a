import pytest
import torch

from runtime.speculation.sampling import SamplingParams, sample, warp
from runtime.speculation.tree import DraftTree
from runtime.speculation.verify import Verdict, draw_children, verify, verify_greedy, verify_sampling
import runtime.speculation.verify as verify_module
from support.helpers import assert_first_tokens_match, chi_square, chi_square_critical

GREEDY = SamplingParams()
V = 6


def _logits_with_argmax(best: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.randn(len(best), vocab, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(best)), torch.tensor(best)] = 10.0
    return logits


# ---------------------------------------------------------------- sampling params and warp

@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"), (dict(top_k=2.0), "top_k"),
])
def test_sampling_params_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_warp_greedy_is_point_mass_on_argmax():
    logits = torch.randn(4, 7)
    probs = warp(logits, GREEDY)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.sum(-1), torch.ones(4))
    assert int((probs > 0).sum()) == 4


def test_warp_temperature_top_k_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    assert torch.allclose(warp(logits, SamplingParams(temperature=2.0)), (logits / 2).softmax(-1))
    top3 = warp(logits, SamplingParams(temperature=1.0, top_k=3))
    assert torch.allclose(top3[0, :3], logits[0, :3].softmax(-1)) and top3[0, 3:].sum() == 0
    full = logits.softmax(-1)[0]
    # top-p keeps the smallest most-probable prefix holding top_p of the mass
    threshold = float(full[:2].sum()) - 1e-3
    kept = warp(logits, SamplingParams(temperature=1.0, top_p=threshold))
    assert torch.allclose(kept[0, :2], full[:2] / full[:2].sum()) and kept[0, 2:].sum() == 0
    kept = warp(logits, SamplingParams(temperature=1.0, top_p=float(full[:2].sum()) + 1e-3))
    assert (kept[0, :3] > 0).all() and kept[0, 3:].sum() == 0
    # top-k first, then top-p over the renormalised top-k
    both = warp(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.99))
    assert torch.allclose(both[0, :2], full[:2] / full[:2].sum())


@pytest.mark.parametrize("scale, kept_range", [(8.0, (1, 64)), (3.0, (65, 1024)), (0.5, (1025, 5000))],
                         ids=["small-nucleus", "medium-nucleus", "flat"])
def test_top_p_matches_a_full_sort_whatever_the_nucleus_size(scale, kept_range):
    logits = scale * torch.randn(3, 5000, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, top_p=0.9)
    probs = logits.softmax(-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, sorted_probs.cumsum(-1) - sorted_probs < 0.9)
    expected = probs * keep / (probs * keep).sum(-1, keepdim=True)
    got = warp(logits, params)
    kept = (got > 0).sum(-1)
    assert ((kept >= kept_range[0]) & (kept <= kept_range[1])).all(), kept
    assert torch.equal(got > 0, keep) and torch.allclose(got, expected)


def test_sample_shape_and_support():
    probs = torch.zeros(3, 2, 5)
    probs[..., 3] = 1.0
    out = sample(probs, torch.Generator().manual_seed(0))
    assert out.shape == (3, 2) and out.dtype == torch.long and (out == 3).all()


# ---------------------------------------------------------------- greedy verification

def test_greedy_accepts_whole_chain_and_takes_bonus():
    tree = DraftTree.chain(torch.tensor([3, 5, 2]))
    assert verify_greedy(tree, _logits_with_argmax([3, 5, 2, 8])) == Verdict([0, 1, 2], 8)


def test_greedy_rejects_first_token():
    tree = DraftTree.chain(torch.tensor([3, 5, 2]))
    assert verify_greedy(tree, _logits_with_argmax([4, 5, 2, 8])) == Verdict([], 4)


def test_greedy_stops_at_first_mismatch():
    tree = DraftTree.chain(torch.tensor([3, 5, 2]))
    assert verify_greedy(tree, _logits_with_argmax([3, 5, 7, 8])) == Verdict([0, 1], 7)


def test_greedy_picks_the_matching_branch():
    # root -> 0:3 -> 2:6 ; root -> 1:4 -> 3:5 -> 4:9
    tree = DraftTree(torch.tensor([3, 4, 6, 5, 9]), torch.tensor([-1, -1, 0, 1, 3]))
    # rows: root, n0, n1, n2, n3, n4 ; the target wants 4, then 5 (at n1's row), then 9 (at n3's row), then 1
    logits = _logits_with_argmax([4, 6, 5, 0, 9, 1])
    assert verify_greedy(tree, logits) == Verdict([1, 3, 4], 1)


def test_greedy_on_empty_tree_is_plain_decoding():
    assert verify_greedy(DraftTree.empty(), _logits_with_argmax([7])) == Verdict([], 7)


def test_greedy_on_bf16_ties_takes_the_first_maximum_as_decoding_does():
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (2, 40), generator=g).to(torch.bfloat16)  # many tied maxima per row
    first_max = [row.index(max(row)) for row in logits.float().tolist()]
    tree = DraftTree.chain(torch.tensor([first_max[0]]))
    assert verify_greedy(tree, logits) == Verdict([0], first_max[1])


def test_verify_dispatch_and_greedy_as_sampling_limit():
    tree = DraftTree(torch.tensor([3, 4, 6, 5, 9]), torch.tensor([-1, -1, 0, 1, 3]))
    logits = _logits_with_argmax([4, 6, 5, 0, 9, 1])
    expected = verify_greedy(tree, logits)
    assert verify(tree, logits, GREEDY) == expected
    # sampling verification of greedy-warped (point mass) targets must reproduce greedy exactly
    assert verify_sampling(tree, warp(logits, GREEDY), torch.Generator().manual_seed(1)) == expected


def test_verify_rejects_wrong_row_count():
    tree = DraftTree.chain(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"expected \[3, V\]"):
        verify_greedy(tree, torch.randn(2, 10))
    with pytest.raises(ValueError, match=r"expected \[3, V\]"):
        verify_sampling(tree, torch.rand(4, 10).softmax(-1))
    with pytest.raises(ValueError, match="DraftTree.q"):
        verify_sampling(DraftTree.chain(torch.tensor([1, 2]), q=torch.rand(3, 9)), torch.rand(3, 10).softmax(-1))


def test_sampling_refuses_child_outside_draft_support():
    q = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    tree = DraftTree(torch.tensor([2]), torch.tensor([-1]), q)
    with pytest.raises(ValueError, match="draft probability 0"):
        verify_sampling(tree, torch.full((2, 3), 1 / 3))


# ---------------------------------------------------------------- edge cases of the rejection step

def test_residual_when_target_equals_draft_falls_back_to_target_without_rejected_token():
    p = torch.tensor([0.2, 0.3, 0.5])
    residual, q = verify_module._reject(p, p.clone(), 2)
    assert torch.allclose(residual, torch.tensor([0.4, 0.6, 0.0])) and torch.allclose(q, residual)


def test_residual_when_target_is_point_mass_on_rejected_token():
    p = torch.tensor([0.0, 1.0, 0.0])
    residual, q = verify_module._reject(p, None, 1)
    assert torch.equal(residual, p) and q is None


def test_draft_without_mass_left_becomes_zero_not_nan():
    residual, q = verify_module._reject(torch.tensor([0.5, 0.5]), torch.tensor([0.0, 1.0]), 1)
    assert torch.equal(q, torch.zeros(2)) and torch.allclose(residual, torch.tensor([1.0, 0.0]))


def test_empty_tree_samples_from_target():
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    assert verify_sampling(DraftTree.empty(), p, torch.Generator().manual_seed(0)) == Verdict([], 2)


# ---------------------------------------------------------------- draw_children

def test_draw_children_greedy_is_top_k():
    q = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
    assert draw_children(q, 3, GREEDY).tolist() == [1, 3, 4]
    assert draw_children(q, 9, GREEDY).tolist() == [1, 3, 4, 0, 2]
    with pytest.raises(ValueError, match="k=0"):
        draw_children(q, 0, GREEDY)


def test_draw_children_sampling_is_without_replacement_within_support():
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    params = SamplingParams(temperature=1.0)
    pairs = torch.zeros(V, V)
    trials = 6000
    for _ in range(trials):
        kids = draw_children(q, 2, params, gen).tolist()
        assert len(set(kids)) == 2 and all(q[k] > 0 for k in kids)
        pairs[kids[0], kids[1]] += 1
    assert draw_children(q, 5, params, gen).numel() == 3  # only 3 tokens have mass
    # sequential draws without replacement: P(a, b) = q(a) q(b) / (1 - q(a))
    expected = q[:, None] * q[None, :] / (1 - q[:, None])
    expected.fill_diagonal_(0)
    stat, df = chi_square(pairs.flatten(), expected.flatten())
    assert stat < chi_square_critical(df), (stat, df)


# ---------------------------------------------------------------- statistical losslessness
#
# A toy target and drafter over V=6 tokens: the target's next-token logits are a random table indexed by the whole
# prefix, the drafter's are the target's plus noise (so drafts are often, but not always, accepted and deep rows
# matter). Each trial drafts a fresh tree (children drawn with draw_children, as real drafters do), verifies it,
# and records the first L = min(3, depth + 1) emitted tokens; when a step emits fewer, the rest come from plain
# sampling of the target, which is what the next steps would produce if verification is lossless. Lossless
# verification makes (t1, t2, t3) ~ p(t1) p(t2 | t1) p(t3 | t1 t2); the first token, the first two and all L are
# each checked with a chi-square test at alpha = 1e-6. L reaches past the leaves of depth-1 and depth-2 trees, so
# the bonus token drawn at an accepted leaf is checked too.

TRIALS = 6000


def _tables(depth: int, params: SamplingParams, seed: int) -> tuple[list, list]:
    """Warped target and draft next-token distributions; entry k is indexed by a prefix of k tokens."""
    gen = torch.Generator().manual_seed(seed)
    target_logits = [1.5 * torch.randn([V] * (k + 1), generator=gen) for k in range(depth + 1)]
    draft_logits = [t + 0.8 * torch.randn(t.shape, generator=gen) for t in target_logits[:depth]]
    return [warp(t, params) for t in target_logits], [warp(d, params) for d in draft_logits]


def _simulate(widths: list[int], params: SamplingParams, verifier, seed: int = 0, trials: int = TRIALS,
              deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (counts of the first L emitted tokens [V] * L, their expected joint probabilities [V] * L)."""
    depth = len(widths)
    length = min(3, depth + 1)
    target, draft = _tables(depth, params, seed=100 + seed)
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros([V] * length)
    for _ in range(trials):
        tokens, parents, prefixes = [], [], [()]
        row = 0
        while row < len(prefixes):  # breadth-first: row r + 1 is node r, parents precede children
            prefix = prefixes[row]
            if len(prefix) < depth:
                q = draft[len(prefix)][prefix]
                kids = draw_children(q, widths[len(prefix)], GREEDY if deterministic else params, gen)
                for token in kids.tolist():
                    tokens.append(token)
                    parents.append(row - 1)
                    prefixes.append(prefix + (token,))
            row += 1
        q_rows = None if deterministic else torch.stack(
            [draft[len(pr)][pr] if len(pr) < depth else torch.zeros(V) for pr in prefixes])
        tree = DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), q_rows)
        verdict = verifier(tree, torch.stack([target[len(pr)][pr] for pr in prefixes]), gen)
        emitted = [tokens[i] for i in verdict.accepted] + [verdict.next_token]
        while len(emitted) < length:
            emitted.append(int(sample(target[len(emitted)][tuple(emitted)], gen)))
        counts[tuple(emitted[:length])] += 1
    expected = target[0]
    for k in range(1, length):
        expected = expected[..., None] * target[k]
    return counts, expected


SAMPLE = SamplingParams(temperature=1.0)
WARPED = SamplingParams(temperature=1.3, top_k=4, top_p=0.9)  # top-k binds on every row, top-p on most


@pytest.mark.parametrize("widths", [[1], [1, 1], [1, 1, 1]], ids=["chain1", "chain2", "chain3"])
def test_chain_sampling_is_lossless(widths):
    assert_first_tokens_match(*_simulate(widths, SAMPLE, verify_sampling))


def test_tree_sampling_is_lossless():
    assert_first_tokens_match(*_simulate([3, 2], SAMPLE, verify_sampling, seed=1))


def test_tree_sampling_with_top_k_top_p_is_lossless():
    # draft supports differ from the target's: children outside the target's support are always rejected
    assert_first_tokens_match(*_simulate([2, 3], WARPED, verify_sampling, seed=2))


def test_verify_warps_logits_before_sampling_verification():
    gen = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(4, 9, generator=gen)
    q = warp(logits + torch.randn(4, 9, generator=gen), WARPED)
    tree = DraftTree.chain(torch.cat([draw_children(q[r], 1, WARPED, gen) for r in range(3)]), q)
    target = warp(logits, WARPED)
    for seed in range(20):
        got = verify(tree, logits, WARPED, torch.Generator().manual_seed(seed))
        assert got == verify_sampling(tree, target, torch.Generator().manual_seed(seed))
        assert target[len(got.accepted), got.next_token] > 0


def test_deterministic_drafter_tree_is_lossless():
    assert_first_tokens_match(*_simulate([3, 2], SAMPLE, verify_sampling, seed=3, deterministic=True))


def _accept_always(tree: DraftTree, target_probs: torch.Tensor, generator) -> Verdict:
    """WRONG: takes the first path without testing it (emits the draft distribution)."""
    accepted, children = [], tree.children()
    while children[accepted[-1] + 1 if accepted else 0]:
        accepted.append(children[accepted[-1] + 1 if accepted else 0][0])
    return Verdict(accepted, int(sample(target_probs[accepted[-1] + 1], generator)))


_reject_correct = verify_module._reject


def _reject_keeping_drawn_sibling(p, q, x):
    """WRONG: forgets that siblings are drawn without replacement (q keeps x)."""
    residual, _ = _reject_correct(p, q, x)
    return residual, q


def _reject_without_residual(p, q, x):
    """WRONG: after a rejection samples from p without x instead of the residual norm(max(0, p - q))."""
    _, q = _reject_correct(p, q, x)
    rest = p.clone()
    rest[x] = 0.0
    return rest / rest.sum(), q


def _bonus_from_parent_row(tree: DraftTree, target_probs: torch.Tensor, generator) -> Verdict:
    """WRONG: when a leaf is accepted, draws the bonus from the leaf's parent row instead of the leaf's row."""
    verdict = verify_sampling(tree, target_probs, generator)
    if not verdict.accepted or tree.children()[verdict.accepted[-1] + 1]:
        return verdict
    parent_row = int(tree.parents[verdict.accepted[-1]]) + 1
    return Verdict(verdict.accepted, int(sample(target_probs[parent_row], generator)))


@pytest.mark.parametrize("wrong_verifier", [_accept_always, _bonus_from_parent_row])
def test_wrong_verifiers_fail_the_same_check(wrong_verifier):
    counts, expected = _simulate([1, 1], SAMPLE, wrong_verifier, trials=2000)
    with pytest.raises(AssertionError, match="chi2"):
        assert_first_tokens_match(counts, expected)


@pytest.mark.parametrize("wrong_reject, widths", [(_reject_keeping_drawn_sibling, [3, 2]),
                                                  (_reject_without_residual, [1, 1, 1])])
def test_rejection_step_bugs_fail_the_same_check(monkeypatch, wrong_reject, widths):
    monkeypatch.setattr(verify_module, "_reject", wrong_reject)
    counts, expected = _simulate(widths, SAMPLE, verify_sampling, seed=1)
    with pytest.raises(AssertionError, match="chi2"):
        assert_first_tokens_match(counts, expected)
