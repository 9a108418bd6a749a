"""kernels/cpu_gemm: our fp32 small-batch product against its torch reference, and its batch invariance."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_gemm
from runtime.model import Linear

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="kernels/cpu_gemm needs AVX2 + FMA and a compiler")


@pytest.mark.parametrize("n", [576, 13, 1])  # 13 and 1: weight rows left over after the 4-row tiles
@pytest.mark.parametrize("bias", [False, True])
@torch.no_grad()
def test_matches_the_torch_reference(n, bias):
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(2, 9, 64, generator=g), torch.randn(n, 64, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    y = cpu_gemm.small_linear(x, w, b)
    assert y.shape == (2, 9, n)
    torch.testing.assert_close(y, cpu_gemm.reference(x, w, b), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_every_row_gets_its_one_row_result_bit_for_bit():
    """What a tree verify needs to give each token exactly its decode result: no dependence on the other rows,
    whatever the row count (tiles of 3 rows, remainders of 1 and 2) or the split over threads."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(197, 1536, generator=g), torch.randn(197, generator=g)
    x = torch.randn(70, 1536, generator=g) * 3
    one_row = torch.cat([cpu_gemm.small_linear(x[i:i + 1], w, b) for i in range(70)])
    for rows in (2, 3, 4, 5, 7, 11, 70):
        assert torch.equal(cpu_gemm.small_linear(x[:rows], w, b), one_row[:rows]), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_gemm.small_linear(x, w, b), one_row)
    finally:
        torch.set_num_threads(threads)


def test_serves_only_what_it_can_multiply():
    assert cpu_gemm.serves(torch.randn(4, 16))
    assert not cpu_gemm.serves(torch.randn(4, 12))  # K not a multiple of 8
    assert not cpu_gemm.serves(torch.randn(16, 4).t())  # not contiguous
    assert not cpu_gemm.serves(torch.randn(4, 16, dtype=torch.bfloat16))


@torch.no_grad()
def test_linear_routes_fp32_inference_through_it_and_training_around_it(monkeypatch):
    monkeypatch.setattr("runtime.model.OWN_FP32_KERNEL", True)
    monkeypatch.setattr("runtime.model.OWN_MAX_ROWS", 8)
    linear = Linear(64, 24)
    linear.pack()
    assert linear.own_fp32
    calls = []
    monkeypatch.setattr(cpu_gemm, "small_linear", lambda *a: calls.append(a[0].shape) or cpu_gemm.reference(*a))
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
