"""Long prompts: causal attention without a mask, the chunked prefill, its products, and prompts beyond the context."""
from __future__ import annotations

import pytest
import torch

from pipeline.errors import DraftsmithError
from runtime.speculation.engine import Engine, EngineConfig
from runtime.target.attention import BACKENDS, Causal, attention_mask, causal_mask
from runtime.target.cpu_packing import Linear, prefill_products
from runtime.target.loading import from_pretrained
from runtime.target.model_config import context_error


@pytest.mark.parametrize("prefix", [0, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()  # inference: what takes the maskless path
def test_causal_attention_equals_the_masked_one(prefix, dtype, monkeypatch):
    """Causal(prefix) through the flash kernel (two calls merged by log-sum-exp after a prefix) gives what the
    materialised mask gives, grouped-query heads included."""
    from runtime.target.attention import sdpa as sdpa_module

    flash_calls = []
    causal = sdpa_module.causal_attention
    monkeypatch.setattr(sdpa_module, "causal_attention", lambda *a: flash_calls.append(a[-1]) or causal(*a))
    gen = torch.Generator().manual_seed(0)
    T, S = 13, prefix + 13
    q = torch.randn(1, 4, T, 16, generator=gen).to(dtype)
    keys, values = (torch.randn(1, 2, S, 16, generator=gen).to(dtype) for _ in range(2))
    sdpa = BACKENDS["sdpa"]
    dense = Causal(prefix).dense(1, T, q.device)
    assert dense.shape == (1, 1, T, S) and dense[0, 0, 0].sum() == prefix + 1 and dense[0, 0, -1].all()
    got = sdpa(q, keys, values, Causal(prefix), None)
    want = sdpa(q.float(), keys.float(), values.float(), dense, None)
    tol = {"atol": 2e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), want, **tol)
    assert flash_calls == [prefix]


def test_causal_mask_only_where_the_batch_allows_it():
    same, ragged = torch.tensor([5, 5]), torch.tensor([3, 5])
    assert causal_mask(same, 4, 9, None) == Causal(5)
    assert causal_mask(torch.tensor([0]), 7, 7, None) == Causal(0)
    assert causal_mask(same, 1, 6, None) is None  # a decode step: no mask at all (or attention_mask's)
    assert causal_mask(ragged, 4, 9, None) is None  # rows at other lengths: the explicit mask
    assert causal_mask(same, 4, 9, torch.ones(4, 4, dtype=torch.bool).tril()) is None  # a tree
    assert causal_mask(same, 4, 9, None, window=8) is None and causal_mask(same, 4, 9, None, window=9) == Causal(5)
    mask = attention_mask(same, same[:, None] + torch.arange(4), 9, None)
    assert torch.equal(mask, Causal(5).dense(2, 4, mask.device))


@pytest.mark.parametrize("chunk", [5, 16, 1000])
@torch.no_grad()
def test_prefill_in_chunks_gives_the_logits_hidden_states_and_cache_of_one_forward(tiny_model_dir, chunk):
    import transformers

    path = tiny_model_dir("qwen2")
    ids = torch.randint(0, 96, (1, 37), generator=torch.Generator().manual_seed(1))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = hf(ids, output_hidden_states=True)
    model = from_pretrained(path, max_seq_len=64)
    cache = model.new_cache()
    logits, hidden = model.prefill(ids, cache, chunk=chunk)
    assert int(cache.lengths[0]) == 37 and logits.shape == (1, 1, 96) and hidden.shape == (1, 37, 64)
    torch.testing.assert_close(logits[0, -1], ref.logits[0, -1], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(hidden, ref.hidden_states[-1], atol=2e-5, rtol=1e-4)
    whole = model.new_cache()
    model(ids, whole, torch.arange(37)[None])  # one forward
    lean = model.new_cache()  # without hidden states the last layer only writes the others' keys and values
    lean_logits, none = model.prefill(ids, lean, chunk=chunk, features=None)
    assert none is None
    torch.testing.assert_close(lean_logits, logits, atol=2e-5, rtol=1e-4)
    for c in (cache, lean):
        torch.testing.assert_close(c.k[:, :, :, :37], whole.k[:, :, :, :37], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(c.v[:, :, :, :37], whole.v[:, :, :, :37], atol=2e-5, rtol=1e-4)
    # after a cached prefix, a batch of two sequences at different lengths (the explicit mask)
    batch = model.new_cache(batch=2)
    model(ids[:, :5].expand(2, 5), batch, torch.arange(5).expand(2, 5))
    batch.advance(torch.tensor([3, 5]))
    more = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(2))
    logits, _ = model.prefill(more, batch, chunk=chunk, features=None)
    for b, n in enumerate((3, 5)):
        seq = torch.cat([ids[0, :n], more[b]])[None]
        torch.testing.assert_close(logits[b, -1], hf(seq).logits[0, -1], atol=2e-5, rtol=1e-4)


def test_prefill_refuses_a_prompt_beyond_the_cache_before_any_forward(tiny_llama_dir):
    model = from_pretrained(tiny_llama_dir, max_seq_len=32)
    cache = model.new_cache(max_len=16)
    with pytest.raises(ValueError, match="a prompt of 17 tokens after 0 cached ones exceeds the cache length 16"):
        model.prefill(torch.zeros(1, 17, dtype=torch.long), cache)
    assert int(cache.lengths[0]) == 0


def test_prefill_products_take_the_fastest_kernel_and_verify_products_stay_exact(monkeypatch):
    """Outside a prefill a bf16 product goes in slices of 8 to 32 rows, a shorter one padded (each row its one-row
    result); inside it goes whole. fp32 on our kernel: up to 256 rows outside, up to 64 inside."""
    calls = []
    monkeypatch.setattr(Linear, "_packed", lambda self, x, bias: calls.append(x.shape[-2] if x.dim() > 1 else 1)
                        or torch.nn.functional.linear(x, self.weight, bias))
    linear = Linear(8, 4).to(torch.bfloat16).requires_grad_(False)
    linear.packed = torch.empty(0, dtype=torch.bfloat16)  # stands in for oneDNN's prepacked copy
    x = torch.randn(70, 8, dtype=torch.bfloat16)
    linear(x)
    assert calls == [32, 32, 8]
    calls.clear()
    with prefill_products():
        linear(x)
    assert calls == [70]
    calls.clear()
    linear(x)
    assert calls == [32, 32, 8]  # the context is left as it was found

    from kernels import cpu_gemm
    if not cpu_gemm.available():
        pytest.skip("kernels/cpu_gemm does not build here")
    own = []
    small = cpu_gemm.small_linear
    monkeypatch.setattr(cpu_gemm, "small_linear", lambda x, *a: own.append(x.shape[0]) or small(x, *a))
    monkeypatch.setattr("runtime.target.cpu_packing.OWN_FP32_KERNEL", True)
    wide = Linear(8, 4).requires_grad_(False)
    wide.pack()
    calls.clear()
    for rows in (64, 100):
        wide(torch.randn(rows, 8))
        with prefill_products():
            wide(torch.randn(rows, 8))
    assert own == [64, 64, 100] and calls == [100]


@torch.no_grad()
def test_a_chunked_prefill_keeps_speculation_lossless(tiny_llama_dir, monkeypatch):
    from runtime.drafters.ngram import NgramDrafter

    monkeypatch.setattr("runtime.target.model.PREFILL_CHUNK", 4)
    target = from_pretrained(tiny_llama_dir, max_seq_len=128)
    prompt = [5, 17, 33, 5, 17, 42, 8, 5, 17, 33, 61, 2, 9, 5, 17]
    seq = list(prompt)
    for _ in range(20):  # plain greedy decoding by whole forwards
        logits = target(torch.tensor([seq]), target.new_cache(), torch.arange(len(seq))[None]).logits
        seq.append(int(logits[0, -1].argmax()))
    cfg = EngineConfig(max_seq_len=64)
    ar = Engine(target, None, cfg).generate(prompt, 20)
    spec = Engine(target, NgramDrafter(96), cfg).generate(prompt, 20)
    assert ar.tokens == seq[len(prompt):] and spec.tokens == ar.tokens


def test_context_errors_name_the_length_and_the_limit():
    assert context_error(100, 28, 128, "x") is None
    assert context_error(100, 30, 128, "the model's context of max_position_embeddings") == (
        "prompt of 100 tokens + max_new_tokens=30 does not fit the model's context of max_position_embeddings=128")


def test_a_target_is_never_loaded_past_its_context(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_seq_len 257 exceeds the model's context of max_position_embeddings=256"):
        from_pretrained(tiny_llama_dir, max_seq_len=257)


def test_bench_context_lengths():
    from pipeline.bench.long_context import context_lengths

    assert context_lengths("1024, 2048,max", 8192, 128) == [1024, 2048, 8065]
    with pytest.raises(DraftsmithError, match="--context 9000: prompt of 9000 tokens \\+ max_new_tokens=128 does "
                                              "not fit the model's context of max_position_embeddings=8192"):
        context_lengths("1024,9000", 8192, 128)
    with pytest.raises(DraftsmithError, match="'2k' is not a length of at least 16 tokens or 'max'"):
        context_lengths("2k", 8192, 128)
