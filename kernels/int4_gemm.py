"""Int4 weight products for a few rows on CPUs with AVX-512 VNNI or AVX2: our own C++ kernel (int4_gemm.cpp),
`reference` its torch definition. The weights a self-speculative draft (runtime/drafters/quantspec.py) streams per step.

Why our own: a draft step is bound by the bytes of weights it reads, and int4 reads half of int8's; but torch's packed
int4 CPU product runs several times slower than our fp32 kernel at one row (docs/qwen.md,
"QuantSpec: self-speculation").

Weights: groups of `group` consecutive k per output row, each with an fp16 scale and minimum (asymmetric: w = q * scale
+ minimum, q in 0..15, as GGUF's Q4_K keeps them, so a checkpoint that came from one is read back nearly exactly).
Rows of x are quantised to int8 per call over their own absolute maximum; the products sum in int32 per group.
"""
from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch
from torch import Tensor

from kernels.cpu_gemm import build, cpu_flags

SOURCE = Path(__file__).with_name("int4_gemm.cpp")
PANEL = 16  # output columns per panel (NR in int4_gemm.cpp)
# the CPU flags each build needs, and its compiler flags: the first this CPU has is built
BUILDS = (({"avx512f", "avx512bw", "avx512_vnni", "f16c"}, ["-mavx512f", "-mavx512bw", "-mavx512vnni", "-mf16c"]),
          ({"avx2", "fma", "f16c"}, ["-mavx2", "-mfma", "-mf16c"]))


@functools.cache
def available() -> bool:
    """Whether the kernel runs here (built once per process); where not, `linear` runs `reference`."""
    cflags = next((c for needs, c in BUILDS if needs <= cpu_flags()), None)
    if cflags is None or not build(SOURCE, cflags):
        return False
    torch.library.register_fake("draftsmith_int4::int4_linear")(
        lambda x, panels, n, group, bias: x.new_empty(x.shape[0], n))
    return True


def quantize(weight: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """weight [N, K] -> (codes uint8 [N, K] in 0..15, scales fp16 [N, K / group], minimums fp16 [N, K / group]),
    each group's codes spanning its own minimum to maximum."""
    n, k = weight.shape
    if k % group or group % 8:
        raise ValueError(f"int4 groups of {group} along k={k}: expected a multiple of 8 that divides k")
    w = weight.detach().float().reshape(n, k // group, group)
    low, high = w.amin(-1), w.amax(-1)
    scales = ((high - low) / 15).clamp_min(1e-8).half()
    minimums = low.half()
    codes = torch.round((w - minimums.float()[..., None]) / scales.float()[..., None]).clamp_(0, 15)
    return codes.to(torch.uint8).reshape(n, k), scales, minimums


def dequantize(codes: Tensor, scales: Tensor, minimums: Tensor) -> Tensor:
    """The fp32 weight [N, K] the codes stand for."""
    n, k = codes.shape
    groups = scales.shape[1]
    w = codes.reshape(n, groups, k // groups).float() * scales.float()[..., None] + minimums.float()[..., None]
    return w.reshape(n, k)


def pack(codes: Tensor, scales: Tensor, minimums: Tensor) -> Tensor:
    """The panels int4_gemm.cpp streams: uint8 [ceil(N / 16), groups, group * 8 + 64], per panel and group its
    nibble blocks (byte 4c + i of block b: k = 8b + i low, 8b + 4 + i high, column c) then 16 scales and 16
    minimums in fp16."""
    n, k = codes.shape
    groups = scales.shape[1]
    pad = -n % PANEL
    codes, scales, minimums = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (codes, scales, minimums))
    p, blocks = (n + pad) // PANEL, k // groups // 8
    c = codes.reshape(p, PANEL, groups, blocks, 2, 4).permute(0, 2, 3, 1, 5, 4)  # p, g, b, column, i, low/high
    nibbles = (c[..., 0] | (c[..., 1] << 4)).reshape(p, groups, blocks * 64)
    meta = [t.reshape(p, PANEL, groups).transpose(1, 2).contiguous().view(torch.uint8) for t in (scales, minimums)]
    return torch.cat([nibbles, *meta], -1).contiguous()


def unpack(panels: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """pack's inverse: (codes, scales, minimums) of the first n rows."""
    p, groups, width = panels.shape
    blocks = (width - 64) // 64
    nibbles = panels[..., :blocks * 64].reshape(p, groups, blocks, PANEL, 4)
    c = torch.stack([nibbles & 15, nibbles >> 4], -1)  # p, g, b, column, i, low/high
    codes = c.permute(0, 3, 1, 2, 5, 4).reshape(p * PANEL, groups * blocks * 8)[:n]
    meta = [panels[..., blocks * 64 + 32 * j:blocks * 64 + 32 * (j + 1)].contiguous().view(torch.float16)
            .transpose(1, 2).reshape(p * PANEL, groups)[:n] for j in (0, 1)]
    return codes, meta[0], meta[1]


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (int8 values, fp32 scale per row): symmetric over each row's absolute maximum."""
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(x / scale).to(torch.int8), scale


def reference(x: Tensor, codes: Tensor, scales: Tensor, minimums: Tensor, bias: Tensor | None = None) -> Tensor:
    """The kernel's product in plain torch: x [..., K] through the same int8 rounding, times the dequantised weight
    (equal to `linear` up to fp32 summation order)."""
    rows = x.reshape(-1, x.shape[-1]).float()
    xq, scale = quantize_rows(rows)
    y = (xq.float() * scale) @ dequantize(codes, scales, minimums).T
    y = y if bias is None else y + bias.float()
    return y.view(*x.shape[:-1], -1).to(x.dtype)


def linear(x: Tensor, panels: Tensor, n: int, group: int, bias: Tensor | None = None) -> Tensor:
    """x [..., K] -> [..., n] through the packed int4 weight (+ bias); `reference` where the kernel cannot run."""
    if not available():
        warn_slow()
        return reference(x, *unpack(panels, n), bias)
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    y = torch.ops.draftsmith_int4.int4_linear(rows, panels, n, group, None if bias is None else bias.contiguous())
    return y.view(*x.shape[:-1], n).to(x.dtype)


@functools.cache
def warn_slow() -> None:
    warnings.warn("this CPU has neither AVX-512 VNNI nor AVX2: int4 products run through their torch reference, "
                  "which unpacks the weights per call (correct, slow)", stacklevel=3)
