"""Each drafter kind learns on a tiny target, survives the bundle round trip, and keeps greedy output exact."""
from dataclasses import replace

import pytest
import torch

from export.bundle_writer import write_bundle
from runtime.bundle_reader import read_bundle
from runtime.drafters import DRAFT_VOCAB, build_drafter
from runtime.drafters.ngram import NgramDrafter
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.engine import Engine, EngineConfig
from runtime.speculation.sampling import SamplingParams
from runtime.speculation.tau_probe import TauProbe
from runtime.target.loading import from_pretrained
from support.helpers import self_distilled_rows
from train.batches import Batches
from train.recipes import eagle as eagle_recipe
from train.recipes import medusa as medusa_recipe
from train.spec import TrainSpec
from train.trainer import train


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    # a large init makes next-token distributions peaked, as a trained model's are (random ones are near-uniform)
    hf = tiny_model_dir("llama", tie_word_embeddings=True, initializer_range=0.3)
    return from_pretrained(hf, max_seq_len=256)


@pytest.fixture(scope="module")
def self_distilled(target):
    return self_distilled_rows(target, rows=24, prompt_vocab=96, new_tokens=40)


def _train(model, loss_fn, data, steps, tmp_path, lr):
    history = []
    train(model, loss_fn, Batches(data, 8, seed=0), TrainSpec(steps=steps, lr=lr, warmup=2), tmp_path,
          log=lambda step, m: history.append(m))
    return history


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_drafter_learns_and_stays_lossless(kind, target, self_distilled, tmp_path):
    keep = torch.arange(0, 96)
    if kind == "eagle":
        # from scratch: the tiny target's last block alone already predicts it almost perfectly
        model, loss_fn = eagle_recipe.build_eagle(target, keep, from_target=False), eagle_recipe.eagle_loss(target)
        acc, lr, min_tau = "top1", 3e-3, 1.2
    else:
        model, loss_fn = medusa_recipe.build_medusa(target, 3, keep), medusa_recipe.medusa_loss(target)
        acc, lr, min_tau = "head0_top1", 2e-2, 1.05  # one zero-initialised residual layer per head: it needs a push
    history = _train(model, loss_fn, self_distilled, 60, tmp_path / "ckpt", lr)
    first, last = history[0], history[-1]
    assert last["loss"] < 0.9 * first["loss"]
    assert last[acc] > first[acc] + 0.1

    config = {"kind": "eagle", "draft_vocab": 96} if kind == "eagle" else model.cfg.to_dict()
    tensors = {**model.state_dict(), DRAFT_VOCAB: keep}
    write_bundle(tmp_path / "bundle", config, tensors, target_fingerprint="t", data_digest="d", config={},
                 code_version="test")
    drafter = build_drafter(read_bundle(tmp_path / "bundle", "t"), target, 320)
    budget = DraftBudget(depth=3, width=2, nodes=6)
    plain = Engine(target, None, EngineConfig(max_seq_len=256))
    spec = Engine(target, drafter, EngineConfig(max_seq_len=256, budget=budget, adaptive=False))
    taus = []
    for i in range(3):  # prompts it was trained on: a 60-step drafter of a random target does not generalise
        prompt = self_distilled.row(i)[0][:6].tolist()
        want = plain.generate(prompt, 30, SamplingParams()).tokens
        got = spec.generate(prompt, 30, SamplingParams())
        assert got.tokens == want
        taus.append(got.metrics.tau)
    assert sum(taus) / len(taus) > min_tau  # the trained drafter is accepted beyond the bonus token


def test_the_tau_probe_ends_each_reply_at_end_of_turn(target):
    """Distill's and calibrate's tau stops where serving and validate stop, not max_new_tokens later."""
    prompt = [5, 9, 13, 17, 21, 25]
    plain = Engine(target, None, EngineConfig(max_seq_len=256)).generate(prompt, 30, SamplingParams()).tokens
    stop = plain[6]
    probe = TauProbe([prompt], DraftBudget(depth=3, width=1, nodes=3), 30)
    full = probe.measure(target, NgramDrafter(target.config.vocab_size))
    ended = replace(probe, stop_ids=(stop,)).measure(target, NgramDrafter(target.config.vocab_size))
    assert full["tau_tokens"] == 29  # the first token is the prefill's, not a speculative step's
    assert ended["tau_tokens"] == plain.index(stop) < 29
