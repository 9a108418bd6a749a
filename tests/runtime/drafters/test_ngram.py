import random

import pytest
import torch

from runtime.drafters.ngram import NgramDrafter, answer_spans, corpus_spans, load_corpus, merged_spans, save_corpus
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.drafter import Drafter
from runtime.speculation.sampling import SamplingParams

GREEDY = SamplingParams()


def _drafter(tokens: list[int], **kwargs) -> NgramDrafter:
    d = NgramDrafter(vocab_size=100, **kwargs)
    d.reset(torch.tensor(tokens), None)
    return d


def _paths(tree) -> list[list[int]]:
    """Root-to-node token path of every node."""
    paths: list[list[int]] = []
    for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
        paths.append((paths[parent] if parent >= 0 else []) + [token])
    return paths


def test_draft_budget():
    assert DraftBudget(depth=4, width=2).max_nodes == 8 and DraftBudget(depth=4, width=2, nodes=5).max_nodes == 5
    for kwargs, match in [(dict(depth=0), "depth=0"), (dict(depth=2, width=0), "width=0"),
                          (dict(depth=2, nodes=-1), "nodes=-1"), (dict(depth=1.5), "depth=1.5")]:
        with pytest.raises(ValueError, match=match):
            DraftBudget(**kwargs)


def test_is_a_drafter_without_features():
    d = NgramDrafter(vocab_size=10)
    assert isinstance(d, Drafter) and not d.needs_features and d.vocab_size == 10


def test_continues_repeated_text():
    phrase = [11, 12, 13, 14, 15, 16]
    d = _drafter(phrase + [40, 41] + phrase[:2])
    tree = d.propose(DraftBudget(depth=4), GREEDY)
    assert tree.tokens.tolist() == [13, 14, 15, 16] and tree.parents.tolist() == [-1, 0, 1, 2] and tree.q is None


def test_branches_ranked_by_count_then_recency():
    # after "1 2": 3 twice, 7 once, 8 once (8 more recent than 7)
    d = _drafter([1, 2, 3, 9, 1, 2, 7, 9, 1, 2, 3, 5, 1, 2, 8, 6, 1, 2])
    tree = d.propose(DraftBudget(depth=1, width=3), GREEDY)
    assert tree.tokens.tolist() == [3, 8, 7] and tree.parents.tolist() == [-1, -1, -1]
    assert d.propose(DraftBudget(depth=1, width=2), GREEDY).tokens.tolist() == [3, 8]


def test_longest_matching_suffix_wins():
    # "3" alone was followed by 8 twice, but "6 3" was followed by 9
    d = _drafter([3, 8, 3, 8, 6, 3, 9, 6, 3], max_ngram=2)
    assert d.propose(DraftBudget(depth=1, width=2), GREEDY).tokens.tolist() == [9]
    d = _drafter([3, 8, 3, 8, 6, 3, 9, 6, 3], max_ngram=1)
    assert d.propose(DraftBudget(depth=1, width=2), GREEDY).tokens.tolist() == [8, 9]


def test_no_match_gives_empty_tree():
    assert len(_drafter([1, 2, 3, 4]).propose(DraftBudget(depth=3, width=2), GREEDY)) == 0
    # a single repeated token is below min_ngram=2
    assert len(_drafter([5, 1, 6, 1], min_ngram=2).propose(DraftBudget(depth=3), GREEDY)) == 0
    assert _drafter([5, 1, 6, 1]).propose(DraftBudget(depth=3), GREEDY).tokens.tolist()[:1] == [6]


def test_commit_updates_the_trie():
    d = _drafter([1, 2, 3, 4, 1, 2])
    assert d.propose(DraftBudget(depth=2, width=2), GREEDY).tokens.tolist() == [3, 4]
    d.commit(torch.tensor([3, 5]), None)  # sequence: 1 2 3 4 1 2 3 5
    d.commit(torch.tensor([1, 2, 3]), None)  # ... 1 2 3: now 4 and 5 both followed "1 2 3", 5 more recently
    assert d.propose(DraftBudget(depth=1, width=2), GREEDY).tokens.tolist() == [5, 4]


