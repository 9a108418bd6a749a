"""Which keys each query may see: the mask a forward passes its attention backend (runtime.target.attention.base).

A tensor [B, 1, T, S] in general (trees, sequences at different lengths, sliding windows); `Causal` for the plain
causal case of a prefill, which a backend may compute without materialising any mask; None when every query sees
every key (one decode token).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Causal:
    """The mask of T new queries after `prefix` cached keys (S = prefix + T) when every row of the batch is at that
    length and no tree or window narrows it: query t sees keys 0 .. prefix + t."""
    prefix: int

    def dense(self, batch: int, T: int, device: torch.device) -> Tensor:
        """The same mask as a tensor [batch, 1, T, prefix + T] bool, for code that needs one."""
        mask = torch.ones(T, self.prefix + T, dtype=torch.bool, device=device).tril(self.prefix)
        return mask.expand(batch, 1, T, self.prefix + T)


Mask = Tensor | Causal | None


def dense_mask(mask: Mask, q: Tensor) -> Tensor | None:
    """`mask` as a tensor (or None) for queries q [B, H, T, D]."""
    return mask.dense(q.shape[0], q.shape[2], q.device) if isinstance(mask, Causal) else mask


def attention_mask(lengths: Tensor, positions: Tensor, n_live: int, tree_mask: Tensor | None,
                   window: int | None = None, always: bool = False) -> Tensor | None:
    """[B, 1, T, n_live] bool: the committed prefix (slots < lengths[b]), plus the new tokens `tree_mask` [T, T]
    allows (causal when None; [B, T, T]: each sequence its own tree), minus keys a sliding `window` excludes. None
    when one decode token may see every live key (no mask to build or apply), unless `always` (static shapes read
    keys beyond the live ones)."""
    B, T = positions.shape
    if B == 1 and T == 1 and (window is None or n_live <= window) and not always:
        return None
    device = positions.device
    if tree_mask is None:
        tree_mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    elif tree_mask.shape not in ((T, T), (B, T, T)):
        raise ValueError(f"tree_mask has shape {tuple(tree_mask.shape)}, expected ({T}, {T}) or ({B}, {T}, {T})")
    key = torch.arange(n_live, device=device)
    offset = key[None, :] - lengths[:, None]  # [B, n_live]: index among the new tokens, < 0 for the prefix
    is_new = (offset >= 0) & (offset < T)
    columns = offset.clamp(0, T - 1)
    new_visible = tree_mask[:, columns].permute(1, 0, 2) if tree_mask.dim() == 2 else \
        tree_mask.gather(2, columns[:, None, :].expand(B, T, n_live))  # [B, T, n_live]
    mask = (offset < 0)[:, None, :] | (is_new[:, None, :] & new_visible)
    if window is not None:  # keys keep their slot as position; queries use their (tree) position
        mask &= positions[:, :, None] - key[None, None, :] < window
    return mask[:, None]


def causal_mask(lengths: Tensor, T: int, n_live: int, tree_mask: Tensor | None,
                window: int | None = None) -> Causal | None:
    """Causal(prefix) where attention_mask's mask is the plain causal one: several new tokens, no tree, every
    sequence after the same number of cached ones, and no key outside a sliding window; else None."""
    if T == 1 or tree_mask is not None or (window is not None and n_live > window):
        return None
    prefix = n_live - T
    if lengths.numel() > 1 and int(lengths.min()) != prefix:
        return None
    return Causal(prefix)
