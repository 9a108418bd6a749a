"""The stages load the target lean (one packed copy of each block weight), and what they compute is what the plain
target computes: the same logits and greedy tokens, the same regenerated rows and features, the same initial
drafters."""
import json

import pytest
import torch
from safetensors.torch import load as load_tensors

import runtime.target.loading as loading
from pipeline.config import Config
from pipeline.runstore import RunStore
from pipeline.stages.context import StageContext
from pipeline.stages.prepare import run_prepare
from runtime.speculation.engine import Engine, EngineConfig
from runtime.speculation.sampling import SamplingParams
from runtime.target import cpu_packing
from runtime.target.cpu_packing import Packable
from runtime.target.loading import from_pretrained
from support.helpers import run_stage_on
from train.data import TokenizedSet
from train.recipes import get_recipe
from train.shards import FEATURES_DIR


def stage_context(tmp_path, target_dir, **sections) -> StageContext:
    ctx = StageContext(Config.model_validate(sections), RunStore(tmp_path / "runs", "r"), tmp_path / "out")
    ctx.__dict__["target_dir"] = target_dir  # the cached_property, without resolving a preset
    return ctx


def block_linears(target, i: int) -> list[Packable]:
    return [m for m in target.layers[i].modules() if isinstance(m, Packable)]


def greedy(target, prompt: list[int], n: int) -> list[int]:
    engine = Engine(target, None, EngineConfig(max_seq_len=target.max_seq_len))
    return engine.generate(prompt, n, SamplingParams()).tokens


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_stage_loads_the_target_lean_and_it_computes_what_the_plain_one_does(tmp_path, tiny_llama_dir, precision):
    ctx = stage_context(tmp_path, tiny_llama_dir)
    lean = ctx.load_target(max_seq_len=128, precision=precision)
    plain = from_pretrained(tiny_llama_dir, dtype=lean.dtype, max_seq_len=128)
    # where oneDNN cannot pack the dtype (bf16 without AVX-512) nothing is packed: the plain weight is the one copy
    packs = cpu_packing.onednn_packs(lean.dtype)
    assert all(m.lean == packs and (packs or m.packed is None) for i in range(lean.config.n_layers)
               for m in block_linears(lean, i))
    assert not any(m.lean for i in range(plain.config.n_layers) for m in block_linears(plain, i))
    assert torch.equal(lean.output.weight_rows(), plain.output.weight)  # drafters read the head, exactly
    prompt = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(0))
    logits = [t(prompt[None], t.new_cache(1, 64), torch.arange(40)[None]).logits for t in (lean, plain)]
    torch.testing.assert_close(*logits, atol=1e-4 if precision == "fp32" else 2e-2, rtol=0)
    assert greedy(lean, prompt.tolist(), 24) == greedy(plain, prompt.tolist(), 24)


def test_plain_blocks_keep_their_weights_beside_the_lean_rest(tmp_path, tiny_llama_dir):
    lean = stage_context(tmp_path, tiny_llama_dir).load_target(max_seq_len=64, plain_blocks=(1,))
    plain = from_pretrained(tiny_llama_dir, max_seq_len=64)
    assert all(m.lean for m in block_linears(lean, 0)) and not any(m.lean for m in block_linears(lean, 1))
    for name, w in plain.layers[1].state_dict().items():
        assert torch.equal(lean.layers[1].state_dict()[name], w), name


@pytest.mark.parametrize("kind, settings", [("eagle", {}), ("eagle3", {"aux_layers": [1, 2, 3]}),
                                            ("lm", {"lm_layers": 2}), ("medusa", {})])
def test_distill_builds_the_same_drafter_from_its_lean_target(tmp_path, tiny_model_dir, kind, settings):
    """distill loads the target lean but for the blocks its recipe's initialisation copies (Recipe.target_blocks):
    the untrained drafter equals the one built from the plain target."""
    target_dir = tiny_model_dir("llama", num_hidden_layers=4)
    cfg = Config.model_validate({"drafter": {"kind": kind, "draft_vocab": 0, **settings}})
    recipe, plain = get_recipe(kind), from_pretrained(target_dir, max_seq_len=64)
    keep = recipe.target_blocks(cfg.drafter, plain.config.n_layers)
    lean = stage_context(tmp_path, target_dir).load_target(max_seq_len=64, plain_blocks=keep)
    built = [recipe.build(t, cfg.drafter, cfg.distill, None).state_dict() for t in (lean, plain)]
    assert built[0].keys() == built[1].keys()
    for name, w in built[1].items():
        assert torch.equal(built[0][name], w), name


