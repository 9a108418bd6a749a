"""SpecAttn sparse verification through kernels/sparse_attention.py: a sparse layer reads only the keys each kv head
keeps, where sdpa reads them all and masks."""
from __future__ import annotations

import os

import torch
from torch import Tensor

from kernels.sparse_attention import kept_positions, sparse_attention_triton
from runtime.target.attention.base import BACKENDS, AttentionBackend


class TritonSparseBackend(AttentionBackend):
    """SpecAttn sparse verification through kernels/sparse_attention.py: a sparse layer reads only the keys each kv
    head keeps, where sdpa reads them all and masks. Dense calls (no `keep`) go to sdpa. Runs on CUDA, and on the
    CPU inside Triton's interpreter (TRITON_INTERPRET=1), where the tests run it."""

    name = "triton_sparse"

    @staticmethod
    def runs_on(device: torch.device) -> bool:
        return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"

    def __init__(self):
        self._listed: tuple[Tensor, tuple[Tensor, Tensor]] | None = None  # (a keep mask, its kept positions)

    def __call__(self, q, keys, values, mask, keep):
        if keep is None:
            return BACKENDS["sdpa"](q, keys, values, mask, keep)
        last = self._listed  # the layers mapped to one draft layer share its keep object (layer_keep): list it once
        if last is None or last[0] is not keep:
            last = self._listed = (keep, kept_positions(keep))
        return sparse_attention_triton(q, keys, values, mask, keep, last[1])
