"""The Qwen2 family: a tiny random Qwen2 through GGUF conversion, our forward and speculation (fast), and the real
Qwen2.5-Coder-0.5B preset against HF transformers (slow; the wheels are cached after the first run)."""
import gc
import json

import pytest
import torch

from pipeline.gguf import gguf_to_hf
from pipeline.sources import resolve_target
from runtime.drafters.ngram import NgramDrafter
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.engine import Engine, EngineConfig
from runtime.target.loading import from_pretrained

CODE_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"


@pytest.fixture(scope="module")
def converted(tiny_qwen2_dir, tmp_path_factory):
    """The tiny Qwen2 through a GGUF and back: what a preset's conversion does, on a file made here."""
    from conftest import save_tiny_gguf

    tmp = tmp_path_factory.mktemp("tiny-qwen2-gguf")
    return gguf_to_hf(save_tiny_gguf(tiny_qwen2_dir, tmp / "tiny.gguf"), tmp / "hf")


def test_tiny_qwen2_gguf_converts_to_the_checkpoint_it_came_from(tiny_qwen2_dir, converted):
    from safetensors.torch import load_file

    config = json.loads((converted / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["tie_word_embeddings"]) == \
        ("qwen2", ["Qwen2ForCausalLM"], True)
    assert config["num_key_value_heads"] == 2 and resolve_target(str(converted)) == converted
    ours, original = load_file(str(converted / "model.safetensors")), load_file(str(tiny_qwen2_dir / "model.safetensors"))
    assert ours.keys() == original.keys() and "lm_head.weight" not in ours  # the tied head is stored once
    assert all(torch.equal(ours[k], original[k]) for k in ours)  # F32 in, F32 out: bit for bit
    assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.v_proj.bias"} <= ours.keys()


def test_conversion_writes_shards_with_an_index_past_the_shard_size(tiny_qwen2_dir, tmp_path, monkeypatch):
    from conftest import save_tiny_gguf
    from pipeline import gguf

    monkeypatch.setattr(gguf, "SHARD_BYTES", 64 << 10)
    out = gguf_to_hf(save_tiny_gguf(tiny_qwen2_dir, tmp_path / "tiny.gguf"), tmp_path / "hf")
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(shards) > 1 and sorted(set(index.values())) == shards
    model, ids = from_pretrained(out, max_seq_len=16), torch.arange(10)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids, model.new_cache(), ids).logits, hf_model(out)(ids).logits)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def test_tiny_qwen2_forward_equals_transformers(converted):
    model = from_pretrained(converted, max_seq_len=64)
    assert model.output.weight is model.tok_embeddings.weight  # the tied head: one table
    assert model.config.qkv_bias and not model.config.o_bias and model.config.n_kv_heads == 2
    assert model.layers[0].attention.wqkv.bias is not None
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(3))
    cache = model.new_cache(batch=2)
    logits = model(ids, cache, cache.lengths[:, None] + torch.arange(20)).logits
    torch.testing.assert_close(logits, hf_model(converted)(ids).logits, atol=2e-5, rtol=1e-4)


@torch.no_grad()
def test_tiny_qwen2_ngram_speculation_is_greedy_decoding(converted):
    model = from_pretrained(converted, max_seq_len=128)
    prompt = [5, 17, 33, 5, 17, 42, 8, 5, 17, 33, 61, 2, 9]
    hf, seq = hf_model(converted), list(prompt)
    for _ in range(40):  # HF's greedy continuation, one full forward per token
        seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    want = seq[len(prompt):]
    assert Engine(model, None, EngineConfig(max_seq_len=128)).generate(prompt, 40).tokens == want
    for budget in (DraftBudget(depth=4), DraftBudget(depth=3, width=2, nodes=5)):
        engine = Engine(model, NgramDrafter(model.config.vocab_size),
                        EngineConfig(max_seq_len=128, budget=budget, adaptive=False))
        gen = engine.generate(prompt, 40)
        assert gen.tokens == want
        assert gen.metrics.target_forwards < 39  # drafts were accepted: the verify path ran, not only decode


@pytest.mark.slow
@torch.no_grad()
def test_qwen_coder_05b_preset_matches_transformers():
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d = resolve_target("qwen2.5-coder-0.5b-instruct")
    cfg = AutoConfig.from_pretrained(d)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("qwen2", 24, 896, 151936)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (14, 2)
    tok = AutoTokenizer.from_pretrained(d)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = torch.tensor([tok(CODE_PROMPT).input_ids])
    n = ids.shape[1]

    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ref = hf(ids).logits
    del hf  # one fp32 copy of the weights at a time
    gc.collect()

    model = from_pretrained(d, max_seq_len=64)
    assert model.config.qkv_bias and not model.config.o_bias
    cache = model.new_cache()
    prefill = model(ids[:, :n - 4], cache, torch.arange(n - 4)[None]).logits
    cache.advance(n - 4)
    steps = [prefill]
    for t in range(n - 4, n):  # then one token at a time through the cache
        steps.append(model(ids[:, t:t + 1], cache, torch.tensor([[t]])).logits)
        cache.advance(1)
    ours = torch.cat(steps, 1)
    print(f"max |ours - hf| = {(ours - ref).abs().max():.2e}, max |hf| = {ref.abs().max():.1f}")
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_a_preset_as_lm_base_resolves_to_its_converted_directory(tmp_path):
    from types import SimpleNamespace

    from pipeline.config import load_config
    from pipeline.stages.distill import recipe_settings

    cfg = load_config(overrides=["target=qwen2.5-coder-1.5b-instruct", "drafter.kind=lm",
                                 "drafter.lm_base=qwen2.5-coder-0.5b-instruct"])
    settings = recipe_settings(SimpleNamespace(cfg=cfg))
    assert settings.lm_base == str(resolve_target("qwen2.5-coder-0.5b-instruct"))
