"""The engine's sampling path with drafters that carry draft probabilities (lm, EAGLE, Medusa at T > 0): the first
three tokens it emits follow the target's exact probabilities, and an engine that skips the residual after a
rejection, or accepts every draft, fails the same test."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from support.helpers import assert_three_tokens_follow_the_target, perturbed

from runtime.drafters.lm import LMDrafter
from runtime.drafters.medusa import MedusaDrafter
from runtime.drafters.shared.eagle_drafting import EagleDrafter
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.engine import Engine, EngineConfig
import runtime.speculation.engine as engine_module
from runtime.speculation.sampling import SamplingParams, sample, warp
from runtime.speculation.verify import Verdict
import runtime.speculation.verify as verify_module
from runtime.target.loading import from_pretrained
from runtime.target.model import Transformer
from train.recipes.eagle import build_eagle
from train.recipes.lm import build_lm
from train.recipes.medusa import build_medusa

PARAMS = SamplingParams(temperature=1.0, top_k=3)
PROMPT = [5, 17, 33, 5, 17, 42]
TRIALS = 1000  # enough for the residual-free engine's bias to stand out (chi2 ~110 against a bound of 62)
BUDGET = DraftBudget(depth=2, width=2, nodes=4)
LENGTH = 5  # tokens generated; the first three are counted (with fewer, the engine has little room left to draft)


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    # a large init makes next-token distributions peaked, as a trained model's are (random ones are near-uniform)
    return from_pretrained(tiny_model_dir("llama", initializer_range=0.3), max_seq_len=16)


def drafter(kind: str, target: Transformer):
    """A drafter of `kind` whose draft distributions are near the target's but not equal to them."""
    torch.manual_seed(0)
    if kind == "lm":  # the target's own layers, perturbed
        return LMDrafter(perturbed(build_lm(target, target.config.n_layers, "target"), 0.02), 16)
    if kind == "eagle":
        return EagleDrafter(perturbed(build_eagle(target, None), 0.05), 16)
    return MedusaDrafter(perturbed(build_medusa(target, num_heads=2, keep_ids=None), 0.05))


def generate_counts(target: Transformer, kind: str) -> tuple[Counter, float]:
    """Counts of the first three tokens over TRIALS generations of LENGTH, and the mean tokens per target forward."""
    cfg = EngineConfig(max_seq_len=16, budget=BUDGET, adaptive=False)
    engine = Engine(target, drafter(kind, target), cfg)
    gen = torch.Generator().manual_seed(0)
    counts, tau = Counter(), 0.0
    for _ in range(TRIALS):
        out = engine.generate(PROMPT, LENGTH, PARAMS, gen)
        counts[tuple(out.tokens[:3])] += 1
        tau += out.metrics.tau / TRIALS
    return counts, tau


@pytest.mark.parametrize("kind", ["lm", "eagle", "medusa"])
def test_speculative_sampling_keeps_the_target_distribution(target, kind):
    counts, tau = generate_counts(target, kind)
    # drafts were rejected (each rejection samples the residual of the draft's q), and for lm and EAGLE also
    # accepted; untrained Medusa heads guess tokens ahead of the target and are almost never right
    assert (1.0 if kind == "medusa" else 1.05) <= tau < 1.9, tau  # 2.0: every draft accepted
    assert_three_tokens_follow_the_target(target, PROMPT, PARAMS, counts, TRIALS)


def _reject_without_residual(p, q, x):
    """WRONG: after a rejection, samples from p without x instead of the residual norm(max(0, p - q))."""
    _, q = _reject(p, q, x)
    rest = p.clone()
    rest[x] = 0.0
    return rest / rest.sum(), q


_reject = verify_module._reject


def _accept_every_draft(tree, logits, params, generator=None):
    """WRONG: keeps each row's first draft down to a leaf, then samples the target there."""
    children, path, row = tree.children(), [], 0
    while children[row]:
        path.append(children[row][0])
        row = path[-1] + 1
    return Verdict(path, int(sample(warp(logits[row], params), generator)))


@pytest.mark.parametrize("wrong", ["no residual", "accepts every draft"])
def test_a_wrong_engine_fails_the_same_test(target, monkeypatch, wrong):
    if wrong == "no residual":
        monkeypatch.setattr(verify_module, "_reject", _reject_without_residual)
    else:
        monkeypatch.setattr(engine_module, "verify", _accept_every_draft)
    counts, _ = generate_counts(target, "lm")
    with pytest.raises(AssertionError):
        assert_three_tokens_follow_the_target(target, PROMPT, PARAMS, counts, TRIALS)
