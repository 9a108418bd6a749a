"""`python -m pipeline.bench.flashinfer_check` (GPU): the flashinfer backend's decode, tree verification and sparse
verification against sdpa on cache slices, timed both ways."""
from __future__ import annotations

import torch
from torch import Tensor

from kernels.sparse_attention import sparse_attention_torch
from runtime.speculation.tree import DraftTree
from runtime.target.attention import BACKENDS, attention_mask
from runtime.target.attention.flashinfer import FlashInferBackend


def random_tree_mask(T: int, S: int, device: str) -> Tensor:
    """A verify's mask [1, 1, T, S]: a random tree of T nodes (each one's parent an earlier node or the root) over a
    committed prefix of S - T keys."""
    parents = [-1] + [int(torch.randint(-1, i, (1,))) for i in range(T - 2)]
    tree = DraftTree.from_lists([0] * (T - 1), parents, None, device).ancestor_mask()  # [T, T], the root first
    lengths = torch.tensor([S - T], device=device)
    return attention_mask(lengths, (lengths + torch.arange(T, device=device))[None], S, tree)


def check() -> int:
    """Each path against the sdpa backend (fp32 math from the same bf16 inputs), KV as slices of a longer cache as
    the runtime passes them; exit 1 where one is off by more than bf16 accuracy."""
    import triton.testing

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
            mask = None if T == 1 else random_tree_mask(T, S, "cuda")
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
    raise SystemExit(check())
