"""The static steps fused by torch.compile (EngineConfig.compile_static, runtime.speculation.cuda_graphs.compile_step),
here through inductor's CPU backend, eagerly: the same tokens as the uncompiled static steps, and a compiled graph
for each of the decode, verify and chain steps (not a silent fall-back to eager)."""
import pytest
import torch
from torch._dynamo.utils import counters

from pipeline.bench.graphed_decoder import GraphedGreedyDecoder
from runtime.drafters.shared.eagle_drafting import EagleDrafter
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.engine import Engine, EngineConfig
from runtime.speculation.sampling import SamplingParams
from runtime.target import cpu_packing
from runtime.target.loading import from_pretrained
from support.helpers import perturbed
from train.recipes.eagle import build_eagle


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return from_pretrained(tiny_llama_dir, max_seq_len=128)


def compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_compiled_decode_step_decodes_as_the_engine(target, min_span):
    prompt = torch.randint(0, target.config.vocab_size, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    expected = Engine(target, None, EngineConfig(max_seq_len=128, adaptive=False)).generate(prompt, 60).tokens
    before = compiled_graphs()
    decoder = GraphedGreedyDecoder(target, max_len=128, use_graph=False, compile=True)
    assert decoder.generate(prompt, 60) == expected
    spans = 1 if min_span > 128 else 3  # 32, 64 and 128 keys where spans switch
    assert before < compiled_graphs() <= before + spans  # at most a graph per span, not one per token


def repack(model: torch.nn.Module) -> list[cpu_packing.Packable]:
    """Pack again every packed weight of `model`, as cpu_packing's settings say now; returns them."""
    packed = [m for m in model.modules() if isinstance(m, cpu_packing.Packable) and m.packed is not None]
    for m in packed:
        m.pack()
    return packed


@pytest.fixture(params=["as-packed-here", "onednn-prepacked"])
def packing(request, monkeypatch, target):
    """How the weights run: as this CPU packs them, or prepacked for oneDNN from one row on, as fp32 products run
    on CPUs where our own kernel does not serve them, and bf16 ones on CPUs with AMX."""
    if request.param == "onednn-prepacked":
        if not cpu_packing.onednn_packs(torch.float32):
            pytest.skip("oneDNN cannot prepack fp32 weights in this torch build")
        monkeypatch.setattr(cpu_packing, "OWN_FP32_KERNEL", False)
        monkeypatch.setattr(cpu_packing, "PACKED_MIN_FP32_ROWS", 1)
        packed = repack(target)
        assert packed and not any(m.own_fp32 for m in packed)  # every product of >= 1 row goes to oneDNN
        yield request.param
        monkeypatch.undo()
        repack(target)
    else:
        yield request.param


def test_compiled_static_verify_and_drafting_generate_the_same(target, packing):
    torch.manual_seed(0)
    eagle = perturbed(build_eagle(target, None, from_target=False), scale=0.1).requires_grad_(False)
    prompt = torch.randint(0, target.config.vocab_size, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    cfg = EngineConfig(max_seq_len=128, budget=DraftBudget(3, 2, 5), adaptive=False, static_verify=True)
    plain = Engine(target, EagleDrafter(eagle, 128), cfg).generate(prompt, 40, SamplingParams())
    # a fresh compile: where this CPU already packs for oneDNN (Intel), the other packing's graphs would pass its guards
    torch._dynamo.reset()
    before = compiled_graphs()
    engine = Engine(target, EagleDrafter(eagle, 128), EngineConfig(**{**cfg.__dict__, "compile_static": True}))
    fused = engine.generate(prompt, 40, SamplingParams())
    assert fused.tokens == plain.tokens
    assert fused.metrics.target_forwards == plain.metrics.target_forwards
    # the verify of root + 5 nodes (bucket 8) and the tree of each pending bucket
    assert compiled_graphs() >= before + 2


def test_compile_static_needs_static_verify():
    with pytest.raises(ValueError, match="compile_static .* needs static_verify=True"):
        EngineConfig(compile_static=True)
