"""flashinfer attention backend (GPU only), through flashinfer's batch wrappers over the KV cache in place:

- decode (one query, no mask): `BatchDecodeWithPagedKVCacheWrapper`;
- prefill and tree verification (a mask): `BatchPrefillWithPagedKVCacheWrapper` with the mask as its custom mask;
- SpecAttn sparse verification (`keep`): `VariableBlockSparseAttentionWrapper` with 1x1 blocks, so that each kv head
  reads exactly the keys its own `mask & keep` allows (`sparse_blocks`).

The keys a layer gets are a slice [1, Hkv, S, D] of a cache laid out [.., Hkv, L, D]. `paged_view` presents that
slice as flashinfer's HND pages of up to `PAGE` tokens over the same memory (flashinfer reads a paged cache's
strides), so no key is copied; the sparse wrapper takes the keys whole and copies them. A wrapper's `plan` is host
work, done once per forward: every layer of a forward gets the same mask, and the layers mapped to one draft layer
the same keep (AttentionBackend), so a plan is kept for the next call with the same objects.

Falls back to sdpa where flashinfer has no kernel or cannot plan (`_plannable`): fp32, batch > 1, and inside a CUDA
graph capture or torch.compile, where a replay would not repeat the host-side plan. Registered only when the
`flashinfer` package is installed (the optional extra `gpu`); flashinfer itself is imported on first use.
`python -m pipeline.bench.flashinfer_check` compares each path with sdpa on a GPU and times both; on the CPU the
tests run this backend through a torch stand-in of the three wrappers (tests/support/torch_flashinfer.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from runtime.target.attention.base import BACKENDS, AttentionBackend, Causal, Mask, dense_mask

PAGE = 16  # tokens per page: pages let flashinfer split a long context between thread blocks
WORKSPACE_BYTES = 128 << 20  # flashinfer's recommended float workspace
HALF = (torch.float16, torch.bfloat16)


def paged_view(keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor, int, int]:
    """keys, values [Hkv, S, D], each a slice of a cache laid out [Hkv, L, D] (L >= S) -> (key pages, value pages
    [n, Hkv, P, D] over the same memory: page p holds tokens p*P .. p*P+P-1; P; the tokens in the last page).
    P is the largest of PAGE, PAGE/2, .., 1 whose pages stay inside the cache. Other layouts are copied first."""
    Hkv, S, D = keys.shape
    stride = keys.stride()
    if stride[1:] != (D, 1) or stride[0] % D or values.stride() != stride:
        keys, values = keys.contiguous(), values.contiguous()
        stride = keys.stride()
    cache_len = stride[0] // D
    page = next(p for p in (PAGE >> i for i in range(PAGE.bit_length())) if -(-S // p) * p <= cache_len)
    n = -(-S // page)
    size, pages_stride = (n, Hkv, page, D), (page * D, stride[0], D, 1)
    return keys.as_strided(size, pages_stride), values.as_strided(size, pages_stride), page, S - (n - 1) * page


def sparse_blocks(mask: Tensor | None, keep: Tensor, T: int) -> Tensor:
    """keep [1, Hkv, 1|T, S] narrowed by mask [1, 1, T, S] (None: every key) -> the 1x1 block map [Hkv, T, S] that
    VariableBlockSparseAttentionWrapper takes: what each kv head's queries read."""
    allowed = keep[0].expand(-1, T, -1)
    return allowed if mask is None else allowed & mask[0]


@dataclass
class _Planned:
    """One flashinfer wrapper and what its last plan was for: a key of numbers plus the mask and keep objects
    (compared by identity: both are read-only once passed)."""

    wrapper: object
    key: tuple = ()
    tensors: tuple = field(default_factory=tuple)

    def needs_plan(self, key: tuple, tensors: tuple) -> bool:
        same = key == self.key and len(tensors) == len(self.tensors) and all(
            a is b for a, b in zip(tensors, self.tensors))
        self.key, self.tensors = key, tensors
        return not same


