"""kernels/topp.py, kernels/kv_quant.py and kernels/sparse_attention.py: torch references against their
definitions, Triton kernels (in Triton's CPU interpreter, fp32: the interpreter has no bf16) against the references,
and every kernel compiled for a Hopper GPU (kernels/gpu_compile.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from triton.runtime.jit import JITFunction

from kernels import gpu_compile
import kernels.kv_quant as kvq
import kernels.sparse_attention as sa
import kernels.topp as topp
from support.helpers import run_in_triton_interpreter


def softmax_rows(*shape: int, seed: int, sharpness: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharpness * torch.randn(*shape, generator=g), -1)


def sorted_topp_mask(w: torch.Tensor, p: float) -> torch.Tensor:
    """The textbook top-p: sort descending, keep the shortest prefix whose mass reaches p."""
    values, order = w.sort(-1, descending=True)
    keep_sorted = (values.cumsum(-1) - values) < p  # an element is needed while the mass before it is short of p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


# ---- top-p ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("p", [0.05, 0.5, 0.8, 0.95])
def test_topp_threshold_selects_the_minimal_set_sorting_would(seed, p):
    w = softmax_rows(4, 3, 97, seed=seed)
    keep, threshold = topp.topp_mask_torch(w, p)
    assert torch.equal(keep, sorted_topp_mask(w, p))
    assert torch.equal(keep, w >= threshold.unsqueeze(-1))
    kept_mass = torch.where(keep, w, 0.0).sum(-1)
    assert (kept_mass >= p).all()
    smallest_kept = torch.where(keep, w, torch.inf).amin(-1)
    assert (kept_mass - smallest_kept < p).all()  # dropping any kept weight falls short: minimal


def test_topp_keeps_every_weight_tied_with_the_threshold():
    w = torch.tensor([[0.4, 0.2, 0.2, 0.2], [0.1, 0.3, 0.3, 0.3]])
    keep, threshold = topp.topp_mask_torch(w, 0.5)
    assert keep.tolist() == [[True, True, True, True], [False, True, True, True]]
    assert threshold.tolist() == pytest.approx([0.2, 0.3])


def test_topp_full_mass_keeps_all_positive_weights_and_works_in_bf16():
    w = softmax_rows(2, 64, seed=5).bfloat16()
    w[0, :3] = 0
    keep, threshold = topp.topp_mask_torch(w, 1.0)
    assert keep[1].all() and keep[0, 3:].all()
    assert threshold.dtype == torch.bfloat16 and torch.equal(keep, w >= threshold.unsqueeze(-1))


@pytest.mark.parametrize("p", [0.0, -0.1, 1.5])
def test_topp_rejects_mass_outside_unit_interval(p):
    with pytest.raises(ValueError, match="top-p mass"):
        topp.topp_mask(softmax_rows(2, 8, seed=0), p)


def test_topp_dispatcher_uses_the_reference_on_cpu():
    w = softmax_rows(3, 50, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(topp.topp_mask(w, 0.7), topp.topp_mask_torch(w, 0.7)))


def check_topp_triton_matches_torch() -> None:
    for shape in [(2, 3, 40), (1, 1500)]:  # one block per row; several blocks per row
        w = softmax_rows(*shape, seed=7, sharpness=2.0)
        for p in (0.3, 0.9):
            keep, threshold = topp.topp_mask_triton(w, p)
            ref_keep, ref_threshold = topp.topp_mask_torch(w, p)
            assert torch.equal(keep, ref_keep) and torch.equal(threshold, ref_threshold), (shape, p)


def test_topp_triton_matches_torch_in_the_interpreter():
    run_in_triton_interpreter(check_topp_triton_matches_torch)


# ---- KV quantisation ------------------------------------------------------------------------------------------

def kv_rows(seed: int, shape=(2, 5, 3, 64)) -> torch.Tensor:
    """[batch, tokens, heads, head_dim] with per-row magnitudes spread over decades and one all-zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(2 * torch.randn(*shape[:-1], 1, generator=g))
    x[0, 0, 0] = 0
    return x


def test_split_int8_is_exact_for_every_code():
    q8 = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    upper, lower = kvq.split_int8(q8)
    assert torch.equal(16 * upper + lower, q8.to(torch.int16))
    assert upper.min() == -8 and upper.max() == 7 and lower.min() == 0 and lower.max() == 15


