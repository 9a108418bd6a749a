"""The quantspec drafter: the target's quantised copy (int4 or int8) drafting for it (no training), lossless under
verification by the full-precision target, and its bundle, which holds the scheme and no weights."""
import json
from types import SimpleNamespace

import pytest
import torch

from export.bundle_writer import write_bundle
from pipeline.sources import target_fingerprint
from runtime.bundle_reader import BundleError, read_bundle
from runtime.drafters import build_drafter, get_kind
from runtime.drafters.quantspec import QuantSpecDrafter, shared_copy
from runtime.speculation.draft_budget import ServedBudget
from runtime.speculation.engine import Engine, EngineConfig
from runtime.speculation.sampling import SamplingParams
from runtime.target import quant_kv_cache
from runtime.target.attention import exact_dtype
from runtime.target.cpu_packing import Packable
from kernels.kv_quant import dequant_upper
from runtime.target.loading import from_pretrained
from kernels import dynamic_int8, int4_gemm
from runtime.target.quantized_copy import SCHEMES, QuantizedLinear, QuantizedTransformer, default_scheme, quantized_copy

VOCAB, MAX_LEN = 96, 256
KIND = get_kind("quantspec")


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir):
    # qwen2-shaped (q/k/v biases, 2 kv heads, tied head); a large init gives peaked distributions as a trained model's
    return tiny_model_dir("qwen2", tie_word_embeddings=True, initializer_range=0.3)


@pytest.fixture(scope="module")
def target(target_dir):
    return from_pretrained(target_dir, max_seq_len=MAX_LEN)


def prompts(n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (8,), generator=g).tolist() for _ in range(n)]


def within_half_a_step(q: QuantizedLinear, plain: torch.Tensor) -> bool:
    """Whether the copy's codes stand for the plain weight within half a quantisation step everywhere."""
    if len(parts := q.quantized()) == 2:  # int8: a scale per row
        codes, scales = parts
        return bool(((codes.float() * scales[:, None] - plain).abs() <= scales[:, None] / 2 + 1e-6).all())
    k = plain.shape[1]  # int4: groups along k, the last one padded with zero columns
    step = parts[1].float().repeat_interleave(parts[0].shape[1] // parts[1].shape[1], 1)[:, :k]
    return bool(((int4_gemm.dequantize(*parts)[:, :k] - plain).abs() <= step / 2 + 1e-3 * step).all())


@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
def test_the_copy_quantises_every_linear_layer_and_shares_the_rest(target, target_dir, monkeypatch, scheme):
    monkeypatch.setattr("runtime.target.quantized_copy.ROW_BLOCK", 16)  # every layer quantised in several slices
    copied = quantized_copy(target, scheme)
    linears = [m for m in target.modules() if isinstance(m, Packable)]
    quantized = [m for m in copied.modules() if isinstance(m, QuantizedLinear)]
    assert len(quantized) == len(linears) == 4 * target.config.n_layers + 1  # qkv, o, gate-up, down; the head
    assert copied.tok_embeddings is target.tok_embeddings and copied.layers[0].attention_norm is target.layers[0].attention_norm
    for plain, q in zip(linears, quantized):
        assert within_half_a_step(q, plain.weight)
        assert (q.bias is None) == (plain.bias is None)
    # a lean target keeps only our kernel's panels: the copy read from them is the same
    lean = from_pretrained(target_dir, max_seq_len=MAX_LEN, lean=True)
    assert lean.layers[0].feed_forward.w2.weight.is_meta
    for a, b in zip(quantized, (m for m in quantized_copy(lean, scheme).modules() if isinstance(m, QuantizedLinear))):
        assert all(torch.equal(x, y) for x, y in zip(a.quantized(), b.quantized()))


def test_the_int8_copy_s_logits_are_near_the_target_s(target):
    tokens = torch.tensor([prompts(1)[0]])
    full = target.forward_uncached(tokens).logits
    draft = shared_copy(target, "int8").forward_uncached(tokens).logits
    # inputs of 7 bits where the CPU lacks VNNI (dynamic_int8.reduce_range) take steps twice as coarse as 8 bits'
    tolerance = 0.2 if dynamic_int8.reduce_range() else 0.1
    assert (draft - full).abs().max() < tolerance * full.abs().max()
    assert (draft.argmax(-1) == full.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s != "int8"])
