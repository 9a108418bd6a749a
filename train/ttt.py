"""EAGLE trained the way it drafts ("training-time test", as in HASS and EAGLE-3).

At inference the drafter's depth-d node reads a feature the drafter itself predicted at depth d-1, and attends
to the committed (true) pairs plus its own chain. Teacher forcing alone trains only depth 1, and acceptance
collapses deeper in the tree. Here every row is unrolled `depth` times in parallel over all start positions:

    depth 1: pair P_j = (x_{j+1}, f_j) at position j+1, causal over true pairs      -> f^1_j ~ f_{j+1}
    depth d: pair (x_{j+d}, f^{d-1}_j) at position j+d, sees P_0..P_j and its chain  -> f^d_j ~ f_{j+d}

and every depth is trained (train.recipes.eagle.eagle_loss), deeper ones weighted less. The same unroll, greedy and
without gradients, replays chain drafting on held-out rows (train.recipes.eagle.simulated_chain).
"""
from __future__ import annotations

import torch
from torch import Tensor

from runtime.drafters.shared.eagle_drafting import EagleBase
from runtime.target.attention import pick_backend


MAX_SCORES = 1 << 26  # ChainKV.attend's fp32 score tensor, 256 MB at most (the default's is ~42 MB)


class ChainKV:
    """KVCache stand-in for the unroll: each depth's keys are appended out of place (autograd-safe), and its
    attention (`attend`, which runtime.target.model.Attention calls in place of the backend) uses the mask's
    structure."""

    def __init__(self):
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def write(self, layer: int, slots, k: Tensor, v: Tensor, n_live: int) -> tuple[Tensor, Tensor]:
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, kv_heads, T, D]
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        return self.k, self.v

    @staticmethod
    def attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, keep: Tensor | None) -> Tensor:
        """Attention under unroll_mask: q [B, H, n, D] of depth d over keys [B, Hkv, d*n, D]. Depth 1 is plain
        causal attention (the device's backend). From depth 2 on a query sees the causal true pairs plus one key
        per earlier depth, its own chain's: scored here as n causal columns plus d-1 elementwise products. SDPA
        would compute all d*n columns under the mask; this costs half as much at depth 2 on CPU. It holds the
        scores whole, so long rows, and GPUs (whose SDPA kernels never do), keep the backend."""
        B, H, n, D = q.shape
        Hkv, depth = keys.shape[1], keys.shape[2] // n
        if depth == 1 or keep is not None or q.device.type != "cpu" or B * H * n * (n + depth - 1) > MAX_SCORES:
            return pick_backend(q.device)(q, keys, values, mask, keep)
        G = H // Hkv
        qg = q.reshape(B, Hkv, G, n, D)
        causal = mask[0, 0, :, :n]  # unroll_mask's first block
        pairs = (qg.flatten(2, 3) @ keys[:, :, :n].transpose(-1, -2)).view(B, Hkv, G, n, n)
        chain_k, chain_v = (x[:, :, n:].unflatten(2, (depth - 1, n)) for x in (keys, values))  # [B, Hkv, d-1, n, D]
        chain = torch.einsum("bhgtd,bhktd->bhgtk", qg, chain_k)
        acc = torch.promote_types(q.dtype, torch.float32)  # softmax in fp32 at least, as SDPA's kernels do
        scores = torch.cat([pairs.to(acc).masked_fill(~causal, float("-inf")), chain.to(acc)], -1) * D ** -0.5
        w = scores.softmax(-1).to(q.dtype)
        out = (w[..., :n].flatten(2, 3) @ values[:, :, :n]).view(B, Hkv, G, n, D)
        return (out + torch.einsum("bhgtk,bhktd->bhgtd", w[..., n:], chain_v)).view(B, H, n, D)


def unroll_mask(n: int, depth: int, device: torch.device) -> Tensor:
    """[1, 1, n, depth*n] bool for the depth-`depth` queries: true pairs up to their start, then their own chain."""
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    chain = torch.eye(n, dtype=torch.bool, device=device)
    return torch.cat([causal] + [chain] * (depth - 1), dim=1)[None, None]


def unroll(model: EagleBase, ids: Tensor, inputs: Tensor, depth: int,
           wanted: list[Tensor] | None = None) -> list[Tensor]:
    """ids [B, T], input features [B, T-1, H] (f_0..f_{T-2}) -> per depth d the predictions [B, T-1, H], row j
    predicting f_{j+d}. Tokens past the row's end are padding; callers mask those rows out.

    wanted: per depth a [B, T-1] bool of the rows a loss reads. Only those rows, and the rows a deeper wanted row
    is unrolled from, then pay for the block's output projection and MLP (every row still writes the keys deeper
    depths attend to); the other rows of the result are zeros: a batch's prompt and padding rows cost no MLP, and
    the predictions where wanted are the same."""
    B, T = ids.shape
    n = T - 1
    kv, out, feats = ChainKV(), [], inputs
    start = torch.arange(n, device=ids.device)
    needed = _needed_rows(wanted, depth) if wanted is not None else [None] * depth
    for d in range(1, depth + 1):
        tokens = torch.zeros(B, n, dtype=torch.long, device=ids.device)
        tokens[:, : T - d] = ids[:, d:]  # x_{j+d}
        positions = (start + d).clamp(max=model.rope_cos.shape[0] - 1).expand(B, n)
        rows = needed[d - 1]
        feats = model.step(tokens, feats, positions, kv, None, d * n, unroll_mask(n, d, ids.device), rows=rows)[0]
        if rows is not None:  # back to [B, n, H], zeros where no deeper depth or loss reads the row
            feats = feats.new_zeros(B * n, feats.shape[-1]).index_copy(0, rows, feats).view(B, n, -1)
        out.append(feats)
    return out


def _needed_rows(wanted: list[Tensor], depth: int) -> list[Tensor]:
    """Flat row indices per depth: the rows wanted there or needed as the input of a needed deeper row (depth d+1
    row j reads depth d row j's prediction; later depths' keys are seen by their own row's chain only)."""
    if len(wanted) != depth:
        raise ValueError(f"unroll: {len(wanted)} wanted masks for depth {depth}")
    need, rows = wanted[-1], []
    for d in range(depth, 0, -1):
        need = need | wanted[d - 1]
        rows.append(need.flatten().nonzero().squeeze(1))
    return rows[::-1]
