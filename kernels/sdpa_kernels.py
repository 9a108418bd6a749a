"""Which torch SDPA kernels attention runs on CUDA: one definition for the runtime and the GPU checks."""
from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# Not cuDNN (SDPA's first pick there): it builds an execution plan for every new shape, and a decode's or a tree's
# key count is new at every step (most of an eager decode: docs/logs/gpu-2026-11.md,
# "2026-11-25: cuDNN attention, the static-verify rows, a real-target bench path"). Not
# flash either: it would take the maskless one-token decode and memory-efficient attention the masked tree verify,
# and two kernels round bf16 differently, so greedy speculation would drift from plain decoding.
CUDA_SDPA_KERNELS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_no_context = contextlib.nullcontext()


def sdpa_kernels(device: torch.device):
    """Context in which SDPA calls on `device` pick our kernels: CUDA_SDPA_KERNELS on CUDA, torch's choice elsewhere."""
    return sdpa_kernel(CUDA_SDPA_KERNELS) if device.type == "cuda" else _no_context
