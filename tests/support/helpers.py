"""Helpers shared by several test modules (imported as `support.helpers`)."""
from __future__ import annotations

import inspect
import math
import os
import random
import subprocess
import sys
from typing import Callable

import torch

from pipeline.runstore import RunStore
from pipeline.stages.context import StageContext
from runtime.speculation.drafter import Drafter
from runtime.speculation.engine import Engine, EngineConfig
from runtime.speculation.sampling import SamplingParams
from runtime.speculation.tree import DraftTree
from runtime.target.model import Transformer
from train.data import TokenizedSet


def self_distilled_rows(target: Transformer, rows: int, prompt_vocab: int, new_tokens: int,
                        max_seq_len: int = 256) -> TokenizedSet:
    """The target's own greedy continuations of random 6-token prompts, loss on the continuation: what
    regeneration gives a real drafter."""
    engine = Engine(target, None, EngineConfig(max_seq_len=max_seq_len))
    g = torch.Generator().manual_seed(0)
    out_rows = []
    for _ in range(rows):
        prompt = torch.randint(0, prompt_vocab, (6,), generator=g).tolist()
        out = engine.generate(prompt, new_tokens, SamplingParams()).tokens
        out_rows.append((prompt + out, [0] * len(prompt) + [1] * len(out)))
    return TokenizedSet.from_rows(out_rows)


def perturbed(module: torch.nn.Module, scale: float = 0.05, seed: int = 0) -> torch.nn.Module:
    """`module` with Gaussian noise added to every weight, in eval mode: breaks identity-like initialisations so every
    weight shows in the outputs, and makes a drafter near a model but not equal to it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return module.eval()


def run_stage_on(store: RunStore, stage: str, cfg, target_dir, fn) -> dict:
    """A stage's function run atomically in `store` against `target_dir` (no preset resolution); stage.json."""
    def body(out):
        ctx = StageContext(cfg, store, out, f"digest-{stage}")
        ctx.__dict__["target_dir"] = target_dir  # the cached_property, without resolving a preset
        return fn(ctx)
    return store.run_stage(stage, f"digest-{stage}", body)


def run_in_triton_interpreter(check: Callable[..., None], *args: str) -> None:
    """Run `check(*args)`, a module-level function of a test module, in a fresh Python with TRITON_INTERPRET=1.

    Triton chooses interpreter or compiler when a function is decorated -- its own library (tl.sum, tl.zeros)
    included, at `import triton` -- so the variable only works if set before anything imports triton, which
    this pytest process cannot promise."""
    path = inspect.getfile(check)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where `support` imports from
    code = (f"import sys; sys.path[:0] = [{os.path.dirname(path)!r}, {tests!r}]; import importlib.util as u; "
            f"s = u.spec_from_file_location('checks', {path!r}); m = u.module_from_spec(s); s.loader.exec_module(m); "
            f"m.{check.__name__}(*{args!r})")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def chi_square_critical(df: int, z: float = 4.7534) -> float:
    """Chi-square quantile at 1 - 1e-6 (z = its normal quantile) by Wilson-Hilferty; scipy is not a dependency.
    It overestimates the exact quantile by 15% at df 1 down to 0.6% at df 35 (37.5 vs 35.9 at df 5), i.e. errs
    towards passing a correct verifier; the wrong verifiers the tests build exceed it several times over."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic, cells with expected count < 5 pooled; a count in a zero-probability cell is a failure."""
    counts, probs = counts.double(), probs.double()
    assert counts[probs == 0].sum() == 0, "emitted a token the warped target gives probability 0"
    expected = counts.sum() * probs
    small = (expected < 5) & (probs > 0)
    big = expected >= 5
    obs, exp = counts[big], expected[big]
    if small.any():
        obs = torch.cat([obs, counts[small].sum()[None]])
        exp = torch.cat([exp, expected[small].sum()[None]])
    return float(((obs - exp) ** 2 / exp).sum()), obs.numel() - 1


def assert_first_tokens_match(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """counts and expected joint probabilities of the first L emitted tokens ([choices] * L): the first token, the
    first two, ... all L each pass a chi-square test at alpha 1e-6."""
    for n in range(1, counts.dim() + 1):
        rest = tuple(range(n, counts.dim()))
        stat, df = chi_square(counts.sum(rest).flatten() if rest else counts.flatten(),
                              expected.sum(rest).flatten() if rest else expected.flatten())
        critical = chi_square_critical(df)
        assert stat < critical, f"first {n} tokens: chi2 {stat:.1f} with df {df} (critical {critical:.1f})"


class NoisyOracle(Drafter):
    """Knows the target's greedy continuation and proposes trees mixing it with wrong tokens, so steps accept
    some nodes and reject others. Checks the engine's token/feature bookkeeping as it goes."""

    needs_features = True

    def __init__(self, vocab_size: int, reference: list[int], p_right: float, width: int, seed: int):
        self.vocab_size, self.reference, self.p_right, self.width = vocab_size, reference, p_right, width
        self.rng = random.Random(seed)
        self.tokens: list[int] = []
        self.features: list[torch.Tensor] = []

    def reset(self, tokens, features):
        assert features.shape[0] == tokens.numel() - 1
        self.tokens, self.features = tokens.tolist(), [features]

    def commit(self, tokens, features):
        assert features.shape[0] == tokens.numel()
        self.tokens += tokens.tolist()
        self.features.append(features)

    def propose(self, budget, params, generator=None):
        tokens, parents = [], []
        parent, on_track = -1, True
        for depth in range(budget.depth):
            pos = len(self.tokens) + depth
            right = self.reference[pos] if on_track and pos < len(self.reference) else None
            wrong = [t for t in self.rng.sample(range(self.vocab_size), self.width + 1) if t != right]
            kids = wrong[:self.width]
            if right is not None and self.rng.random() < self.p_right:
                kids[self.rng.randrange(self.width)] = right
            kids = kids[:budget.max_nodes - len(tokens)]
            if not kids:
                break
            first = len(tokens)
            tokens += kids
            parents += [parent] * len(kids)
            on_track = right in kids
            parent = first + (kids.index(right) if on_track else 0)
        return DraftTree(torch.tensor(tokens), torch.tensor(parents))


def assert_three_tokens_follow_the_target(target, prompt: list[int], params, counts: dict, n: int) -> None:
    """`counts` of the first three tokens after `prompt` over n samples against the target's exact joint
    probabilities under `params` (chi-square, about 5 standard deviations)."""
    from runtime.speculation.sampling import warp

    def probs(seq):
        with torch.no_grad():
            logits = target(torch.tensor([seq]), target.new_cache(), torch.arange(len(seq))[None]).logits
        return warp(logits[0, -1], params)

    exact = {}
    p1 = probs(prompt)
    for a in p1.nonzero().flatten().tolist():
        p2 = probs(prompt + [a])
        for b in p2.nonzero().flatten().tolist():
            p3 = probs(prompt + [a, b])
            for c in p3.nonzero().flatten().tolist():
                exact[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    assert set(counts) <= set(exact)
    chi2 = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in exact.items())
    dof = len(exact) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof)


def run_concurrently(call, n: int, timeout_s: float) -> tuple[dict, list]:
    """call(0) ... call(n - 1), each on its own thread, all at once: ({i: what call(i) returned}, [what raised])."""
    import threading
    answers, errors = {}, []

    def run(i):
        try:
            answers[i] = call(i)
        except Exception as e:  # noqa: BLE001 - the caller checks them
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    return answers, errors
