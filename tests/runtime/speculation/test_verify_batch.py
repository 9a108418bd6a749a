"""verify_batch: rows of different trees, sizes and sampling params verified from one padded forward keep each row's
distribution (the chi-squared check of test_verify, row by row), and wrong batched verifiers fail that check."""
import pytest
import torch
from support.helpers import assert_first_tokens_match
from test_verify import GREEDY, SAMPLE, TRIALS, V

from runtime.speculation.sampling import SamplingParams, sample, warp
from runtime.speculation.tree import DraftTree
from runtime.speculation.verify import draw_children, verify_batch, verify_greedy

def _draw_tree(widths: list[int], draft: list, params: SamplingParams, gen) -> tuple[DraftTree, list[tuple]]:
    """A tree drawn breadth-first from the draft tables (as _simulate draws it), and each row's prefix."""
    depth, tokens, parents, prefixes, row = len(widths), [], [], [()], 0
    while row < len(prefixes):
        prefix = prefixes[row]
        if len(prefix) < depth:
            for token in draw_children(draft[len(prefix)][prefix], widths[len(prefix)], params, gen).tolist():
                tokens.append(token)
                parents.append(row - 1)
                prefixes.append(prefix + (token,))
        row += 1
    q = None if params.greedy else torch.stack(
        [draft[len(p)][p] if len(p) < depth else torch.zeros(V) for p in prefixes])
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), q), prefixes


def _simulate_batch(rows: list[tuple[list[int], SamplingParams]], verifier, trials: int = TRIALS, seed: int = 0):
    """Each trial draws one tree per row (its own tables, params and widths), pads their target logits into one
    [B, T, V] tensor (padding rows: a spike on token 0) and verifies them together. -> per sampled row (counts,
    expected) of its first three emitted tokens; greedy rows are checked against verify_greedy on the way."""
    gen = torch.Generator().manual_seed(seed)
    tables = []
    for r, (widths, params) in enumerate(rows):
        g = torch.Generator().manual_seed(200 + r)
        logits = [1.5 * torch.randn([V] * (k + 1), generator=g) for k in range(len(widths) + 3)]
        draft = [warp(t + 0.8 * torch.randn(t.shape, generator=g), params) for t in logits[:len(widths)]]
        tables.append((logits, draft, [warp(t, params) for t in logits]))
    counts = [torch.zeros([V] * 3) for _ in rows]
    for _ in range(trials):
        drawn = [_draw_tree(w, tables[r][1], p, gen) for r, (w, p) in enumerate(rows)]
        T = max(len(tree) for tree, _ in drawn) + 1
        batch = torch.full((len(rows), T, V), -5.0)
        batch[:, :, 0] = 5.0
        for r, (tree, prefixes) in enumerate(drawn):
            batch[r, :len(prefixes)] = torch.stack([tables[r][0][len(p)][p] for p in prefixes])
        verdicts = verifier([t for t, _ in drawn], batch, [p for _, p in rows], [gen] * len(rows))
        for r, ((tree, prefixes), verdict) in enumerate(zip(drawn, verdicts)):
            if rows[r][1].greedy:
                assert verdict == verify_greedy(tree, batch[r, :len(prefixes)])
                continue
            emitted = [tree.host_lists().tokens[i] for i in verdict.accepted] + [verdict.next_token]
            while len(emitted) < 3:
                emitted.append(int(sample(tables[r][2][len(emitted)][tuple(emitted)], gen)))
            counts[r][tuple(emitted[:3])] += 1
    out = []
    for r, (_, params) in enumerate(rows):
        if not params.greedy:
            p = tables[r][2]
            out.append((counts[r], p[0][:, None, None] * p[1][:, :, None] * p[2]))
    return out


BATCH_ROWS = [([3, 2], SAMPLE), ([1], SamplingParams(temperature=0.6, top_k=3)), ([2, 1], GREEDY),
              ([1, 1, 1], SamplingParams(temperature=1.4))]


def test_rows_verified_together_keep_each_rows_distribution():
    """verify_batch over rows of different trees, sizes and params in one padded forward: each sampled row emits
    its own target's distribution under its own warp; the greedy row is verify_greedy's."""
    for counts, expected in _simulate_batch(BATCH_ROWS, verify_batch, trials=4000):
        assert_first_tokens_match(counts, expected)


def _first_rows_params(trees, logits, params, generators):
    """WRONG: verifies every row with the first row's sampling params."""
    return verify_batch(trees, logits, [params[0]] * len(trees), generators)


def _rows_shifted_by_one(trees, logits, params, generators):
    """WRONG: reads each row's verify rows one position late (its root row skipped)."""
    return verify_batch(trees, torch.cat([logits[:, 1:], logits[:, -1:]], 1), params, generators)


@pytest.mark.parametrize("wrong", [_first_rows_params, _rows_shifted_by_one])
def test_wrong_batched_verifiers_fail_the_same_check(wrong):
    rows = [BATCH_ROWS[0], BATCH_ROWS[1]]
    failures = 0
    for counts, expected in _simulate_batch(rows, wrong, trials=2000):
        try:
            assert_first_tokens_match(counts, expected)
        except AssertionError:
            failures += 1
    assert failures >= 1


def test_batched_verification_refuses_mismatched_inputs():
    tree = DraftTree.chain(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="2 trees, 1 params and 2 generators for a batch of 2"):
        verify_batch([tree, tree], torch.randn(2, 3, V), [GREEDY], [None, None])
    with pytest.raises(ValueError, match=r"expected \[2, >= 3, V\]"):
        verify_batch([tree, tree], torch.randn(2, 2, V), [GREEDY] * 2, [None, None])
