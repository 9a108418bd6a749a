"""A torch stand-in for the three flashinfer wrappers the flashinfer backend calls, by their documented contract
(flashinfer 0.7.2.post1: argument order, shapes, the HND paged layout, the flattened custom mask, the per-kv-head
block map). flashinfer's kernels need a GPU; this lets the tests run the backend's calls on the CPU and check what it
passes. Each wrapper counts its plans. Attention is computed in fp64, as the sdpa backend computes half precision on
the CPU (runtime.target.attention.exact_dtype), so the two round to the same bf16 results."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _attend(q: Tensor, keys: Tensor, values: Tensor, allowed: Tensor | None) -> Tensor:
    """q [H, T, D] over keys/values [Hkv, S, D] (query head h reads kv head h // G), allowed [1|Hkv, T, S]."""
    G = q.shape[0] // keys.shape[0]
    if allowed is not None:
        allowed = allowed.repeat_interleave(G, 0) if allowed.shape[0] > 1 else allowed
    out = F.scaled_dot_product_attention(q.double(), keys.double().repeat_interleave(G, 0),
                                         values.double().repeat_interleave(G, 0), attn_mask=allowed)
    return out.to(q.dtype)


def unpage(pages: Tensor, last_page_len: int) -> Tensor:
    """The tokens HND pages [n, Hkv, P, D] hold, as [Hkv, S, D]: page p, slot s is token p*P + s."""
    n, Hkv, P, D = pages.shape
    return pages.permute(1, 0, 2, 3).reshape(Hkv, n * P, D)[:, :(n - 1) * P + last_page_len]


class _Paged:
    """What the two paged wrappers share: the plan's page table, and reading a request's keys from HND pages."""

    def __init__(self, float_workspace_buffer: Tensor, kv_layout: str = "NHD"):
        assert float_workspace_buffer.dtype == torch.uint8
        self.kv_layout, self.plans = kv_layout, 0

    def _plan_pages(self, indptr: Tensor, indices: Tensor, last_page_len: Tensor, num_qo_heads: int,
                    num_kv_heads: int, head_dim: int, page_size: int, q_data_type, kv_data_type) -> None:
        for t in (indptr, indices, last_page_len):
            assert t.dtype == torch.int32 and t.device.type == "cpu", "plan takes int32 host tensors"
        assert len(indptr) == len(last_page_len) + 1 and int(indptr[-1]) == len(indices)
        assert all(1 <= n <= page_size for n in last_page_len.tolist())
        assert q_data_type in (torch.float16, torch.bfloat16) and kv_data_type in (torch.float16, torch.bfloat16)
        self.indptr, self.indices, self.last = indptr.tolist(), indices.tolist(), last_page_len.tolist()
        self.heads, self.page = (num_qo_heads, num_kv_heads, head_dim), page_size
        self.plans += 1

    def _request_kv(self, b: int, paged_kv_cache: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        assert self.kv_layout == "HND"
        out = []
        for pages in paged_kv_cache:  # [max_pages, Hkv, page_size, D]
            assert pages.shape[1:] == (self.heads[1], self.page, self.heads[2]), "HND pages of the planned size"
            out.append(unpage(pages[self.indices[self.indptr[b]:self.indptr[b + 1]]], self.last[b]))
        return out[0], out[1]


class BatchDecodeWithPagedKVCacheWrapper(_Paged):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             q_data_type=torch.float16, kv_data_type=None):
        self._plan_pages(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                         q_data_type, kv_data_type or q_data_type)

    def run(self, q: Tensor, paged_kv_cache: tuple[Tensor, Tensor]) -> Tensor:
        assert q.shape == (len(self.last), self.heads[0], self.heads[2]), "q is [batch, num_qo_heads, head_dim]"
        return torch.stack([_attend(q[b, :, None], *self._request_kv(b, paged_kv_cache), None)[:, 0]
                            for b in range(q.shape[0])])


class BatchPrefillWithPagedKVCacheWrapper(_Paged):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, *, custom_mask=None, causal=False, q_data_type=torch.float16,
             kv_data_type=None):
        self._plan_pages(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                         head_dim_qk, page_size, q_data_type, kv_data_type or q_data_type)
        assert qo_indptr.dtype == torch.int32 and len(qo_indptr) == len(paged_kv_indptr)
        self.qo_indptr, self.causal = qo_indptr.tolist(), causal
        assert custom_mask is None or custom_mask.dtype == torch.bool and custom_mask.dim() == 1
        self.custom_mask = custom_mask

    def run(self, q: Tensor, paged_kv_cache: tuple[Tensor, Tensor]) -> Tensor:
        assert q.shape == (self.qo_indptr[-1], self.heads[0], self.heads[2]), "q is [nnz_qo, num_qo_heads, head_dim]"
        out, mask_at = [], 0
        for b in range(len(self.qo_indptr) - 1):
            keys, values = self._request_kv(b, paged_kv_cache)
            qb = q[self.qo_indptr[b]:self.qo_indptr[b + 1]].transpose(0, 1)  # [H, T, D]
            T, S = qb.shape[1], keys.shape[1]
            if self.custom_mask is not None:  # each request's [T, S] mask, flattened row-major, one after another
                allowed = self.custom_mask[mask_at:mask_at + T * S].view(1, T, S)
                mask_at += T * S
            else:  # causal, aligned to the last key
                allowed = torch.ones(T, S, dtype=torch.bool).tril(S - T)[None] if self.causal else None
            out.append(_attend(qb, keys, values, allowed).transpose(0, 1))
        return torch.cat(out)


class VariableBlockSparseAttentionWrapper:
    def __init__(self, float_workspace_buffer: Tensor):
        assert float_workspace_buffer.dtype == torch.uint8
        self.plans = 0

    def plan(self, block_mask_map, block_row_sz, block_col_sz, num_qo_heads, num_kv_heads, head_dim, *,
             q_data_type=torch.float16, kv_data_type=None):
        Hkv, MB, NB = block_mask_map.shape
        assert Hkv == num_kv_heads and block_row_sz.shape == (Hkv, MB) and block_col_sz.shape == (Hkv, NB)
        # every block of a kv head expanded to its rows and columns: that head's [qo_len, kv_len] mask
        self.allowed = torch.stack([block_mask_map[h].repeat_interleave(block_row_sz[h], 0)
                                    .repeat_interleave(block_col_sz[h], 1) for h in range(Hkv)])
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.plans += 1

    def run(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        H, Hkv, D = self.heads
        assert q.shape == (H, self.allowed.shape[1], D), "q is [num_qo_heads, qo_len, head_dim]"
        assert k.shape == v.shape == (Hkv, self.allowed.shape[2], D), "k and v are [num_kv_heads, kv_len, head_dim]"
        return _attend(q, k, v, self.allowed)


class TorchFlashInfer:
    """The module the backend gets: the three wrapper classes, and every wrapper it has made."""

    def __init__(self):
        self.made: list = []
        for cls in (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper,
                    VariableBlockSparseAttentionWrapper):
            setattr(self, cls.__name__, self._maker(cls))

    def _maker(self, cls):
        def make(*args, **kwargs):
            self.made.append(cls(*args, **kwargs))
            return self.made[-1]
        return make

    def plans(self) -> int:
        return sum(w.plans for w in self.made)
