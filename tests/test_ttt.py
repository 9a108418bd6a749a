"""Training-time test: the parallel unroll computes exactly what sequential drafting computes, and trains."""
import pytest
import torch

from helpers import self_distilled_rows
from runtime.model import Transformer
from train import recipes
from train.recipes import eagle_loss, simulated_chain
from train.ttt import unroll


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return Transformer.from_pretrained(tiny_model_dir("llama", tie_word_embeddings=True, initializer_range=0.3),
                                       max_seq_len=128)


def test_unroll_equals_sequential_drafting(target):
    torch.manual_seed(0)
    model = recipes.build_eagle(target, None, from_target=False).eval()
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
    from train.trainer import TrainSpec, train

    data = Batches(self_distilled_rows(target, rows=24, prompt_vocab=96, new_tokens=40, max_seq_len=128), 8,
                   seed=0)
    model = recipes.build_eagle(target, torch.arange(96), from_target=False)
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
