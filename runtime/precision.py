"""Which float type the compute-bound jobs run in: training's matmuls (distill.precision, bf16 autocast) and
prepare's target pass (data.precision, bf16 weights).

bf16 halves the work only where the hardware has bf16 matrix units: CUDA GPUs that support it and CPUs with AMX
(measured on this project's 2-core Sapphire Rapids CI kind: an EAGLE training step 2.9 s -> 1.4 s; regeneration
1.8x faster).
Elsewhere bf16 on a CPU is emulated and slower than fp32, so "auto" keeps fp32 there.
"""
from __future__ import annotations

import torch

from kernels.cpu_gemm import cpu_info

PRECISIONS = ("auto", "fp32", "bf16")


def bf16_is_fast(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and "amx_bf16" in cpu_info("flags").split()


def float_dtype(precision: str, device: torch.device) -> torch.dtype:
    """bf16 where `precision` means it on `device` (see use_bf16), else fp32."""
    return torch.bfloat16 if use_bf16(precision, device) else torch.float32


def use_bf16(precision: str, device: torch.device) -> bool:
    """Whether `precision` (auto | fp32 | bf16) means bf16 on `device` (autocast in training, weights in prepare)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")
    return precision == "bf16" or (precision == "auto" and bf16_is_fast(device))
