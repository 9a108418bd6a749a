"""torch SDPA: the CPU path and the reference every other backend is compared with."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.sdpa_kernels import sdpa_kernels
from runtime.target.attention.base import AttentionBackend, Causal, exact_dtype, grouped


class SdpaBackend(AttentionBackend):
    """torch SDPA: the CPU path and the GPU reference. Sparse verification masks the skipped keys, so it gives
    the sparse result exactly but does not save the reads themselves."""

    name = "sdpa"

    @staticmethod
    def runs_on(device: torch.device) -> bool:
        return True

    def __init__(self):
        self._mask: tuple[Tensor, Tensor] | None = None  # (a forward's mask, its grouped additive form)

    def __call__(self, q, keys, values, mask, keep):
        if isinstance(mask, Causal) and keep is None and q.device.type == "cpu" and not torch.is_grad_enabled():
            return causal_attention(q, keys, values, mask.prefix)
        dtype = exact_dtype(q, mask)
        if keep is None and isinstance(mask, Tensor):  # every layer of a forward gets the same mask: convert it once
            qg = q.reshape(q.shape[0], keys.shape[1], -1, q.shape[-1])
            mask_g = self._additive(mask, qg.shape[2] // q.shape[2], dtype)
        else:
            qg, mask_g = grouped(q, keys, mask, keep)
        with sdpa_kernels(q.device):
            out = F.scaled_dot_product_attention(qg.to(dtype), keys.to(dtype), values.to(dtype), attn_mask=mask_g)
        return out.to(q.dtype).reshape(q.shape)

    def _additive(self, mask: Tensor, groups: int, dtype: torch.dtype) -> Tensor:
        """mask [B, 1, T, S] bool -> [B, 1, G*T, S] of 0 / -inf in `dtype`, kept for the next call with the same
        mask object (held here, so its id cannot be reused; masks are read-only, see AttentionBackend)."""
        compiling = torch.compiler.is_compiling()  # a compiled step keeps no memo: dynamo would guard on its state
        last = None if compiling else self._mask  # one read: another thread may replace it
        if last is not None and last[0] is mask and last[1].dtype == dtype and last[1].shape[2] == groups * mask.shape[2]:
            return last[1]
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        additive = additive.repeat(1, 1, groups, 1)
        if not compiling:
            self._mask = (mask, additive)
        return additive


def causal_attention(q: Tensor, keys: Tensor, values: Tensor, prefix: int) -> Tensor:
    """Causal attention of q [B, H, T, D] over `prefix` cached keys and its own T, with no mask in memory: SDPA's
    is_causal aligns the diagonal top-left, so the cached keys (all visible) and the new ones (causal) go through
    the flash kernel as two calls, merged by their log-sum-exp. Grouped-query heads stay unrepeated."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if prefix == 0:
        return flash(q, keys, values, 0.0, True)[0]
    old, old_lse = flash(q, keys[:, :, :prefix], values[:, :, :prefix], 0.0, False)
    new, new_lse = flash(q, keys[:, :, prefix:], values[:, :, prefix:], 0.0, True)
    top = torch.maximum(old_lse, new_lse)
    old_w, new_w = (old_lse - top).exp().unsqueeze(-1), (new_lse - top).exp().unsqueeze(-1)  # fp32, as the lse
    return ((old.float() * old_w + new.float() * new_w) / (old_w + new_w)).to(q.dtype)