class FlashInferBackend(AttentionBackend):

    name = "flashinfer"
    device_type = "cuda"  # where flashinfer's kernels run; the tests give a torch stand-in of the module on the CPU

    def __init__(self, module=None):
        self._fi = module  # flashinfer, imported on first use
        # one workspace per device and one wrapper per kind and shape, shared by every engine of the process: a
        # plan holds from one call to the next, so forwards must run one at a time (serving's lock sees to it)
        self._workspaces: dict[torch.device, Tensor] = {}
        self._planned: dict[tuple, _Planned] = {}

    def runs_on(self, device: torch.device) -> bool:
        return device.type == self.device_type

    def _flashinfer(self):
        if self._fi is None:
            import flashinfer

            self._fi = flashinfer
        return self._fi

    def _plannable(self, q: Tensor, keys: Tensor) -> bool:
        """Whether flashinfer can take this call: one sequence of half-precision tensors on its device, outside a
        graph capture or a compile (a replay would not repeat the host-side plan)."""
        return (q.shape[0] == 1 and q.device.type == self.device_type and q.dtype in HALF and keys.dtype in HALF
                and not torch.compiler.is_compiling()
                and not (q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()))

    def _wrapper(self, kind: str, q: Tensor, keys: Tensor) -> _Planned:
        """The wrapper of `kind` for this shape: a drafter's forwards interleave with the target's, and each keeps
        its own plan."""
        slot = (kind, q.shape[1], keys.shape[1], q.shape[3], q.dtype, q.device)
        if slot not in self._planned:
            fi = self._flashinfer()
            if q.device not in self._workspaces:
                self._workspaces[q.device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
            workspace = self._workspaces[q.device]
            wrapper = {"decode": lambda: fi.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="HND"),
                       "prefill": lambda: fi.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="HND"),
                       "sparse": lambda: fi.VariableBlockSparseAttentionWrapper(workspace)}[kind]()
            self._planned[slot] = _Planned(wrapper)
        return self._planned[slot]

    def __call__(self, q: Tensor, keys: Tensor, values: Tensor, mask: Mask, keep: Tensor | None) -> Tensor:
        B, H, T, D = q.shape
        if not self._plannable(q, keys):
            return BACKENDS["sdpa"](q, keys, values, mask, keep)
        if isinstance(mask, Causal):  # flashinfer's causal prefill aligns the diagonal bottom-right, as Causal does
            mask = dense_mask(mask, q) if keep is not None else None
        if keep is not None:
            return self._sparse(q, keys, values, mask, keep)
        Hkv, S = keys.shape[1], keys.shape[2]
        key_pages, value_pages, page, last = paged_view(keys[0], values[0])
        n = key_pages.shape[0]
        kind = "decode" if T == 1 and mask is None else "prefill"
        planned = self._wrapper(kind, q, keys)
        if planned.needs_plan((S, T, page), (mask,)):
            indptr = torch.tensor([0, n], dtype=torch.int32)
            indices = torch.arange(n, dtype=torch.int32)
            last_page_len = torch.tensor([last], dtype=torch.int32)
            types = dict(q_data_type=q.dtype, kv_data_type=keys.dtype)
            if kind == "decode":
                planned.wrapper.plan(indptr, indices, last_page_len, H, Hkv, D, page, **types)
            else:
                custom = None if mask is None else mask[0, 0].reshape(-1)
                planned.wrapper.plan(torch.tensor([0, T], dtype=torch.int32), indptr, indices, last_page_len, H,
                                     Hkv, D, page, custom_mask=custom, causal=mask is None, **types)
        if kind == "decode":  # a batch of one request: [1, H, D]
            return planned.wrapper.run(q[:, :, 0], (key_pages, value_pages)).view(1, H, 1, D)
        out = planned.wrapper.run(q[0].transpose(0, 1).contiguous(), (key_pages, value_pages))  # [T, H, D]
        return out.transpose(0, 1).unsqueeze(0)

    def _sparse(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, keep: Tensor) -> Tensor:
        _, H, T, D = q.shape
        Hkv, S = keys.shape[1], keys.shape[2]
        planned = self._wrapper("sparse", q, keys)
        if planned.needs_plan((S, T), (mask, keep)):
            row_sizes = torch.ones(Hkv, T, dtype=torch.int32, device=q.device)
            col_sizes = torch.ones(Hkv, S, dtype=torch.int32, device=q.device)
            planned.wrapper.plan(sparse_blocks(mask, keep, T), row_sizes, col_sizes, H, Hkv, D,
                                 q_data_type=q.dtype, kv_data_type=keys.dtype)
        return planned.wrapper.run(q[0], keys[0], values[0]).unsqueeze(0)  # [H, T, D] in and out
