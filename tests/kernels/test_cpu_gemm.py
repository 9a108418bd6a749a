"""kernels/cpu_gemm.py: our fp32 small-batch product against its torch reference, and its batch invariance."""
from __future__ import annotations

import os
import time

import pytest
import torch

from kernels import cpu_gemm
from runtime.target.cpu_packing import Linear

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="kernels/cpu_gemm needs AVX2 + FMA and a compiler")


@pytest.mark.parametrize("n", [576, 13, 1])  # 13 and 1: a partly filled last panel of 16 columns
@pytest.mark.parametrize("bias", [False, True])
@torch.no_grad()
def test_matches_the_torch_reference(n, bias):
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(2, 9, 60, generator=g), torch.randn(n, 60, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    y = cpu_gemm.small_linear(x, cpu_gemm.pack(w), n, b)
    assert y.shape == (2, 9, n)
    torch.testing.assert_close(y, cpu_gemm.reference(x, w, b), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_every_row_gets_its_one_row_result_bit_for_bit():
    """What a tree verify needs to give each token exactly its decode result: no dependence on the other rows,
    whatever the row count (tiles of 1..6 rows, slices of 64) or the split over threads."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(197, 1536, generator=g), torch.randn(197, generator=g)
    panels = cpu_gemm.pack(w)
    x = torch.randn(70, 1536, generator=g) * 3
    one_row = torch.cat([cpu_gemm.small_linear(x[i:i + 1], panels, 197, b) for i in range(70)])
    for rows in (2, 3, 4, 5, 6, 7, 8, 11, 13, 70):
        assert torch.equal(cpu_gemm.small_linear(x[:rows], panels, 197, b), one_row[:rows]), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_gemm.small_linear(x, panels, 197, b), one_row)
    finally:
        torch.set_num_threads(threads)


def test_serves_only_what_it_can_multiply():
    assert cpu_gemm.serves(torch.randn(4, 12)) and cpu_gemm.serves(torch.randn(16, 4).t())
    assert not cpu_gemm.serves(torch.randn(4, 16, dtype=torch.bfloat16))
    assert not cpu_gemm.serves(torch.randn(16))


def test_pack_lays_16_output_columns_k_major_and_zero_pads_the_last_panel():
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    panels = cpu_gemm.pack(w)
    assert panels.shape == (2, 3, 16) and panels.is_contiguous()
    assert torch.equal(panels[1, 2, 3], w[19, 2]) and torch.equal(panels[0, 1, 5], w[5, 1])
    assert not panels[1, :, 4:].any()


@torch.no_grad()
def test_linear_routes_fp32_inference_through_it_and_training_around_it(monkeypatch):
    monkeypatch.setattr("runtime.target.cpu_packing.OWN_FP32_KERNEL", True)
    monkeypatch.setattr("runtime.target.cpu_packing.OWN_MAX_ROWS", 8)
    linear = Linear(64, 24)
    linear.pack()
    assert linear.own_fp32
    calls = []
    monkeypatch.setattr(cpu_gemm, "small_linear",
                        lambda x, panels, n, bias: calls.append(x.shape) or cpu_gemm.reference(x, linear.weight, bias))
    x = torch.randn(1, 5, 64)
    linear(x)
    assert calls == [(1, 5, 64)]
    many = torch.randn(3, 3, 64)  # 9 rows, more than OWN_MAX_ROWS: the library kernel (prefills)
    torch.testing.assert_close(linear(many), cpu_gemm.reference(many, linear.weight, linear.bias))
    assert calls == [(1, 5, 64)]
    with torch.enable_grad():  # the kernel has no backward
        linear(x).sum().backward()
    assert calls == [(1, 5, 64)] and linear.weight.grad is not None
    linear.unpack()
    linear(x)
    assert calls == [(1, 5, 64)] and not linear.own_fp32


def test_a_killed_builds_lock_is_cleared_and_a_live_one_kept(tmp_path):
    """torch waits forever on a build lock: one left by a killed build (old) goes, a build in progress (new) stays."""
    lock = tmp_path / "lock"
    lock.touch()
    cpu_gemm.clear_stale_lock(tmp_path)
    assert lock.exists()
    old = time.time() - cpu_gemm.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    with pytest.warns(UserWarning, match="a killed build's"):
        cpu_gemm.clear_stale_lock(tmp_path)
    assert not lock.exists()
    cpu_gemm.clear_stale_lock(tmp_path)  # nothing to clear
