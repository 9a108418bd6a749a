import pytest
import torch

from runtime.speculation.tree import DraftTree


def _tree(parents: list[int]) -> DraftTree:
    return DraftTree(torch.arange(10, 10 + len(parents)), torch.tensor(parents, dtype=torch.long))


# root -> 0 -> 2 -> 4
#      \      \-> 3
#       \-> 1 -> 5
BRANCHY = [-1, -1, 0, 0, 2, 1]


def test_depths():
    assert _tree(BRANCHY).depths().tolist() == [1, 1, 2, 2, 3, 2]
    assert DraftTree.chain(torch.tensor([7, 8, 9])).depths().tolist() == [1, 2, 3]
    assert DraftTree.empty().depths().tolist() == []


def test_children_in_proposal_order():
    assert _tree(BRANCHY).children() == [[0, 1], [2, 3], [5], [4], [], [], []]
    assert DraftTree.empty().children() == [[]]


def test_ancestor_mask_matches_parent_walk():
    tree = _tree(BRANCHY)
    mask = tree.ancestor_mask()
    assert mask.shape == (7, 7) and mask.dtype == torch.bool
    for row in range(7):
        expected = {0, row}
        node = row - 1
        while node >= 0:
            expected.add(node + 1)
            node = BRANCHY[node]
        assert set(torch.nonzero(mask[row]).flatten().tolist()) == expected, row


def test_ancestor_mask_of_chain_is_causal():
    mask = DraftTree.chain(torch.tensor([5, 6, 7, 8])).ancestor_mask()
    assert torch.equal(mask, torch.ones(5, 5, dtype=torch.bool).tril())


def test_siblings_do_not_see_each_other():
    mask = _tree([-1, -1, -1]).ancestor_mask()
    assert torch.equal(mask, torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]], dtype=torch.bool))


def test_chain_parents():
    tree = DraftTree.chain(torch.tensor([4, 5, 6]))
    assert tree.parents.tolist() == [-1, 0, 1] and tree.tokens.dtype == torch.long and len(tree) == 3


def test_rejects_child_before_parent():
    with pytest.raises(ValueError, match="parent must come before"):
        _tree([-1, 2, 0])
    with pytest.raises(ValueError, match="parent must come before"):
        _tree([0])


def test_rejects_length_mismatch():
    with pytest.raises(ValueError, match="3 tokens but 2 parents"):
        DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0]))


def test_union_merges_shared_paths_and_appends_the_rest():
    # a: root -> 7 -> 8, root -> 9;  b: root -> 7 -> 8 -> 10, root -> 7 -> 11
    a = DraftTree(torch.tensor([7, 9, 8]), torch.tensor([-1, -1, 0]))
    b = DraftTree(torch.tensor([7, 8, 10, 11]), torch.tensor([-1, 0, 1, 0]))
    u = a.union(b)
    assert u.tokens.tolist() == [7, 9, 8, 10, 11] and u.parents.tolist() == [-1, -1, 0, 2, 0]
    paths = lambda t: {tuple(t.tokens[i].item() for i in range(len(t)) if t.ancestor_mask()[r + 1, i + 1])
                       for r in range(len(t))}
    assert paths(u) == paths(a) | paths(b)  # every root path of either tree, each once
    assert a.union(DraftTree.empty()).tokens.tolist() == a.tokens.tolist()
    assert DraftTree.empty().union(b).parents.tolist() == b.parents.tolist()


