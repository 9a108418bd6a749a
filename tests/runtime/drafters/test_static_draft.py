"""The EAGLE drafter's greedy trees at static shapes (runtime/drafters/shared/eagle_static.py, captured as CUDA graphs
on a GPU), run eagerly here: the same trees, scores and cache as the eager propose, and through the Engine the same
tokens and tau."""
import pytest
import torch

from runtime.drafters.shared.eagle_drafting import EagleDrafter
from runtime.drafters.shared.eagle_static import StaticEagleTree
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.engine import Engine, EngineConfig
from runtime.speculation.sampling import SamplingParams
from runtime.target.loading import from_pretrained
from support.helpers import perturbed
from train.recipes.eagle import build_eagle


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return from_pretrained(tiny_llama_dir, max_seq_len=128)


@pytest.fixture(scope="module", params=[False, True], ids=["full-vocab", "reduced-vocab"])
def eagle(target, request):
    torch.manual_seed(0)
    keep = torch.arange(0, target.config.vocab_size, 2) if request.param else None
    # random weights, not the pass-through init: every token, position and key matters
    return perturbed(build_eagle(target, keep, from_target=False), scale=0.1).requires_grad_(False)


BUDGETS = [DraftBudget(3), DraftBudget(2), DraftBudget(4, 2), DraftBudget(1, 3), DraftBudget(3, 3, 5),
           DraftBudget(2, 4, 20)]  # chains, a full tree, a root's top 3, trees cut to their best nodes


@pytest.mark.parametrize("buckets", [(1, 2, 4, 8, 16), (1, 2)], ids=["bucketed", "small-buckets-fall-back"])
def test_static_tree_proposes_what_the_eager_drafter_does(target, eagle, buckets, monkeypatch, min_span):
    ids = torch.randint(0, target.config.vocab_size, (48,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        feats = target(ids[None], target.new_cache(1, 64), torch.arange(48)[None]).hidden[0]
    eager, static = EagleDrafter(eagle, 64), EagleDrafter(eagle, 64)
    static.static = StaticEagleTree(eagle, static.cache, buckets=buckets, use_graph=False)
    for d in (eager, static):
        d.reset(ids[:13], feats[:12])  # 12 pending pairs: bucket 16, or the eager path with buckets (1, 2)
    recorded = []  # what the draft head reads: the root's and every expanded node's predicted feature
    head = eagle.head.forward
    monkeypatch.setattr(eagle.head, "forward", lambda h: recorded.append(h.reshape(-1, h.shape[-1])) or head(h))
    pos = 13
    for budget, n_commit in zip(BUDGETS, [1, 3, 2, 5, 1, 2]):
        trees, features = [], []
        for d in (eager, static):
            recorded.clear()
            trees.append(d.propose(budget, SamplingParams()))
            features.append(torch.cat(recorded))
        torch.testing.assert_close(features[1], features[0])  # far more sensitive than the argmax tokens
        assert trees[1].tokens.tolist() == trees[0].tokens.tolist() and len(trees[0]) == budget.max_nodes
        assert trees[1].parents.tolist() == trees[0].parents.tolist()
        torch.testing.assert_close(trees[1].scores, trees[0].scores)  # a lookup branch or max_tree ranks by them
        for d in (eager, static):
            d.commit(ids[pos:pos + n_commit], feats[pos - 1:pos - 1 + n_commit])
        pos += n_commit
    n = int(eager.cache.lengths[0])
    assert n == int(static.cache.lengths[0]) == static.cached == pos - 1 - 2  # the last commit is still pending
    torch.testing.assert_close(static.cache.k[:, :, :, :n], eager.cache.k[:, :, :, :n])


def test_static_tree_fits_its_buckets_and_the_cache(eagle):
    tree = StaticEagleTree(eagle, eagle.new_cache(1, 20), buckets=(1, 2, 4, 8, 16), use_graph=False)
    assert tree.fits(12, DraftBudget(3), 0) and not tree.fits(12, DraftBudget(3), 5)  # padded to 16 rows
    assert tree.fits(3, DraftBudget(3), 15) and not tree.fits(3, DraftBudget(4), 15)  # the expanded nodes' slots
    assert tree.fits(3, DraftBudget(2, 2), 15) and not tree.fits(3, DraftBudget(2, 3), 15)
    assert not tree.fits(17, DraftBudget(1), 0)  # no bucket
    assert not tree.fits(1, DraftBudget(1, eagle.head.weight.shape[0] + 1), 0)  # more children than tokens
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA drafter"):
        StaticEagleTree(eagle, eagle.new_cache(1, 20))


@pytest.mark.parametrize("temperature, budget", [(0.0, DraftBudget(3)), (0.0, DraftBudget(2, 3, 5)),
                                                 (1.0, DraftBudget(3))])
def test_engine_with_static_drafting_generates_the_same(target, eagle, temperature, budget, min_span):
    """Greedy: the static tree and verify give the eager engine's tokens and tau. Sampling drafts eagerly (the
    static tree is greedy only), so with the same seed the tokens are the same too."""
    prompt = torch.randint(0, target.config.vocab_size, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    gens = [Engine(target, EagleDrafter(eagle, 128),
                   EngineConfig(max_seq_len=128, budget=budget, adaptive=False, static_verify=flag))
            .generate(prompt, 40, SamplingParams(temperature=temperature), torch.Generator().manual_seed(3))
            for flag in (False, True)]
    assert gens[1].tokens == gens[0].tokens
    assert gens[1].metrics.target_forwards == gens[0].metrics.target_forwards
