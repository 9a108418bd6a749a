"""Int8 weight products with activations quantised per call (fbgemm's dynamic linear): the CPU kernel a
self-speculative draft (runtime/drafters/quantspec.py) reads its weights through.

Why this one: a decode step is bound by the bytes of weights it streams, and fbgemm's int8 product streams a quarter
of fp32's at full speed, where torch's packed int4 product (`_weight_int4pack_mm_for_cpu`) and int8 product
(`_weight_int8pack_mm`) run slower than our fp32 kernel on a CPU at one row (docs/qwen.md, "QuantSpec: self-speculation").

Weights: int8 per output channel, symmetric (scale = absmax(row) / 127); the input rows are quantised to uint8 per
call over their own min and max, the product accumulated in int32, then scaled back to fp32. All 8 bits of the input
only where the CPU has AVX512_VNNI: without it fbgemm sums pairs of products in int16 (vpmaddubsw), which saturates
beyond 7-bit inputs (255 * 127 * 2 > 32767), so there the inputs keep 7 (reduce_range).
"""
from __future__ import annotations

import warnings
from functools import lru_cache

import torch
from torch import Tensor

from kernels.cpu_gemm import cpu_flags


@lru_cache(maxsize=None)
def reduce_range() -> bool:
    """Whether inputs are quantised to 7 bits: where fbgemm's int16 pair sums would saturate on 8."""
    return "avx512_vnni" not in cpu_flags()


def quantize(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [N, K] -> (codes int8 [N, K], scales fp32 [N]): |weight - codes * scales| <= scales / 2."""
    w = weight.detach().float()
    scales = (w.abs().amax(1) / 127).clamp_min(1e-12)
    codes = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scales


def pack(codes: Tensor, scales: Tensor, bias: Tensor | None = None):
    """The packed weight `linear` reads (fbgemm's LinearPackedParams), from `quantize`'s codes and scales."""
    with warnings.catch_warnings():  # quantised tensors are deprecated, yet they remain the prepack's only input
        warnings.simplefilter("ignore")
        q = torch._make_per_channel_quantized_tensor(codes, scales.double(),
                                                     torch.zeros(codes.shape[0], dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(q, None if bias is None else bias.detach().float().contiguous())


def unpack(packed) -> tuple[Tensor, Tensor]:
    """(codes, scales) of a packed weight, read back from it (fbgemm keeps them beside its own layout)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q, _ = torch.ops.quantized.linear_unpack(packed)
        return q.int_repr(), q.q_per_channel_scales().float()


def linear(x: Tensor, packed) -> Tensor:
    """x [..., K] fp32 -> [..., N]: x quantised to uint8 over its own range (7 bits where reduce_range), times the
    packed int8 weight, + bias."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.quantized.linear_dynamic(rows.float().contiguous(), packed, reduce_range())
    return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)


def reference(x: Tensor, codes: Tensor, scales: Tensor, bias: Tensor | None = None) -> Tensor:
    """The same product in plain torch: x through the same per-tensor uint8 quantisation, times the dequantised
    weight (equal to `linear` up to fp32 rounding)."""
    xq = torch.quantize_per_tensor_dynamic(x.float().contiguous(), torch.quint8, reduce_range()).dequantize()
    y = xq @ (codes.float() * scales[:, None]).T
    return y if bias is None else y + bias.float()