def test_an_int4_copy_computes_its_scheme_s_products(target, scheme, monkeypatch):
    """Through our kernel, the logits of plain torch over the dequantised weights and int8 rows (4 bits move this
    tiny random model's logits too far from the target's for closeness to it to say anything)."""
    tokens = torch.tensor([prompts(1)[0]])
    copied = shared_copy(target, scheme)
    kernel = copied.forward_uncached(tokens).logits
    monkeypatch.setattr(int4_gemm, "available", lambda: False)
    with pytest.warns(UserWarning, match="torch reference"):
        int4_gemm.warn_slow.cache_clear()
        reference = copied.forward_uncached(tokens).logits
    torch.testing.assert_close(kernel, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("budget,kv,scheme", [("4x1", None, "int8"), ("3x2/5", None, "int4-g32"),
                                               ("4x1", "hier-int4", "int4-g32")])
def test_speculation_with_it_is_plain_greedy_decoding(target, budget, kv, scheme):
    config = KIND.config(None, 0, SimpleNamespace(quant_weights=scheme))
    drafter = KIND.drafter(None, config, target, MAX_LEN, None)
    # one copy per target and scheme
    assert isinstance(drafter, QuantSpecDrafter) and drafter.model is shared_copy(target, scheme)
    fields = ServedBudget.parse(budget).engine_fields()
    kv_fields = {} if kv is None else {"kv_scheme": kv, "kv_recent": 8}
    plain = Engine(target, None, EngineConfig(max_seq_len=MAX_LEN, **kv_fields))
    spec = Engine(target, drafter, EngineConfig(max_seq_len=MAX_LEN, speed_check=False, **fields, **kv_fields))
    taus = []
    for p in prompts():
        out = spec.generate(p, 48)
        assert out.tokens == plain.generate(p, 48).tokens
        taus.append(out.metrics.tau)
    # the copy agrees with its target on most tokens (int8) or many (int4, on this tiny random model); a drafter
    # that never agreed would give 1
    assert sum(taus) / len(taus) > (2.0 if scheme == "int8" else 1.5)


def test_it_drafts_over_the_target_s_cache_and_never_runs_the_prompt(target, monkeypatch):
    """The prompt and the accepted tokens are in the target's cache already: each draft forward runs the root or the
    tree's nodes, at positions past the prompt; over a hierarchical int4 history it reads the upper plane. Its
    attention computes in its inputs' dtype, not exact_dtype's fp64 for bf16 (nothing compares a draft's bits)."""
    drafter = KIND.drafter(None, KIND.config(None, 0, SimpleNamespace(quant_weights="int8")), target, MAX_LEN, None)
    seen, forward = [], QuantizedTransformer.forward

    def recorded(self, tokens, cache, positions, *args, **kwargs):
        seen.append((tokens.shape[1], int(positions.min()), exact_dtype(torch.zeros(1, dtype=torch.bfloat16))))
        return forward(self, tokens, cache, positions, *args, **kwargs)

    monkeypatch.setattr(QuantizedTransformer, "forward", recorded)
    upper = []
    monkeypatch.setattr(quant_kv_cache, "dequant_upper", lambda *planes: upper.append(1) or dequant_upper(*planes))
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    fields = ServedBudget.parse("4x1").engine_fields()
    for kv in ({}, {"kv_scheme": "hier-int4", "kv_recent": 8}):
        spec = Engine(target, drafter, EngineConfig(max_seq_len=MAX_LEN, speed_check=False, **fields, **kv))
        assert drafter.cache is spec.cache
        seen.clear()
        out = spec.generate(prompt, 24)
        assert out.tokens == Engine(target, None, EngineConfig(max_seq_len=MAX_LEN, **kv)).generate(prompt, 24).tokens
        assert seen and max(t for t, _, _ in seen) <= 4 and min(p for _, p, _ in seen) >= len(prompt)
        assert {dtype for _, _, dtype in seen} == {torch.bfloat16}
        if not kv:  # over exact KV it agrees with its target on most tokens; a drafter that never agreed gives 1
            assert out.metrics.tau > 2.0
    assert upper and spec.cache.quant.reader == "target"  # the draft's reads, and the target's reader after them
    with pytest.raises(ValueError, match="reads the target's KV cache: drive it through an engine"):
        KIND.drafter(None, KIND.config(None, 0, None), target, MAX_LEN, None).propose(
            ServedBudget.parse("4x1").tree, SamplingParams())


def test_a_bundle_holds_the_scheme_and_no_weights_and_serves(tmp_path, target, target_dir):
    fingerprint = target_fingerprint(target_dir)
    write_bundle(tmp_path / "b", KIND.config(None, 0, None), None, target_fingerprint=fingerprint, data_digest="d",
                 config={}, code_version="test")
    bundle = read_bundle(tmp_path / "b", fingerprint)
    assert json.loads((tmp_path / "b" / "drafter_config.json").read_text()) == {
        "kind": "quantspec", "weights": default_scheme(), "kv_reader": "draft"}
    assert not (tmp_path / "b" / "drafter.safetensors").exists()
    drafter = build_drafter(bundle, target, MAX_LEN)
    plain = Engine(target, None, EngineConfig(max_seq_len=MAX_LEN))
    spec = Engine(target, drafter, EngineConfig(max_seq_len=MAX_LEN, speed_check=False,
                                                **ServedBudget.parse("4x1").engine_fields()))
    p = prompts(1)[0]
    assert spec.generate(p, 32).tokens == plain.generate(p, 32).tokens

    write_bundle(tmp_path / "bad", {"kind": "quantspec", "weights": "int4-g48"}, None, target_fingerprint=fingerprint,
                 data_digest="d", config={}, code_version="test")
    with pytest.raises(BundleError, match=r"quantspec weights 'int4-g48': expected one of int4-g32, int4-g64, "
                                          r"int4-g128, int8$"):
        build_drafter(read_bundle(tmp_path / "bad", fingerprint), target, MAX_LEN)
