"""SpecAttn sparse verification in Triton: attention that reads only the keys each kv head keeps.

The sdpa backend gives the sparse result by masking, so it still reads every key. This kernel first lists, per
(batch, kv head), the positions some query keeps (ascending, without a host sync), then each program -- one kv head
and a block of its query rows, the G query heads of the group folded into rows -- loads keys and values by those
positions only, BLOCK_N at a time, with an online softmax. The verify's `mask` (tree and causal) and a per-query
`keep` are applied on the gathered keys. Over many keys the kept list is split between programs (flash-decoding:
each split keeps its own softmax statistics, combined afterwards), since one kv head's rows alone would leave most
of a GPU idle.

`sparse_attention_torch` is the reference (torch SDPA over the same allowed keys). Shapes as
runtime.target.attention.AttentionBackend: q [B, H, T, D], keys/values [B, Hkv, S, D] (a slice of a longer cache is
fine), mask [B, 1, T, S] bool or None, keep [B, Hkv, 1|T, S] bool.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def sparse_attention_torch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                           keep: torch.Tensor) -> torch.Tensor:
    """softmax over the keys `mask` and `keep` both allow, each kv head serving its H / Hkv query heads."""
    G = q.shape[1] // keys.shape[1]
    allowed = keep.repeat_interleave(G, dim=1)
    if mask is not None:
        allowed = allowed & mask
    return F.scaled_dot_product_attention(q, keys.repeat_interleave(G, 1), values.repeat_interleave(G, 1),
                                          attn_mask=allowed)


def kept_positions(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keep [B, Hkv, R, S] -> (positions [B*Hkv, S] int32: the keys any of the R rows keeps, ascending, then the
    rest; counts [B*Hkv] int32). A stable sort, so no host sync decides a length."""
    union = keep.any(2).flatten(0, 1)
    order = torch.sort((~union).to(torch.uint8), dim=-1, stable=True).indices
    return order.to(torch.int32), union.sum(-1, dtype=torch.int32)


