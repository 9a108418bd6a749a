"""flashinfer attention backend (issue #8, GPU only), through flashinfer's batch wrappers over the KV cache in place:

- decode (one query, no mask): `BatchDecodeWithPagedKVCacheWrapper`;
- prefill and tree verification (a mask): `BatchPrefillWithPagedKVCacheWrapper` with the mask as its custom mask;
- SpecAttn sparse verification (`keep`): `VariableBlockSparseAttentionWrapper` with 1x1 blocks, so that each kv head
  reads exactly the keys its own `mask & keep` allows (`sparse_blocks`).

The keys a layer gets are a slice [1, Hkv, S, D] of a cache laid out [.., Hkv, L, D]. `paged_view` presents that
slice as flashinfer's HND pages of up to `PAGE` tokens over the same memory (flashinfer reads a paged cache's
strides), so no key is copied; the sparse wrapper takes the keys whole and copies them. A wrapper's `plan` is host
work, done once per forward: every layer of a forward gets the same mask, and the layers mapped to one draft layer
the same keep (runtime.attention.AttentionBackend), so a plan is kept for the next call with the same objects.

Falls back to torch SDPA (the reference) where flashinfer has no kernel or cannot plan (`_plannable`): fp32, batch > 1,
and inside a CUDA graph capture or torch.compile, where a replay would not repeat the host-side plan. Registered by
runtime/attention.py only when the `flashinfer` package is installed (the optional extra `gpu`); flashinfer itself is
imported on first use. Its kernels only run on a GPU: `python -m kernels.flashinfer_attention` compares each path
with SDPA there and times both. On the CPU the tests run this backend through a torch stand-in of the three
wrappers (tests/torch_flashinfer.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

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


class FlashInferBackend:
    """A runtime.attention.AttentionBackend (duck-typed here so kernels/ does not import runtime/)."""

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

    def __call__(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, keep: Tensor | None) -> Tensor:
        B, H, T, D = q.shape
        if not self._plannable(q, keys):
            from runtime.attention import BACKENDS

            return BACKENDS["sdpa"](q, keys, values, mask, keep)
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


def _random_tree_mask(T: int, S: int, device: str) -> Tensor:
    """A verify's mask [1, 1, T, S]: a random tree of T nodes (each one's parent an earlier node or the root) over a
    committed prefix of S - T keys."""
    from runtime.model import attention_mask
    from runtime.tree import DraftTree

    parents = [-1] + [int(torch.randint(-1, i, (1,))) for i in range(T - 2)]
    tree = DraftTree.from_lists([0] * (T - 1), parents, None, device).ancestor_mask()  # [T, T], the root first
    lengths = torch.tensor([S - T], device=device)
    return attention_mask(lengths, (lengths + torch.arange(T, device=device))[None], S, tree)


def _check() -> int:
    """Each path against the sdpa backend (fp32 math from the same bf16 inputs), KV as slices of a longer cache as
    the runtime passes them; exit 1 where one is off by more than bf16 accuracy."""
    import triton.testing

    from kernels.sparse_attention import sparse_attention_torch
    from runtime.attention import BACKENDS

    sdpa, fi = BACKENDS["sdpa"], FlashInferBackend()
    torch.manual_seed(0)
    worst = 0.0
    print(f"{'case':<44}{'rel err':>10}{'sdpa ms':>10}{'flashinfer ms':>15}")
    for H, Hkv, D in ((9, 3, 64), (32, 8, 128)):
        for S, spare, T, sparse in ((256, 64, 1, False), (2048, 64, 1, False), (250, 3, 1, False),
                                    (256, 64, 6, False), (2048, 64, 6, False), (256, 64, 64, False),
                                    (2048, 64, 16, True), (250, 3, 6, True)):
            dt = torch.bfloat16
            q = torch.randn(1, H, T, D, device="cuda").to(dt)
            k = torch.randn(1, Hkv, S + spare, D, device="cuda").to(dt)[:, :, :S]  # a cache slice
            v = torch.randn(1, Hkv, S + spare, D, device="cuda").to(dt)[:, :, :S]
            mask = None if T == 1 else _random_tree_mask(T, S, "cuda")
            keep = None
            if sparse:  # each kv head keeps a random half of the prefix, and every new token
                keep = torch.rand(1, Hkv, 1, S, device="cuda") < 0.5
                keep[..., S - T:] = True
            if keep is None:
                ref = sdpa(q.float(), k.float(), v.float(), mask, None)
            else:
                ref = sparse_attention_torch(q.float(), k.float(), v.float(), mask, keep)
            got = fi(q, k, v, mask, keep).float()
            err = float((got - ref).norm() / ref.norm())
            worst = max(worst, err)
            t_s = triton.testing.do_bench(lambda: sdpa(q, k, v, mask, keep), return_mode="median")
            t_f = triton.testing.do_bench(lambda: fi(q, k, v, mask, keep), return_mode="median")
            case = f"H{H}/{Hkv} D{D} S{S} (cache {S + spare}) T{T}{' sparse' if sparse else ''}"
            print(f"{case:<44}{err:>10.2e}{t_s:>10.4f}{t_f:>15.4f}")
    print(f"worst rel err {worst:.2e} ({'ok' if worst < 1e-2 else 'FAILED'}: bf16 accuracy is < 1e-2)")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    raise SystemExit(_check())