def test_union_keeps_the_higher_score_of_a_merged_node_and_best_keeps_the_likeliest():
    # drafter: root -> 7 (-0.2) -> 8 (-0.9), root -> 9 (-1.5); lookup: root -> 7 (-0.5) -> 8 (-0.6) -> 10 (-0.8)
    a = DraftTree(torch.tensor([7, 9, 8]), torch.tensor([-1, -1, 0]), scores=torch.tensor([-0.2, -1.5, -0.9]))
    b = DraftTree(torch.tensor([7, 8, 10]), torch.tensor([-1, 0, 1]), scores=torch.tensor([-0.5, -0.6, -0.8]))
    u = a.union(b)
    assert u.tokens.tolist() == [7, 9, 8, 10] and u.scores.tolist() == pytest.approx([-0.2, -1.5, -0.6, -0.8])
    assert a.union(DraftTree.chain(torch.tensor([5]))).scores is None  # an unranked tree: no scores to compare
    top = u.best(3)  # 7, 8, 10: the chain outranks the drafter's second guess, parents kept before children
    assert top.tokens.tolist() == [7, 8, 10] and top.parents.tolist() == [-1, 0, 1]
    assert top.scores.tolist() == pytest.approx([-0.2, -0.6, -0.8]) and u.best(4) is u
    unranked = DraftTree(torch.tensor([7, 9, 8]), torch.tensor([-1, -1, 0]))
    assert unranked.best(2).tokens.tolist() == [7, 9]  # unranked: the first nodes, in proposal order
    bad = DraftTree(torch.tensor([7, 8]), torch.tensor([-1, 0]), scores=torch.tensor([-2.0, -0.1]))
    with pytest.raises(ValueError, match="scores above its parent"):
        bad.best(1)
    with pytest.raises(ValueError, match="2 tokens but 1 scores"):
        DraftTree(torch.tensor([7, 8]), torch.tensor([-1, 0]), scores=torch.tensor([0.0]))


def test_union_refuses_trees_drawn_with_a_distribution():
    sampled = DraftTree.chain(torch.tensor([3]), q=torch.full((2, 4), 0.25))
    with pytest.raises(ValueError, match="greedy only"):
        sampled.union(DraftTree.chain(torch.tensor([3])))


def test_a_tree_is_read_to_the_host_once_and_a_tree_made_there_not_at_all(monkeypatch):
    """On a GPU each read of a tree's tensors waits for the device; the engine walks a tree several times a step
    (union, best, depths, mask, verify, acceptance stats), so a tree reads its tensors once, and one made from host
    lists (union, best, the lookup branch) never."""
    import dataclasses

    from runtime.speculation import tree as tree_module
    from runtime.speculation.verify import verify_greedy

    reads = []
    read = tree_module.HostLists.read
    monkeypatch.setattr(tree_module.HostLists, "read", staticmethod(lambda *a: reads.append(1) or read(*a)))
    scores = torch.tensor([-0.1, -0.7, -0.2, -0.3, -0.4, -0.9])
    drafted = DraftTree(torch.arange(10, 16), torch.tensor(BRANCHY), scores=scores)
    assert len(reads) == 1  # the parents check
    drafted.depths(), drafted.ancestor_mask(), drafted.children(), drafted.best(3)
    lookup = DraftTree.from_lists([10, 12, 20], [-1, 0, 1], [-0.05, -0.15, -0.6], "cpu")
    union = drafted.union(lookup)
    verify_greedy(union, torch.randn(len(union) + 1, 32))
    assert len(reads) == 1
    assert drafted.host_lists().scores == scores.tolist()  # float32 values, as the tensor holds them
    assert union.host_lists().tokens == union.tokens.tolist() and union.host_lists().parents == union.parents.tolist()
    assert union.host_lists().scores == union.scores.tolist() == pytest.approx([-0.05, -0.7, -0.15, -0.3, -0.4,
                                                                                -0.9, -0.6])
    with pytest.raises(dataclasses.FrozenInstanceError):  # the host copy stays the tensors' copy
        drafted.scores = scores


def test_union_with_a_limit_is_the_union_cut_to_its_best():
    drafted = DraftTree(torch.arange(10, 16), torch.tensor(BRANCHY),
                        scores=torch.tensor([-0.1, -0.7, -0.2, -0.3, -0.4, -0.9]))
    lookup = DraftTree.from_lists([10, 12, 20, 21], [-1, 0, 1, 2], [-0.05, -0.15, -0.6, -0.65], "cpu")
    for limit in (2, 5, 8, 20):
        whole, cut = drafted.union(lookup).best(limit), drafted.union(lookup, limit=limit)
        assert cut.host_lists() == whole.host_lists() and cut.tokens.tolist() == whole.tokens.tolist()
    assert drafted.union(DraftTree.empty(), limit=3).tokens.tolist() == drafted.best(3).tokens.tolist()
