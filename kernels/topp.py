"""Sorting-free top-p threshold over attention weights (SpecAttn KV selection).

Per row of non-negative weights w (rows sum to about 1) find the LARGEST threshold t with
    sum(w[w >= t]) >= p
and keep exactly the weights w >= t. That keep-set is the minimal-mass set reaching p that a sort-based
top-p would pick, except that every weight EQUAL to the threshold is kept (ties are never split).
If no positive threshold reaches p (p above the row's total mass after rounding) t = 0 and all weights are kept.

Why bisection on the fp32 bit pattern: for non-negative floats the int32 view is monotone in the value, and
the answer t is one of the weights, so 31 halvings of [0, bits(max w)] land on it exactly; a sort costs
O(S log S) and serialises badly on a GPU, a fixed bisection is 31 streaming passes with no data-dependent
control flow. Mass sums are fp32 in both implementations; they can disagree only when a candidate mass is
within rounding of p.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BISECTION_STEPS = 31  # bits(max finite fp32) < 2**31, so 31 halvings pin the threshold exactly


def _check(w: torch.Tensor, p: float) -> None:
    if not w.is_floating_point() or w.dim() < 1 or w.shape[-1] == 0:
        raise ValueError(f"weights must be a floating tensor [..., S] with S >= 1, got {w.dtype} {tuple(w.shape)}")
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top-p mass p must be in (0, 1], got {p}")


def topp_mask_torch(w: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: (keep-mask bool [..., S], threshold [...] in w.dtype) for weights w [..., S]."""
    _check(w, p)
    w32 = w.float()
    lo = torch.zeros(w32.shape[:-1], dtype=torch.int64, device=w.device)  # t = 0 keeps everything: always valid
    hi = w32.amax(-1).view(torch.int32).long()
    for _ in range(BISECTION_STEPS):
        mid = lo + (hi - lo + 1) // 2
        t = mid.int().view(torch.float32).unsqueeze(-1)
        reaches = torch.where(w32 >= t, w32, 0.0).sum(-1) >= p
        lo = torch.where(reaches, mid, lo)
        hi = torch.where(reaches, hi, mid - 1)
    threshold = lo.int().view(torch.float32)
    return w32 >= threshold.unsqueeze(-1), threshold.to(w.dtype)


@triton.jit
def _topp_row_kernel(w_ptr, keep_ptr, threshold_ptr, S, p, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    row = tl.program_id(0)
    w_row = w_ptr + row.to(tl.int64) * S
    row_max = tl.zeros((), tl.float32)
    for start in range(0, S, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        row_max = tl.maximum(row_max, tl.max(tl.load(w_row + offs, mask=offs < S, other=0.0).to(tl.float32), 0))
    hi = row_max.to(tl.int32, bitcast=True)
    lo = hi * 0
    for _ in range(STEPS):
        mid = lo + (hi - lo + 1) // 2
        t = mid.to(tl.float32, bitcast=True)
        mass = tl.zeros((), tl.float32)
        for start in range(0, S, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(w_row + offs, mask=offs < S, other=0.0).to(tl.float32)
            mass += tl.sum(tl.where(x >= t, x, 0.0), 0)
        reaches = mass >= p
        lo = tl.where(reaches, mid, lo)
        hi = tl.where(reaches, hi, mid - 1)
    t = lo.to(tl.float32, bitcast=True)
    for start in range(0, S, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(w_row + offs, mask=offs < S, other=0.0).to(tl.float32)
        tl.store(keep_ptr + row.to(tl.int64) * S + offs, (x >= t).to(tl.uint8), mask=offs < S)
    tl.store(threshold_ptr + row, t)


def topp_mask_triton(w: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton kernel, one program per row looping over S in blocks; same contract as `topp_mask_torch`."""
    _check(w, p)
    S = w.shape[-1]
    rows = w.reshape(-1, S).contiguous()
    keep = torch.empty(rows.shape, dtype=torch.uint8, device=w.device)
    threshold = torch.empty(rows.shape[0], dtype=torch.float32, device=w.device)
    block = min(triton.next_power_of_2(S), 1024)
    _topp_row_kernel[(rows.shape[0],)](rows, keep, threshold, S, float(p), BLOCK=block, STEPS=BISECTION_STEPS)
    return keep.view(torch.bool).view(w.shape), threshold.view(w.shape[:-1]).to(w.dtype)


def topp_mask(w: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep-mask and threshold of the top-p set per row: Triton on CUDA, the torch reference elsewhere."""
    return topp_mask_triton(w, p) if w.is_cuda else topp_mask_torch(w, p)