@triton.jit
def _sparse_attention_kernel(Q, K, V, O, M_PART, L_PART, ACC_PART, POS, COUNT, MASK, KEEP,
                             sq_b, sq_h, sq_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_t,
                             sm_b, sm_t, sp_b, sp_h, sp_t, n_kv_heads, T, S, D, G, scale,
                             HAS_MASK: tl.constexpr, PER_QUERY_KEEP: tl.constexpr, IEEE: tl.constexpr,
                             SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // n_kv_heads
    kvh = bh % n_kv_heads
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # the group's query heads x queries, folded
    split = tl.program_id(2)
    row_ok = rows < G * T
    head = kvh * G + rows // T
    t = rows % T
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + b * sq_b + head[:, None] * sq_h + t[:, None] * sq_t + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.load(COUNT + bh)
    # split i takes blocks i, i + SPLITS, ... of the kept list: balanced whatever its length
    for start in range(split * BLOCK_N, n, SPLITS * BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < n
        pos = tl.load(POS + bh * S + j, mask=j_ok, other=0)
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k = tl.load(K + b * sk_b + kvh * sk_h + pos[:, None] * sk_s + d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(V + b * sv_b + kvh * sv_h + pos[:, None] * sv_s + d[None, :], mask=kv_ok, other=0.0)
        if IEEE:  # fp32 inputs: full precision, not TF32, like the reference
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        ok = row_ok[:, None] & j_ok[None, :]
        if HAS_MASK:
            ok = ok & (tl.load(MASK + b * sm_b + t[:, None] * sm_t + pos[None, :], mask=ok, other=0) != 0)
        if PER_QUERY_KEEP:
            ok = ok & (tl.load(KEEP + b * sp_b + kvh * sp_h + t[:, None] * sp_t + pos[None, :], mask=ok, other=0) != 0)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet stays at zero
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if SPLITS == 1:
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(O + b * so_b + head[:, None] * so_h + t[:, None] * so_t + d[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
    else:  # this split's statistics, [SPLITS, B*Hkv, G*T(, D)]
        part = (split * tl.num_programs(0) + bh) * G * T + rows
        tl.store(M_PART + part, m_i, mask=row_ok)
        tl.store(L_PART + part, l_i, mask=row_ok)
        tl.store(ACC_PART + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


def default_splits(S: int) -> int:
    """Splits of the kept list: one per 256 keys the cache holds, at most 16 (a first guess: kernels.gpu_check
    times it against one split on a GPU)."""
    return max(1, min(16, S // 256))


def sparse_attention_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                            keep: torch.Tensor, positions: tuple[torch.Tensor, torch.Tensor] | None = None,
                            splits: int | None = None) -> torch.Tensor:
    """As sparse_attention_torch, reading per kv head only the keys `keep` names. `positions`: kept_positions(keep),
    where the caller has it already (every layer mapped to one draft layer shares it). `splits`: programs per kv
    head and row block that share its kept keys (default_splits by default)."""
    B, H, T, D = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    if H % Hkv or keep.shape[:2] != (B, Hkv) or keep.shape[2] not in (1, T) or keep.shape[3] != S:
        raise ValueError(f"sparse_attention: q {tuple(q.shape)}, keys {tuple(keys.shape)} and keep "
                         f"{tuple(keep.shape)} do not fit [B, H, T, D] / [B, Hkv, S, D] / [B, Hkv, 1|T, S]")
    q, keys, values = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, keys, values))
    positions, counts = kept_positions(keep) if positions is None else positions
    splits = default_splits(S) if splits is None else splits
    G = H // Hkv
    out = torch.empty_like(q)
    m_part = l_part = acc_part = out  # unread with one split
    if splits > 1:
        m_part, l_part = (torch.empty(splits, B * Hkv, G * T, device=q.device) for _ in range(2))
        acc_part = torch.empty(splits, B * Hkv, G * T, D, device=q.device)
    mask_u8 = None if mask is None else mask.expand(B, 1, T, S).view(torch.uint8)
    keep_u8 = keep.view(torch.uint8)
    block_d = max(16, triton.next_power_of_2(D))
    # no register spills on sm_90 (kernels/gpu_compile.py reads the cubins): fp32 dots at head dim 128 take 16 rows,
    # and the larger tiles 8 warps
    block_m = max(16, min(16 if q.dtype == torch.float32 and block_d >= 128 else 64, triton.next_power_of_2(G * T)))
    grid = (B * Hkv, triton.cdiv(G * T, block_m), splits)
    mask_arg = keep_u8 if mask_u8 is None else mask_u8  # a pointer is needed either way; unread without HAS_MASK
    _sparse_attention_kernel[grid](
        q, keys, values, out, m_part, l_part, acc_part, positions, counts, mask_arg, keep_u8,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), out.stride(0), out.stride(1), out.stride(2),
        mask_arg.stride(0), mask_arg.stride(2), keep_u8.stride(0), keep_u8.stride(1), keep_u8.stride(2),
        Hkv, T, S, D, G, D ** -0.5,
        HAS_MASK=mask is not None, PER_QUERY_KEEP=keep.shape[2] > 1, IEEE=q.dtype == torch.float32,
        SPLITS=splits, BLOCK_M=block_m, BLOCK_N=32, BLOCK_D=block_d, num_warps=8 if block_m * block_d >= 2048 else 4)
    if splits == 1:
        return out
    # combine the splits' softmax statistics; a split that saw no key has m = -inf and weighs 0
    m = m_part.amax(0)
    w = torch.exp(m_part - m.masked_fill(m == float("-inf"), 0.0))
    combined = (acc_part * w[..., None]).sum(0) / (l_part * w).sum(0).clamp_min(1e-30)[..., None]
    return combined.view(B, Hkv, G, T, D).reshape(B, H, T, D).to(q.dtype)