def test_incremental_commits_equal_a_fresh_reset():
    rng = random.Random(0)
    budget = DraftBudget(depth=4, width=3, nodes=10)
    for _ in range(20):
        seq = [rng.randrange(5) for _ in range(rng.randrange(2, 60))]
        d = _drafter(seq[:1], max_ngram=3, max_depth=4)
        i = 1
        while i < len(seq):
            step = rng.randrange(1, 5)
            d.commit(torch.tensor(seq[i:i + step]), None)
            i += step
        got, ref = d.propose(budget, GREEDY), _drafter(seq, max_ngram=3, max_depth=4).propose(budget, GREEDY)
        assert got.tokens.tolist() == ref.tokens.tolist() and got.parents.tolist() == ref.parents.tolist()


def _count(seq: list[int], pattern: list[int]) -> int:
    n = len(pattern)
    return sum(seq[i:i + n] == pattern for i in range(len(seq) - n + 1))


def _followers(seq: list[int], pattern: list[int]) -> dict[int, int]:
    """token -> occurrences of pattern + [token] in seq."""
    n = len(pattern)
    out: dict[int, int] = {}
    for i in range(len(seq) - n):
        if seq[i:i + n] == pattern:
            out[seq[i + n]] = out.get(seq[i + n], 0) + 1
    return out


def _longest_matched_suffix(seq: list[int], max_ngram: int) -> list[int] | None:
    for length in range(min(max_ngram, len(seq)), 0, -1):
        if _followers(seq, seq[-length:]):
            return seq[-length:]
    return None


def test_proposals_are_the_budgets_most_frequent_continuations():
    """Brute-force oracle: the tree is the best-first (by count) expansion of the longest matched suffix."""
    rng = random.Random(1)
    for case in range(60):
        max_ngram, max_depth = rng.randrange(1, 4), rng.randrange(1, 5)
        seq = [rng.randrange(rng.randrange(2, 6)) for _ in range(rng.randrange(1, 50))]
        budget = DraftBudget(depth=rng.randrange(1, max_depth + 1), width=rng.randrange(1, 4),
                             nodes=rng.randrange(0, 12))
        tree = _drafter(seq, max_ngram=max_ngram, max_depth=max_depth).propose(budget, GREEDY)
        suffix = _longest_matched_suffix(seq, max_ngram)
        if suffix is None:
            assert len(tree) == 0, case
            continue
        assert 0 < len(tree) <= budget.max_nodes, case
        assert bool((tree.depths() <= budget.depth).all()), case
        paths = _paths(tree)
        counts = [_count(seq, suffix + p) for p in paths]
        assert all(c > 0 for c in counts), case  # every path really followed the suffix
        children = tree.children()
        for row, kids in enumerate(children):
            prefix = [] if row == 0 else paths[row - 1]
            if len(prefix) >= budget.depth:
                assert not kids, case
                continue
            available = sorted(_followers(seq, suffix + prefix).values(), reverse=True)
            taken = [counts[k] for k in kids]
            assert len(taken) <= budget.width and taken == available[:len(taken)], (case, row)  # top, in order
            could_take = min(budget.width, len(available))
            if len(tree) < budget.max_nodes:
                assert len(taken) == could_take, (case, row)  # nothing left out while budget remains
            elif len(taken) < could_take:
                assert available[len(taken)] <= min(counts), (case, row)  # nothing better left out


