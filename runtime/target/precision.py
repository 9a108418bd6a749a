"""Which float type the compute-bound jobs run in: training's matmuls (distill.precision, bf16 autocast) and
prepare's target pass and validate (data.precision and validate.precision, bf16 weights).

bf16 halves the work only where the hardware computes bf16 products natively: CUDA GPUs that support it, and CPUs
with AMX for everything. CPUs with AVX512_BF16 dot products but no AMX speed up large products only, so only
training uses bf16 there. Elsewhere bf16 on a CPU is emulated and slower than fp32, so "auto" keeps fp32 there
(measured in docs/logs/cpu-2026-11.md,
"Measurements moved out of docstrings (2026-11-28)").
"""
from __future__ import annotations

import warnings

import torch

from kernels.cpu_gemm import cpu_flags

PRECISIONS = ("auto", "fp32", "bf16")
BF16_EVERYWHERE = {"amx_bf16"}  # CPU flags under which whole models run faster in bf16
BF16_TRAINING = BF16_EVERYWHERE | {"avx512_bf16"}  # ... under which training's large products do


def bf16_is_fast(device: torch.device, training: bool = False) -> bool:
    """Whether bf16 beats fp32 on `device`: for training's autocast products, or (training=False) for a whole
    model's forward, decode steps included."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(cpu_flags() & (BF16_TRAINING if training else BF16_EVERYWHERE))


def float_dtype(precision: str, device: torch.device) -> torch.dtype:
    """bf16 where `precision` means it on `device` for a whole model (see use_bf16), else fp32."""
    return torch.bfloat16 if use_bf16(precision, device) else torch.float32


def use_bf16(precision: str, device: torch.device, training: bool = False) -> bool:
    """Whether `precision` (auto | fp32 | bf16) means bf16 on `device`: autocast in training (training=True),
    weights in prepare and validate."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")
    if precision == "bf16" and device.type == "cpu" and not bf16_is_fast(device, training=True):
        warnings.warn("precision=bf16 on a CPU without AVX512_BF16 or AMX: its bf16 products are emulated, many "
                      "times slower than fp32 (precision=auto picks fp32 here)", stacklevel=2)
    return precision == "bf16" or (precision == "auto" and bf16_is_fast(device, training))
