"""The GPU benchmark's parts that run on CPU too: the replay drafter and the static-shape decode step that CUDA
graphs capture (run eagerly here), both checked token for token against our engine's plain decoding."""
import pytest
import torch

from runtime.cuda_graphs import GraphedGreedyDecoder
from runtime.engine import Engine, EngineConfig
from runtime.gpu_bench import random_models, random_prompts, run_random_bench
from runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def smollm2_shape():
    return random_models("smollm2-135m", torch.float32, "cpu", max_seq_len=128, with_hf=False)[0]


def test_static_decode_step_equals_the_engine(smollm2_shape):
    model = smollm2_shape
    engine = Engine(model, None, EngineConfig(max_seq_len=128, adaptive=False))
    decoder = GraphedGreedyDecoder(model, max_len=128, use_graph=False)
    for prompt in random_prompts(model.config.vocab_size, 2, seed=3):
        expected = engine.generate(prompt, 16, SamplingParams(), stop_ids=()).tokens
        assert decoder.generate(prompt, 16) == expected


def test_graphs_need_a_cuda_model(smollm2_shape):
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        GraphedGreedyDecoder(smollm2_shape, max_len=64)


@pytest.mark.slow
@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_replayed_acceptance_is_lossless_and_sets_the_forward_count(rate):
    n = 12
    report = run_random_bench("smollm2-135m", n_prompts=2, max_new_tokens=n, dtype=torch.float32, device="cpu",
                              accept_rate=rate, graphs=False, print_table=False)
    m = report["methods"]
    assert m["ours_spec"]["matching_prefix_min"] == n and m["hf_generate"]["matching_prefix_min"] == n
    assert m["ours_ar"]["tau"] == 1.0
    if rate == 0.0:  # every draft rejected: one token per target forward, exactly as plain decoding
        assert m["ours_spec"]["tau"] == 1.0
    else:  # every draft accepted: a depth-5 chain and its bonus token per forward (11 tokens after prefill: 6 + 5)
        assert m["ours_spec"]["tau"] == 5.5