def test_bad_input():
    with pytest.raises(ValueError, match="max_ngram=0"):
        NgramDrafter(vocab_size=10, max_ngram=0)
    with pytest.raises(ValueError, match="min_ngram=3 > max_ngram=2"):
        NgramDrafter(vocab_size=10, max_ngram=2, min_ngram=3)
    d = NgramDrafter(vocab_size=10)
    with pytest.raises(ValueError, match="empty token sequence"):
        d.reset(torch.tensor([], dtype=torch.long), None)
    with pytest.raises(ValueError, match=r"token ids in \[0, 10\], expected \[0, 10\)"):
        d.reset(torch.tensor([0, 10]), None)
    with pytest.raises(ValueError, match=r"expected \[m\]"):
        d.reset(torch.tensor([[1, 2]]), None)


def test_answer_spans_are_the_masked_runs_with_their_context():
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    mask = torch.tensor([0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 1])  # rows [0, 6) and [6, 11)
    spans = answer_spans(ids, mask, torch.tensor([0, 6, 11]), context=2)
    assert [s.tolist() for s in spans] == [[1, 2, 3, 4], [7, 8, 9], [9, 10, 11]]  # context stays inside its row


def test_the_corpus_drafts_where_the_sequence_has_no_match():
    corpus = NgramDrafter.corpus(100, [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([20, 21, 5, 6, 30])])
    d = NgramDrafter(100, corpus=corpus)
    d.reset(torch.tensor([1, 2, 3, 5, 6]))  # no earlier "6": the corpus continues "5 6" (7 and 30, once each)
    tree = d.propose(DraftBudget(depth=3, width=2), GREEDY)
    assert sorted(_paths(tree)) == [[7], [7, 8], [7, 8, 9], [30]]
    assert tree.scores[0] < _drafter([5, 6, 7, 5, 6]).propose(DraftBudget(depth=1), GREEDY).scores[0]
    d.commit(torch.tensor([40, 5, 6]))  # the sequence's own "5 6" continues with 40... and wins over the corpus
    assert _paths(d.propose(DraftBudget(depth=1), GREEDY)) == [[40]]
    d.reset(torch.tensor([1, 2, 3, 9, 6]))  # "6" alone is shorter than the corpus's min_ngram of 2: nothing
    assert len(d.propose(DraftBudget(depth=3), GREEDY)) == 0
    d.reset(torch.tensor([1, 9, 20]))  # no substring across two spans: "9 20" was never seen
    assert len(d.propose(DraftBudget(depth=1), GREEDY)) == 0


def test_a_saved_corpus_drafts_as_the_one_it_was_saved_from(tmp_path):
    spans = [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([20, 21, 5, 6, 30])]
    save_corpus(tmp_path / "c.safetensors", spans, vocab_size=100)
    for corpus in (NgramDrafter.corpus(100, spans, max_depth=3), load_corpus(tmp_path / "c.safetensors", 3)):
        d = NgramDrafter(100, corpus=corpus)
        d.reset(torch.tensor([1, 5, 6]))
        assert sorted(_paths(d.propose(DraftBudget(depth=4, width=2), GREEDY))) == [[7], [7, 8], [7, 8, 9], [30]]
    with pytest.raises(ValueError, match="vocab_size 50"):
        NgramDrafter(50, corpus=load_corpus(tmp_path / "c.safetensors", 3))


def test_merged_spans_keep_the_newer_first_each_once_within_the_bound(tmp_path):
    newer = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    older = [torch.tensor([4, 5]), torch.tensor([7, 8, 9]), torch.tensor([10, 11])]
    save_corpus(tmp_path / "old.safetensors", older, vocab_size=100)
    read, vocab = corpus_spans(tmp_path / "old.safetensors")
    assert vocab == 100 and [s.tolist() for s in read] == [s.tolist() for s in older]
    merged = merged_spans(newer, read)
    assert [s.tolist() for s in merged] == [[1, 2, 3], [4, 5], [7, 8, 9], [10, 11]]
    assert [s.tolist() for s in merged_spans(newer, read, max_tokens=7)] == [[1, 2, 3], [4, 5]]  # [7, 8, 9] would pass 7
