"""Verification of a draft tree against one target forward: greedy, and lossless sampling.

Sampling follows recursive rejection over siblings (SpecInfer; RSD, Jeon et al. 2024): the children of a row were
drawn from q without replacement, so after rejecting child x the target moves to its residual
norm(max(0, p - q)) and the draft to q without x, and the next sibling is tested against that pair. Whatever
the tree, the emitted tokens are distributed exactly as if sampled one by one from the target.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.speculation.sampling import SamplingParams, sample, warp
from runtime.speculation.tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    accepted: list[int]  # accepted node indices, root to leaf
    next_token: int  # bonus or correction token drawn from the target at the end of the accepted path


def _check_rows(tree: DraftTree, rows: torch.Tensor, name: str) -> None:
    n = len(tree)
    if rows.dim() != 2 or rows.shape[0] != n + 1:
        raise ValueError(f"{name}: shape {tuple(rows.shape)}, expected [{n + 1}, V] (root + {n} nodes)")


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Verdict:
    """Longest path whose every token is the target argmax at its parent row; bonus = argmax at its last row."""
    _check_rows(tree, target_logits, "target_logits")
    # in fp32: exact, the same first-maximum ties, and on the CPU faster than a bf16 argmax
    return _greedy_walk(tree, target_logits.float().argmax(-1).tolist())


def _greedy_walk(tree: DraftTree, best: list[int]) -> Verdict:
    """verify_greedy given the target's argmax at each row (root first)."""
    tokens = tree.host_lists().tokens
    children = tree.children()
    accepted: list[int] = []
    row = 0
    while True:
        match = next((c for c in children[row] if tokens[c] == best[row]), None)
        if match is None:
            return Verdict(accepted, best[row])
        accepted.append(match)
        row = match + 1


def _reject(p: torch.Tensor, q: torch.Tensor | None, x: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(target, draft) for the next sibling after draft token x was rejected. q None: x was a point mass."""
    if q is None:
        residual = p.clone()
        residual[x] = 0.0  # max(0, p - onehot(x))
    else:
        residual = (p - q).clamp_(min=0.0)
        q = q.clone()
        q[x] = 0.0
        q_mass = q.sum()
        q = q / q_mass if q_mass > 0 else q  # zero: x held all of q, no further sibling can have been drawn
    if residual.sum() <= 0:
        # p == q up to rounding: this rejection had probability ~0 and any choice costs ~0; p without x keeps
        # the next sibling's test consistent (p' == q' again) and never re-emits the rejected x...
        residual = p.clone()
        residual[x] = 0.0
        if residual.sum() <= 0:
            residual = p  # ...unless x is all p allows
    return residual / residual.sum(), q


def verify_sampling(tree: DraftTree, target_probs: torch.Tensor,
                    generator: torch.Generator | None = None) -> Verdict:
    """Recursive rejection sampling over siblings; target_probs [N+1, V] already warped. The generator must live
    on target_probs' device."""
    _check_rows(tree, target_probs, "target_probs")
    return _rejection_walk(tree, lambda row: target_probs[row], target_probs.shape[-1], generator)


def verify(tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None) -> Verdict:
    """Verify with the target logits [N+1, V] of one forward over root + tree nodes."""
    if params.greedy:
        return verify_greedy(tree, target_logits)
    _check_rows(tree, target_logits, "target_logits")
    # warp only the rows the walk visits (at most depth + 1 of the N + 1): top-p costs milliseconds per row on CPU
    return _rejection_walk(tree, lambda row: warp(target_logits[row], params), target_logits.shape[-1], generator)


def verify_batch(trees: list[DraftTree], target_logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[Verdict]:
    """Each row's tree against its own rows of one batched forward, target_logits [B, T, V]: row b's root at
    [b, 0], its node i at [b, i + 1], padding after its last node. Each row verifies with its own params and
    generator; the greedy rows' argmax is read from the device once for all of them."""
    B = target_logits.shape[0]
    if not len(trees) == len(params) == len(generators) == B:
        raise ValueError(f"verify_batch: {len(trees)} trees, {len(params)} params and {len(generators)} generators "
                         f"for a batch of {B}")
    longest = max(len(t) for t in trees) + 1
    if target_logits.dim() != 3 or target_logits.shape[1] < longest:
        raise ValueError(f"verify_batch: target_logits {tuple(target_logits.shape)}, expected [{B}, >= {longest}, V]")
    greedy = [b for b, p in enumerate(params) if p.greedy]
    best = dict(zip(greedy, target_logits[greedy, :longest].float().argmax(-1).tolist())) if greedy else {}
    return [_greedy_walk(tree, best[b]) if b in best else
            verify(tree, target_logits[b, :len(tree) + 1], params[b], generators[b])
            for b, tree in enumerate(trees)]


def _rejection_walk(tree: DraftTree, target_row: Callable[[int], torch.Tensor], vocab: int,
                    generator: torch.Generator | None) -> Verdict:
    if tree.q is not None and tree.q.shape != (len(tree) + 1, vocab):
        raise ValueError(f"DraftTree.q: shape {tuple(tree.q.shape)}, expected {(len(tree) + 1, vocab)} "
                         "(one draft distribution per row, target vocabulary)")
    tokens = tree.host_lists().tokens
    children = tree.children()
    accepted: list[int] = []
    row = 0
    while True:
        p = target_row(row).float()
        q = None if tree.q is None else tree.q[row].float()
        chosen = None
        for c in children[row]:
            x = tokens[c]
            qx = 1.0 if q is None else q[x].item()
            if qx <= 0:
                raise ValueError(f"sampling verification: node {c} (token {x}) has draft probability {qx} at its "
                                 "parent row; siblings must be distinct draws from q (use draw_children)")
            u = torch.rand((), generator=generator, device=p.device).item()
            if u * qx < p[x].item():  # accept with probability min(1, p(x) / q(x))
                chosen = c
                break
            p, q = _reject(p, q, x)
        if chosen is None:
            return Verdict(accepted, int(sample(p, generator)))
        accepted.append(chosen)
        row = chosen + 1


def draw_children(q: torch.Tensor, k: int, params: SamplingParams,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Up to k distinct child tokens from the draft distribution q [V], in draw order (the order the tree must
    list them in). Greedy: the top-k of q. Sampling: k draws without replacement (fewer when q has fewer than k
    tokens with mass), which is what verify_sampling assumes."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"draw_children: k={k!r}, expected an int >= 1")
    k = min(k, q.shape[-1])
    if params.greedy:
        return q.topk(k).indices
    # Exponential race (Gumbel-top-k): token t arrives at E_t / q_t; the k earliest arrivals, in arrival order, are
    # distributed as k sequential draws from q without replacement.
    arrival = torch.empty(q.shape, dtype=torch.float32, device=q.device).exponential_(generator=generator)
    top = (q.float() / arrival).topk(k)
    return top.indices[top.values > 0]
