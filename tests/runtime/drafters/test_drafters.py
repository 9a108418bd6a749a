"""Drafters built on the runtime model: dynamic trees, EAGLE and Medusa proposals, bundle round trips."""
import pytest
import torch

from runtime.drafters.shared.draft_head import DraftHead, frequent_token_ids
from runtime.drafters.shared.eagle_drafting import EagleDrafter
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.dynamic_tree import Candidates, TreeSlots, grow_tree
from runtime.speculation.sampling import SamplingParams
from runtime.target.loading import from_pretrained
from support.helpers import perturbed
from train.recipes.eagle import build_eagle
from train.recipes.medusa import build_medusa

GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.9, top_k=20)


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return from_pretrained(tiny_llama_dir, max_seq_len=128)


def _random_expand(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return lambda c, nodes: torch.softmax(3 * torch.randn(len(nodes), vocab, generator=g), -1)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED])
def test_grow_tree_is_closed_and_within_budget(params):
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        root = torch.softmax(3 * torch.randn(50, generator=g), -1)
        budget = DraftBudget(depth=4, width=3, nodes=9)
        tree = grow_tree(root, _random_expand(50, seed), budget, params, g, keep_q=not params.greedy)
        assert 0 < len(tree) <= 9 and int(tree.depths().max()) <= 4
        assert bool((tree.parents < torch.arange(len(tree))).all())
        if not params.greedy:  # every row with children has its q, and each child has mass there
            for row, kids in enumerate(tree.children()):
                for k in kids:
                    assert tree.q[row, tree.tokens[k]] > 0


def test_greedy_tree_prefers_likely_paths():
    root = torch.tensor([0.5, 0.3, 0.2] + [0.0] * 7)
    expand = lambda c, nodes: torch.tensor([[0.0] * 3 + [0.9, 0.1] + [0.0] * 5] * len(nodes))
    tree = grow_tree(root, expand, DraftBudget(depth=2, width=2, nodes=3), GREEDY)
    # candidates: 0 (.5), 1 (.3), 0->3 (.45), 0->4 (.05), 1->3 (.27): the top 3 are 0, 1, 0->3
    assert tree.tokens.tolist() == [0, 1, 3] and tree.parents.tolist() == [-1, -1, 0]


def test_tree_slots_mask_sees_prefix_and_ancestors_only():
    c = Candidates()
    c.tokens, c.parents, c.logp, c.eff = [5, 6, 7], [-1, 0, -1], [0.0] * 3, [0.0] * 3
    s = TreeSlots(prefix_len=4, root_position=4)
    s.place(c, [0, 2])
    slots, pos, mask = s.place(c, [1])
    assert slots.tolist() == [[6]] and pos.tolist() == [[6]]  # depth 2 below the root at position 4
    assert mask[0, 0, 0].tolist() == [True] * 4 + [True, False, True]  # prefix, parent 0, not sibling 2, itself


def test_eagle_tree_matches_sequential_recompute(target):
    """Every expanded node's draft distribution must equal the one a plain causal pass along its own path gives
    (committed pairs, then each ancestor with the feature predicted at its parent). A wrong tree mask (a
    sibling's KV visible), slot or position changes it."""
    torch.manual_seed(0)
    model = perturbed(build_eagle(target, None))  # off the pass-through init: tokens, positions, context all matter
    ids = torch.randint(0, 96, (1, 12))
    feats = target(ids, target.new_cache(1, 64), torch.arange(12)[None]).hidden[0]
    drafter = EagleDrafter(model, 128)
    drafter.reset(ids[0], feats[:-1])
    params = SamplingParams(temperature=1.0)
    tree = drafter.propose(DraftBudget(depth=4, width=3, nodes=20), params, torch.Generator().manual_seed(1))

    def sequential_probs(path):
        with torch.no_grad():
            cache = model.new_cache(1, 64)
            f = model.causal(ids[:, 1:], feats[None, :-1], cache)[0, -1]
            cache.advance(11)
            for n in path:
                f = model.causal(tree.tokens[n].view(1, 1), f.view(1, 1, -1), cache)[0, -1]
                cache.advance(1)
            return model.head(f).softmax(-1)

    expanded = [r for r in range(len(tree) + 1) if tree.q[r].sum() > 0]
    assert len(expanded) >= 4  # root plus nodes at several depths
    for row in expanded:
        path, a = [], row - 1
        while a >= 0:
            path.insert(0, a)
            a = int(tree.parents[a])
        torch.testing.assert_close(tree.q[row], sequential_probs(path), rtol=1e-4, atol=1e-5)


def test_reduced_vocab_head_maps_back():
    w = torch.randn(30, 8)
    keep = torch.tensor([3, 1, 7, 7])
    head = DraftHead(w, keep)
    assert head.keep_ids.tolist() == [1, 3, 7]
    probs = torch.tensor([0.2, 0.5, 0.3])
    full = head.to_target(probs)
    assert full.shape == (30,) and full[3] == 0.5 and full.sum() == pytest.approx(1.0)
    assert head.to_draft(torch.tensor([7, 2])).tolist() == [2, -1]
    assert frequent_token_ids(torch.tensor([4, 4, 4, 2, 2, 9]), 2).tolist() == [2, 4]
    fill = torch.tensor([8, 4, 6, 1])  # the slots the stream leaves take fill's ids not yet chosen, lowest first
    assert frequent_token_ids(torch.tensor([4, 4, 4, 2, 2, 9]), 5, fill=fill).tolist() == [1, 2, 4, 6, 9]
    assert frequent_token_ids(torch.tensor([4, 4, 2]), 2, fill=fill).tolist() == [2, 4]  # none left
    with pytest.raises(ValueError, match="draft vocabulary"):
        DraftHead(w, torch.tensor([30]))


def test_medusa_tree_uses_head_per_depth(target):
    from runtime.drafters.medusa import MedusaDrafter

    heads = build_medusa(target, num_heads=3, keep_ids=None).eval()
    d = MedusaDrafter(heads)
    f = torch.randn(4, target.config.dim)
    d.reset(torch.arange(5), f)
    tree = d.propose(DraftBudget(depth=5, width=2, nodes=6), GREEDY)
    assert int(tree.depths().max()) <= 3  # no deeper than the number of heads
    with torch.no_grad():
        expected_first = heads(f[-1])[0].argmax()
    assert int(tree.tokens[0]) == int(expected_first)
