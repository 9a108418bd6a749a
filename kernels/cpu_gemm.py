"""Small-batch fp32 products on AVX2 CPUs: our own C++ kernel (cpu_gemm.cpp), F.linear its torch reference.

Why our own: decode multiplies 1 row and a tree verify 2..41 rows by each weight, and on an AVX2 AMD EPYC the
library kernels grow fast with the rows. All of a SmolLM2-135M forward's products, fp32, median of 5-15 on the
2-core AMD host (scratch micro-benchmark; `pipeline bench` measures the end-to-end effect):

    rows                      1     2     4     7    11    16    32    64    96   128  1024
    oneDNN prepacked, ms     34    31    36    53    55    61    96   156   202   288  2036
    this kernel, ms          22    22    28    31    39    45    79   136   229   318  2582

It streams each weight row once per 64 rows of x, keeping a tile of 4 weight rows in L1 while those rows pass
over it. From ~96 rows on the library's blocked kernel computes faster (runtime.model.OWN_MAX_ROWS).

It is also batch-invariant: every output is the same chain of FMAs over k whatever the number of rows, so a verify
row equals its one-row decode bit for bit (tests/test_cpu_gemm.py), which greedy losslessness needs.

Built at first use with torch's extension builder (cached on disk, ~20 s once). Where the CPU lacks AVX2 or FMA,
or no compiler is present, `available()` is False and callers keep their library kernel.
"""
from __future__ import annotations

import functools
import hashlib
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

SOURCE = Path(__file__).with_name("cpu_gemm.cpp")


@functools.cache
def cpu_info(field: str) -> str:
    """The value of `field` (flags, vendor_id, ...) for the first CPU in /proc/cpuinfo; "" where unknown."""
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith(field))
    except (OSError, StopIteration):
        return ""


@functools.cache
def available() -> bool:
    """Build (or load the cached build of) the kernel once per process; False where it cannot run here."""
    if not {"avx2", "fma"} <= set(cpu_info("flags").split()):
        return False
    from torch.utils.cpp_extension import load

    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]  # a changed source never loads a stale build
    try:
        load(name=f"draftsmith_cpu_gemm_{digest}", sources=[str(SOURCE)], is_python_module=False,
             extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"])  # at::parallel_for is OpenMP in the header
    except Exception as e:  # no compiler, no ninja, a read-only cache: the library kernel serves instead
        warnings.warn(f"kernels/cpu_gemm.cpp did not build ({type(e).__name__}: {str(e)[:200]}); "
                      "fp32 products keep the library kernel", stacklevel=2)
        return False
    return True


def serves(weight: Tensor) -> bool:
    """Whether small_linear can multiply by `weight` [N, K]: fp32, contiguous, on a CPU, K a multiple of 8."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.is_contiguous() and weight.shape[1] % 8 == 0 and available())


def small_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight.T + bias, for a weight `serves` accepts; meant for a few rows (see the table above)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.draftsmith_cpu.small_linear(rows, weight, None if bias is None else bias.contiguous())
    return y.view(*x.shape[:-1], weight.shape[0])


def reference(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The same product through torch (equal up to fp32 rounding, not bit for bit: other summation order)."""
    return F.linear(x, weight, bias)
