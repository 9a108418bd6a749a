"""Greedy speculation through a quantised KV cache (EngineConfig.kv_scheme, runtime.target.quant_kv_cache) gives the
tokens of plain greedy decoding through the same scheme, with drafters that keep a KV cache of their own (EAGLE, and an
LM drafter; the engine stores their caches in the same scheme) and drafters that keep none (n-gram, and an oracle
proposing the reference continuation among wrong tokens).

The target's next-token choices are close enough that the scheme changes its greedy output, so a verify that read
the history as plain decoding would not (a tree reaching past the next quantisation boundary) changes the tokens.
The LM drafter is a copy of the target and the oracle knows the answer, so their trees are deep and accepted."""
from __future__ import annotations

import pytest
import torch
from support.helpers import NoisyOracle, perturbed

from runtime.drafters.lm import LMDrafter
from runtime.drafters.ngram import NgramDrafter
from runtime.drafters.shared.eagle_drafting import EagleDrafter
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.engine import Engine, EngineConfig
from runtime.target.loading import from_pretrained
from runtime.target.model import Transformer
from runtime.target.quant_kv_cache import SCHEMES, QuantizedKVCache
from train.recipes.eagle import build_eagle
from train.recipes.lm import build_lm

PROMPT = [5, 17, 33, 5, 17, 42, 8, 5, 17, 33, 61, 2, 9]
NEW_TOKENS = 60
RECENT = 4  # few exact tokens: most of the history is read back from its codes


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A tiny model gains nothing from a thread pool, and on a busy host loses much to it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return from_pretrained(tiny_model_dir("llama", tie_word_embeddings=True, initializer_range=0.15),
                                       max_seq_len=128)


def config(scheme: str | None) -> EngineConfig:
    return EngineConfig(max_seq_len=128, budget=DraftBudget(depth=4, width=2, nodes=8), adaptive=False,
                        kv_scheme=scheme, kv_recent=RECENT)


def drafter(kind: str, target: Transformer, reference: list[int]):
    if kind == "ngram":
        return NgramDrafter(target.config.vocab_size)
    if kind == "oracle":
        return NoisyOracle(target.config.vocab_size, reference, p_right=0.8, width=2, seed=0)
    if kind == "lm":
        return LMDrafter(build_lm(target, target.config.n_layers, "target").eval(), 128)
    eagle = perturbed(build_eagle(target, None))  # off the pass-through init, so tokens and context matter
    return EagleDrafter(eagle.requires_grad_(False), 128)


@pytest.fixture(scope="module")
def plain(target) -> dict[str | None, list[int]]:
    """Plain greedy decoding's tokens through each scheme (None: full precision)."""
    return {s: Engine(target, None, config(s)).generate(PROMPT, NEW_TOKENS).tokens for s in (None, *SCHEMES)}


def test_each_scheme_changes_the_targets_greedy_output(plain):
    """What makes the tests below sensitive: a history read at another precision gives other tokens."""
    assert all(plain[s] != plain[None] for s in SCHEMES)


@pytest.mark.parametrize("kind", ["eagle", "lm", "ngram", "oracle"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_speculation_through_a_quantised_kv_cache_is_greedy_decoding_through_it(target, plain, scheme, kind):
    engine = Engine(target, drafter(kind, target, PROMPT + plain[scheme]), config(scheme))
    spec = engine.generate(PROMPT, NEW_TOKENS)
    assert spec.tokens == plain[scheme]
    assert spec.metrics.target_forwards < NEW_TOKENS - 1  # trees were accepted, not only rejected
    assert isinstance(engine.cache, QuantizedKVCache) and engine.cache.quantized > len(PROMPT)
    if kind in ("eagle", "lm"):  # its own cache in the same scheme, read as a drafter reads it
        cache = engine.drafter.cache
        assert isinstance(cache, QuantizedKVCache) and cache.quant.scheme == scheme and cache.quantized > 0
        assert cache.quant.reader == "draft"
