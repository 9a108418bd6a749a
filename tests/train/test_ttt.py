"""Training-time test: the parallel unroll computes exactly what sequential drafting computes, and trains."""
import pytest
import torch

from runtime.target.loading import from_pretrained
from support.helpers import self_distilled_rows
from train import target_outputs
from train.recipes import eagle as eagle_recipe
from train.recipes.eagle import eagle_loss, simulated_chain
from train.ttt import unroll


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return from_pretrained(tiny_model_dir("llama", tie_word_embeddings=True, initializer_range=0.3),
                                       max_seq_len=128)


def test_unroll_equals_sequential_drafting(target):
    torch.manual_seed(0)
    model = eagle_recipe.build_eagle(target, None, from_target=False).eval()
    ids = torch.randint(0, 96, (1, 14))
    f = torch.randn(1, 14, target.config.dim)
    depth = 4
    with torch.no_grad():
        preds = unroll(model, ids, f[:, :-1], depth)
        for j in (0, 3, 8):
            cache = model.new_cache(1, 64)
            feat = model.causal(ids[:, 1:j + 2], f[:, :j + 1], cache)[0, -1]  # true pairs P_0..P_j
            cache.advance(j + 1)
            torch.testing.assert_close(preds[0][0, j], feat, atol=1e-5, rtol=1e-5)
            for d in range(2, depth + 1):
                if j + d >= ids.shape[1]:
                    break
                feat = model.causal(ids[:, j + d:j + d + 1], feat[None, None], cache)[0, -1]
                cache.advance(1)
                torch.testing.assert_close(preds[d - 1][0, j], feat, atol=1e-5, rtol=1e-5)


def test_training_through_the_unroll_raises_deep_acceptance(target, tmp_path):
    from train.batches import Batches
    from train.spec import TrainSpec
    from train.trainer import train

    data = Batches(self_distilled_rows(target, rows=24, prompt_vocab=96, new_tokens=40, max_seq_len=128), 8,
                   seed=0)
    model = eagle_recipe.build_eagle(target, torch.arange(96), from_target=False)
    before = simulated_chain(model, target, [data.batch_at(0)], depth=4)
    history = []
    train(model, eagle_loss(target, depth=3), data, TrainSpec(steps=60, lr=3e-3, warmup=2), tmp_path,
          log=lambda step, m: history.append(m))
    after = simulated_chain(model.eval(), target, [data.batch_at(0)], depth=4)
    assert history[-1]["top1_d3"] > history[0]["top1_d3"] + 0.2
    assert after["sim_tau"] > before["sim_tau"] + 0.25 and 1 <= after["sim_tau"] <= 5
    assert after["sim_accept_d2"] > before["sim_accept_d2"]
    # on the target's own greedy rows, the replay's depth-1 acceptance is the teacher-forced top-1 agreement
    with torch.no_grad():
        _, m = eagle_loss(target, noise=0.0)(model, data.batch_at(0))
    assert abs(after["sim_accept_d1"] - m["top1_d1"]) < 0.02


def test_unroll_restricted_to_wanted_rows_predicts_the_same_there(target):
    torch.manual_seed(1)
    model = eagle_recipe.build_eagle(target, None, from_target=False).eval()
    ids = torch.randint(0, 96, (2, 14))
    f = torch.randn(2, 14, target.config.dim)
    wanted = [torch.rand(2, 13) < 0.4 for _ in range(3)]
    with torch.no_grad():
        full = unroll(model, ids, f[:, :-1], 3)
        some = unroll(model, ids, f[:, :-1], 3, wanted)
    needed = wanted[2]
    for d in (3, 2, 1):  # a row is computed where wanted or unrolled into a wanted deeper row
        needed = needed | wanted[d - 1]
        torch.testing.assert_close(some[d - 1][needed], full[d - 1][needed], atol=1e-5, rtol=1e-5)
        assert bool((some[d - 1][~needed] == 0).all()) and bool(needed.any()) and not bool(needed.all())


@pytest.mark.parametrize("candidates", [0, 3])
def test_eagle_loss_equals_the_loss_over_every_row(target, candidates):
    """eagle_loss skips rows no loss reads and computes the goals once for all depths; the loss and every
    gradient equal those of the plain computation over every row. With candidates, the token loss of both is the
    soft CE over the union of every goal's top ids."""
    from train.batches import Batches
    from train.losses import cross_entropy_to, feature_regression

    batch = Batches(self_distilled_rows(target, rows=4, prompt_vocab=96, new_tokens=20, max_seq_len=128), 4,
                    seed=0).batch_at(0)
    model = eagle_recipe.build_eagle(target, torch.arange(80), from_target=False)

    def plain(model, batch, depth=3, decay=0.7, noise=0.1):
        t = target_outputs.target_features(target, batch)
        f, mask, ids = t.features, t.mask, batch["input_ids"]
        T = ids.shape[1]
        inputs = f[:, :-1] + noise * (2 * torch.rand_like(f[:, :-1]) - 1)
        kept = slice(None)
        if candidates:  # every goal: the target's distribution at a position p >= 1 with x_{p+1} assistant
            kept = model.head(f[:, 1:T - 1][mask[:, 2:]]).topk(candidates, -1).indices.unique()
            assert 0 < len(kept) < model.head.weight.shape[0]
        total = 0.0
        for d, pred in enumerate(unroll(model, ids, inputs, depth), start=1):
            n = T - d - 1
            m = mask[:, d + 1:d + 1 + n]
            pred, goal = pred[:, :n][m], f[:, d:d + n][m]
            ones = torch.ones(len(pred), dtype=torch.bool)
            probs = model.head(goal).softmax(-1)[:, kept]
            tok = cross_entropy_to(probs, model.head(pred)[:, kept])
            total = total + decay ** (d - 1) * (feature_regression(pred, goal, ones) + 0.1 * tok)
        return total

    results = []
    for loss_fn in (plain, lambda m, b: eagle_loss(target, depth=3, candidates=candidates)(m, b)[0]):
        torch.manual_seed(0)
        model.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]))
    (plain_loss, plain_grads), (loss, grads) = results
    torch.testing.assert_close(loss, plain_loss, atol=1e-6, rtol=1e-6)
    assert len(grads) == len(plain_grads) > 0
    for g, ref in zip(grads, plain_grads):
        torch.testing.assert_close(g, ref, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("depth", [2, 3])
def test_unroll_attention_equals_masked_sdpa_and_its_gradients(depth):
    from runtime.target.attention import pick_backend
    from train.ttt import ChainKV, unroll_mask

    torch.manual_seed(depth)
    n, shapes = 11, {"q": (2, 6, 11, 8), "keys": (2, 2, depth * 11, 8), "values": (2, 2, depth * 11, 8)}
    inputs = {k: torch.randn(s, dtype=torch.float64, requires_grad=True) for k, s in shapes.items()}
    mask, grad = unroll_mask(n, depth, torch.device("cpu")), torch.randn(shapes["q"], dtype=torch.float64)
    results = []
    for attend in (ChainKV.attend, pick_backend(torch.device("cpu"))):
        out = attend(inputs["q"], inputs["keys"], inputs["values"], mask, None)
        results.append((out, *torch.autograd.grad(out, list(inputs.values()), grad)))
    for ours, reference in zip(*results):
        torch.testing.assert_close(ours, reference, atol=1e-10, rtol=1e-10)