def test_nibbles_unpack_every_byte_as_packed():
    codes = torch.arange(-8, 8).repeat_interleave(16), torch.arange(-8, 8).repeat(16)  # every (even, odd) pair
    pairs = torch.stack(codes, -1).flatten()  # [512]: element 2i, then 2i+1
    packed = kvq._pack_nibbles(pairs)
    assert packed.unique().numel() == 256
    assert torch.equal(kvq._unpack_nibbles(packed, signed=True), pairs.float())
    assert torch.equal(kvq._unpack_nibbles(packed, signed=False), (pairs & 15).float())


@pytest.mark.parametrize("seed", range(2))
def test_int8_error_is_at_most_half_a_step(seed):
    x = kv_rows(seed)
    q, scale = kvq.quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == x.shape[:-1] and q.abs().max() <= 127
    err = (kvq.dequantize_int8(q, scale) - x).abs()
    assert (err <= scale.unsqueeze(-1) / 2 * (1 + 1e-6)).all()
    assert torch.equal(kvq.dequantize_int8(q, scale)[0, 0, 0], torch.zeros(64))


@pytest.mark.parametrize("group_size", [16, 32, 64])
def test_int4_groupwise_error_is_at_most_half_a_step(group_size):
    x = kv_rows(3)
    packed, scale = kvq.quantize_int4(x, group_size)
    assert packed.dtype == torch.uint8 and packed.shape == (*x.shape[:-1], 32)
    assert scale.shape == (*x.shape[:-1], 64 // group_size)
    err = (kvq.dequantize_int4(packed, scale) - x).abs()
    assert (err <= scale.repeat_interleave(group_size, -1) / 2 * (1 + 1e-6)).all()


def test_hierarchical_full_equals_int8_exactly_and_upper_is_within_its_bound():
    x = kv_rows(4)
    upper, lower, scale = kvq.quantize_hierarchical(x)
    q8, scale8 = kvq.quantize_int8(x)
    assert torch.equal(scale, scale8)
    assert torch.equal(kvq.dequant_full(upper, lower, scale), kvq.dequantize_int8(q8, scale8))
    u, _ = kvq.split_int8(q8)  # the upper plane alone holds each code's upper nibble
    assert torch.equal(kvq.dequant_upper(upper, scale), (16 * u + 8).float() * scale.unsqueeze(-1))
    err = (kvq.dequant_upper(upper, scale) - x).abs()
    assert (err <= 8.5 * scale.unsqueeze(-1) * (1 + 1e-6)).all()


def test_quantisers_reject_bad_shapes_with_a_clear_message():
    with pytest.raises(ValueError, match="multiple of an even group size"):
        kvq.quantize_int4(torch.randn(4, 48), 32)
    with pytest.raises(ValueError, match="floating tensor"):
        kvq.quantize_int8(torch.ones(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="packed uint8"):
        kvq.dequantize_int4(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 3))


def check_kv_quant_triton_matches_torch() -> None:
    x = kv_rows(5, shape=(2, 3, 2, 64))
    q, s = kvq.quantize_int8_triton(x)
    ref_q, ref_s = kvq.quantize_int8_torch(x)
    assert torch.equal(q, ref_q) and torch.equal(s, ref_s)
    for group_size in (32, 64):
        packed, scale = kvq.quantize_int4_triton(x, group_size)
        ref_packed, ref_scale = kvq.quantize_int4_torch(x, group_size)
        assert torch.equal(packed, ref_packed) and torch.equal(scale, ref_scale), group_size
        assert torch.equal(kvq.dequantize_int4_triton(packed, scale), kvq.dequantize_int4_torch(packed, scale))
    upper, lower, scale = kvq.quantize_hierarchical_triton(x)
    ref = kvq.quantize_hierarchical_torch(x)
    assert all(torch.equal(a, b) for a, b in zip((upper, lower, scale), ref))
    assert torch.equal(kvq.dequant_upper_triton(upper, scale), kvq.dequant_upper_torch(upper, scale))
    assert torch.equal(kvq.dequant_full_triton(upper, lower, scale), kvq.dequant_full_torch(upper, lower, scale))


def test_kv_quant_triton_matches_torch_bit_for_bit_in_the_interpreter():
    run_in_triton_interpreter(check_kv_quant_triton_matches_torch)


# ---- SpecAttn sparse attention ---------------------------------------------------------------------------------

def check_sparse_attention_triton_matches_torch() -> None:
    g = torch.Generator().manual_seed(0)
    # (B, H, Hkv, T, S, D, keep rows): SmolLM2's 9 over 3 heads, a tree verify, ~80 kept keys (3 blocks of 32);
    # a batch of 2 with one kept set per query, a decode without grouping, a head dim that is no power of two
    for B, H, Hkv, T, S, D, R in [(1, 9, 3, 6, 200, 64, 1), (2, 4, 2, 5, 40, 24, 5), (1, 4, 4, 1, 33, 16, 1)]:
        q = torch.randn(B, H, T, D, generator=g)
        keys, values = (torch.randn(B, Hkv, S + 7, D, generator=g)[:, :, :S] for _ in range(2))  # cache slices
        mask = torch.rand(B, 1, T, S, generator=g) > 0.3
        keep = torch.rand(B, Hkv, R, S, generator=g) > 0.6
        mask[..., -1] = keep[..., -1] = True  # every query sees a key
        unread = ~keep.any(2, keepdim=True).transpose(2, 3)
        poisoned = [x.masked_fill(unread, float("nan")) for x in (keys, values)]
        for m, splits in ((mask, 1), (mask, 3), (None, 1), (None, 4)):  # the kept list in one program or shared
            ref = sa.sparse_attention_torch(q, keys, values, m, keep)
            torch.testing.assert_close(sa.sparse_attention_triton(q, keys, values, m, keep, splits=splits), ref)
            # it reads no key or value it does not keep: poisoned, they leave the output as it was
            torch.testing.assert_close(sa.sparse_attention_triton(q, *poisoned, m, keep, splits=splits), ref)
        every = torch.ones_like(keep)
        dense = torch.nn.functional.scaled_dot_product_attention(
            q, keys.repeat_interleave(H // Hkv, 1), values.repeat_interleave(H // Hkv, 1), attn_mask=mask)
        torch.testing.assert_close(sa.sparse_attention_triton(q, keys, values, mask, every), dense)


def test_sparse_attention_triton_matches_torch_in_the_interpreter():
    run_in_triton_interpreter(check_sparse_attention_triton_matches_torch)


def test_kept_positions_list_each_heads_kept_keys_in_order():
    keep = torch.tensor([[[[1, 0, 0, 1, 0]], [[0, 0, 0, 0, 0]]], [[[0, 1, 0, 0, 0]], [[1, 1, 1, 1, 1]]]],
                        dtype=torch.bool)  # [B=2, Hkv=2, 1, S=5]
    positions, counts = sa.kept_positions(keep)
    assert counts.tolist() == [2, 0, 1, 5]
    assert [p[:n] for p, n in zip(positions.tolist(), counts.tolist())] == [[0, 3], [], [1], [0, 1, 2, 3, 4]]
    per_query = torch.zeros(1, 1, 2, 5, dtype=torch.bool)
    per_query[0, 0, 0, 4] = per_query[0, 0, 1, 1] = True
    positions, counts = sa.kept_positions(per_query)  # the union of the rows
    assert counts.tolist() == [2] and positions[0, :2].tolist() == [1, 4]
    with pytest.raises(ValueError, match="do not fit"):
        sa.sparse_attention_triton(torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), None,
                                   torch.ones(1, 2, 3, 5, dtype=torch.bool))


# ---- every kernel compiles for the GPU ------------------------------------------------------------------------

def test_every_triton_kernel_compiles_for_hopper_as_its_wrapper_launches_it():
    """The interpreter has no bf16 and never lowers to a GPU; compiling for sm_90 (ptxas included) does. A bf16
    tl.dot of mixed operand dtypes, for one, passes the interpreter tests and fails here, and so does a tile too
    large for the registers (fp32 sparse attention at head dim 128 over 64 rows spilled 6.6 KB)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    code = "import json; from kernels.gpu_compile import compile_all; print(json.dumps(compile_all()))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    compiled = json.loads(done.stdout.splitlines()[-1])
    kernels = {name for module in (kvq, sa, topp) for name, f in vars(module).items() if isinstance(f, JITFunction)
               and name.endswith("_kernel")}
    assert {c["kernel"] for c in compiled} == kernels
    assert all(0 <= c["shared_bytes"] <= gpu_compile.HOPPER_SHARED_BYTES for c in compiled)
    assert [c for c in compiled if c["stack_bytes"]] == [] and all(c["registers"] > 0 for c in compiled)  # no spills
    sparse = [c["constexprs"] for c in compiled if c["kernel"] == "_sparse_attention_kernel"]
    assert {(c["IEEE"], c["SPLITS"] > 1, c["PER_QUERY_KEEP"]) for c in sparse} == {
        (ieee, split, per_query) for ieee in (True, False) for split, per_query in ((False, False), (True, False),
                                                                                   (True, True))}
