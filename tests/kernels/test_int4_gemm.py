"""kernels/int4_gemm.py: group-wise int4 quantisation, the panel layout, and our product (AVX-512 VNNI or AVX2)
against its torch reference."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import int4_gemm
from kernels.cpu_gemm import cpu_flags

needs_kernel = pytest.mark.skipif(not int4_gemm.available(),
                                  reason="kernels/int4_gemm needs AVX-512 VNNI or AVX2, and a compiler")


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("group", [32, 64, 128])
def test_each_group_spans_its_range_within_half_a_step(group):
    w = weight(40, 256)
    codes, scales, minimums = int4_gemm.quantize(w, group)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and scales.shape == (40, 256 // group)
    step = scales.float().repeat_interleave(group, 1)
    assert ((int4_gemm.dequantize(codes, scales, minimums) - w).abs() <= step / 2 + 1e-3 * step).all()


def test_a_weight_already_on_a_4_bit_grid_is_read_back_exactly():
    """A checkpoint converted from GGUF's Q4_K holds such groups: its int4 copy loses nothing."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (24, 64), generator=g)
    codes[:, ::32], codes[:, 1::32] = 0, 15  # each group of 32 reaches both ends of its range
    scales = (torch.rand(24, 2, generator=g) * 0.01 + 0.001).half().float()
    minimums = (-8 * scales - torch.rand(24, 2, generator=g) * 1e-3).half().float()
    w = codes.float() * scales.repeat_interleave(32, 1) + minimums.repeat_interleave(32, 1)
    back = int4_gemm.dequantize(*int4_gemm.quantize(w, 32))
    assert (back - w).abs().max() <= 1e-6


@pytest.mark.parametrize("n", [37, 16, 1])  # a partly filled last panel of 16 columns, a full one, one column
def test_pack_and_unpack_are_inverse(n):
    parts = int4_gemm.quantize(weight(n, 128, seed=n), 32)
    panels = int4_gemm.pack(*parts)
    assert panels.shape == (-(-n // 16), 4, 32 * 8 + 64)
    for a, b in zip(int4_gemm.unpack(panels, n), parts):
        assert torch.equal(a, b)


@needs_kernel
@pytest.mark.parametrize("n,k,group", [(37, 256, 32), (200, 1536, 64), (16, 128, 128)])
@pytest.mark.parametrize("rows", [1, 7, 13])
@pytest.mark.parametrize("bias", [False, True])
@torch.no_grad()
def test_matches_the_torch_reference(n, k, group, rows, bias):
    g = torch.Generator().manual_seed(rows)
    x, b = torch.randn(rows, k, generator=g) * 3, torch.randn(n, generator=g) if bias else None
    parts = int4_gemm.quantize(weight(n, k), group)
    y = int4_gemm.linear(x[None], int4_gemm.pack(*parts), n, group, b)
    assert y.shape == (1, rows, n)
    torch.testing.assert_close(y, int4_gemm.reference(x[None], *parts, b), atol=2e-5, rtol=1e-5)


@needs_kernel
@torch.no_grad()
def test_the_largest_codes_times_the_largest_inputs_do_not_saturate():
    """Codes of 15 against inputs of +-127, the most an AVX2 build's int16 pairs ever hold, in every sign pattern."""
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 2, (48, 256), generator=g, dtype=torch.uint8) * 15
    scales = torch.full((48, 8), 2.0 ** -6, dtype=torch.float16)
    minimums = torch.full((48, 8), -(2.0 ** -3), dtype=torch.float16)
    x = torch.where(torch.rand(3, 256, generator=g) < 0.5, -1.0, 1.0)  # every value at the row's absolute maximum
    y = int4_gemm.linear(x, int4_gemm.pack(codes, scales, minimums), 48, 32)
    torch.testing.assert_close(y, x @ int4_gemm.dequantize(codes, scales, minimums).T, atol=1e-5, rtol=1e-6)


@needs_kernel
@torch.no_grad()
def test_every_row_gets_its_one_row_result_bit_for_bit():
    g = torch.Generator().manual_seed(2)
    parts = int4_gemm.quantize(weight(70, 512), 32)
    panels = int4_gemm.pack(*parts)
    x = torch.randn(20, 512, generator=g)
    one_row = torch.cat([int4_gemm.linear(x[i:i + 1], panels, 70, 32) for i in range(20)])
    for rows in (2, 5, 6, 7, 13, 20):
        assert torch.equal(int4_gemm.linear(x[:rows], panels, 70, 32), one_row[:rows]), rows


# each build in a process of its own: both register the same operator
ONE_BUILD = """
import sys, torch
from kernels import int4_gemm
int4_gemm.BUILDS = int4_gemm.BUILDS[int(sys.argv[1]):int(sys.argv[1]) + 1]
assert int4_gemm.available()
x, panels, n, group, bias = torch.load(sys.argv[2])
torch.save(int4_gemm.linear(x, panels, n, group, bias), sys.argv[3])
"""


@pytest.mark.skipif(not all(needs <= cpu_flags() for needs, _ in int4_gemm.BUILDS),
                    reason="comparing the builds needs a CPU that runs every one (AVX-512 VNNI)")
@pytest.mark.parametrize("group", [32, 128])
def test_every_build_gives_the_same_bits(tmp_path, group):
    g = torch.Generator().manual_seed(5)
    parts = int4_gemm.quantize(weight(200, 1536, seed=group), group)
    x = torch.randn(13, 1536, generator=g) * torch.logspace(-3, 3, 13)[:, None]  # rows far apart in scale
    torch.save((x, int4_gemm.pack(*parts), 200, group, torch.randn(200, generator=g)), tmp_path / "in.pt")
    ys = []
    for i in range(len(int4_gemm.BUILDS)):
        subprocess.run([sys.executable, "-c", ONE_BUILD, str(i), str(tmp_path / "in.pt"), str(tmp_path / f"{i}.pt")],
                       check=True, timeout=600, cwd=Path(__file__).parents[2])
        ys.append(torch.load(tmp_path / f"{i}.pt"))
    assert all(torch.equal(ys[0], y) for y in ys[1:])


@torch.no_grad()
def test_without_the_kernel_the_reference_answers(monkeypatch):
    monkeypatch.setattr(int4_gemm, "available", lambda: False)
    parts = int4_gemm.quantize(weight(20, 64), 32)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    with pytest.warns(UserWarning, match="int4 products run through their torch reference"):
        int4_gemm.warn_slow.cache_clear()
        y = int4_gemm.linear(x, int4_gemm.pack(*parts), 20, 32)
    assert torch.equal(y, int4_gemm.reference(x, *parts))


def test_a_group_that_does_not_divide_k_is_refused():
    with pytest.raises(ValueError, match="int4 groups of 48 along k=64: expected a multiple of 8 that divides k"):
        int4_gemm.quantize(weight(4, 64), 48)