def chats(path, n: int = 12):
    """Conversations in the tiny chat target's words (w4 .. w95)."""
    g = torch.Generator().manual_seed(0)
    words = lambda k: " ".join(f"w{int(i)}" for i in torch.randint(4, 96, (k,), generator=g))  # noqa: E731
    path.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": words(6)},
                                                          {"from": "gpt", "value": words(4)}]}) + "\n"
                            for _ in range(n)))
    return path


def test_prepare_regenerates_and_caches_the_same_rows_lean_as_plain(tmp_path, tiny_chat_target, monkeypatch):
    cfg = Config.model_validate({"data": {"source": str(chats(tmp_path / "chats.jsonl")), "val_fraction": 0.25,
                                          "min_assistant_tokens": 1, "regenerate": True, "cache_hidden": True,
                                          "regen_max_new_tokens": 12, "max_length": 64, "precision": "fp32"},
                                 "drafter": {"kind": "eagle"}})
    loads, load = [], loading.from_pretrained

    def recorded(*args, lean: bool = False, **kwargs):
        loads.append(lean)
        return load(*args, lean=lean and not plain, **kwargs)

    monkeypatch.setattr(loading, "from_pretrained", recorded)
    rows = {}
    for plain in (False, True):
        store = RunStore(tmp_path / f"runs-{plain}", "r")
        run_stage_on(store, "prepare", cfg, tiny_chat_target, run_prepare)
        out = store.stage_dir("prepare")
        rows[plain] = [TokenizedSet.load(out / f"{split}.safetensors").input_ids for split in ("train", "val")] \
            + [f.read_bytes() for f in sorted((out / FEATURES_DIR).iterdir())]
    assert loads == [True, True]  # the stage asked for lean; the second run was made plain here
    assert len(rows[False]) == 4 and all(torch.equal(a, b) for a, b in zip(rows[False][:2], rows[True][:2]))
    # the cached features: byte for byte where lean and plain run one kernel (ours, on AMD CPUs); on Intel CPUs a
    # product of fewer than 4 rows runs MKL's on a plain weight and oneDNN's on a lean one, rounding apart
    for a, b in zip(rows[False][2:], rows[True][2:]):
        if cpu_packing.OWN_FP32_KERNEL:
            assert a == b
        else:
            torch.testing.assert_close(load_tensors(a)["features"], load_tensors(b)["features"], rtol=0, atol=2e-3)


@pytest.mark.slow
def test_on_smollm2_lean_regenerates_and_decodes_as_plain_and_as_hf(smollm2_dir, tmp_path):
    """The real target: prepare's regeneration (batched, greedy, with the features it caches) gives the same rows
    lean as plain, and lean greedy decoding is HF `generate`'s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.bench.harness import hf_generate
    from pipeline.tokens import encode, stop_ids
    from train.regenerate import RegenSettings, regenerate
    from train.shards import merge_shards

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    convs = [[{"role": "user", "content": q}, {"role": "assistant", "content": "..."}]
             for q in ("Write a Python function that reverses a string.", "Why is the sky blue?",
                       "List three prime numbers.", "What does a hash map do?")]
    settings = RegenSettings(max_length=160, max_new_tokens=24, min_assistant_tokens=1, batch_size=4,
                             params=SamplingParams(), keep_hidden=True, shard_rows=4)
    merged = {}
    for lean in (True, False):
        target = from_pretrained(smollm2_dir, max_seq_len=160, lean=lean)
        regenerate(target, tok, convs, tmp_path / str(lean), settings, stop_ids(tok))
        merged[lean] = merge_shards(tmp_path / str(lean))
        if lean:
            prompt = encode(tok, convs[0][0]["content"], True)
            ours = greedy(target, prompt, 24)
        del target
    (rows, features, _), (plain_rows, plain_features, _) = merged[True], merged[False]
    assert len(rows) == 4 and torch.equal(rows.input_ids, plain_rows.input_ids)
    torch.testing.assert_close(features, plain_features, atol=1e-3, rtol=0)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert ours == hf_generate(hf, prompt, 24, SamplingParams(), (), torch.Generator())
