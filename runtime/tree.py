"""Draft trees: the one shape every drafter proposes and every verifier consumes.

A tree hangs below the *root*, the last committed token whose KV is not yet in the target cache.
Nodes are numbered 0..N-1 in topological order (parents before children); parent -1 means the root.
Row 0 of any per-position tensor (logits, hidden, q) belongs to the root, row i+1 to node i.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] long
    parents: torch.Tensor  # [N] long, -1 = child of the root
    # q[r] is the draft distribution (after the same temperature/top-p/top-k warp as the target) from which the
    # children of row r were drawn, without replacement. None: a deterministic drafter (each child a point mass).
    q: torch.Tensor | None = None  # [N+1, V] float

    def __post_init__(self):
        n = self.tokens.numel()
        if self.parents.numel() != n:
            raise ValueError(f"DraftTree: {n} tokens but {self.parents.numel()} parents")
        if n and bool((self.parents >= torch.arange(n, device=self.parents.device)).any()):
            raise ValueError("DraftTree: every parent must come before its child")

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> "DraftTree":
        z = torch.zeros(0, dtype=torch.long, device=device)
        return DraftTree(z, z.clone())

    @staticmethod
    def chain(tokens: torch.Tensor, q: torch.Tensor | None = None) -> "DraftTree":
        n = tokens.numel()
        return DraftTree(tokens.long(), torch.arange(-1, n - 1, device=tokens.device), q)

    def __len__(self) -> int:
        return self.tokens.numel()

    def depths(self) -> torch.Tensor:
        """[N] depth of each node; children of the root have depth 1."""
        d = torch.zeros(len(self), dtype=torch.long)
        par = self.parents.tolist()
        for i, p in enumerate(par):
            d[i] = 1 if p < 0 else d[p] + 1
        return d.to(self.tokens.device)

    def ancestor_mask(self) -> torch.Tensor:
        """[N+1, N+1] bool over rows (root first): row r may attend to column c iff c is r or an ancestor."""
        n = len(self)
        m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        m[:, 0] = True
        m[0, 0] = True
        par = self.parents.tolist()
        for i, p in enumerate(par):
            m[i + 1] = m[p + 1]
            m[i + 1, i + 1] = True
        return m.to(self.tokens.device)

    def union(self, other: "DraftTree") -> "DraftTree":
        """Both trees as one trie below the same root: `other`'s nodes that repeat a path of this tree are merged
        into it, the rest appended (topological order kept). Deterministic trees only: drawn siblings' q would no
        longer describe how the merged children were drawn."""
        if self.q is not None or other.q is not None:
            raise ValueError("DraftTree.union: trees with draft distributions q cannot be merged (greedy only)")
        if not len(other):  # the common step where the lookup found no match: nothing to rebuild
            return self
        index: dict[tuple[int, int], int] = {}
        tokens: list[int] = []
        parents: list[int] = []
        for tree in (self, other):
            merged: list[int] = []  # this tree's node -> its node in the union
            for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
                key = (-1 if parent < 0 else merged[parent], token)
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(token)
                    parents.append(key[0])
                merged.append(index[key])
        device = self.tokens.device
        return DraftTree(torch.tensor(tokens, dtype=torch.long, device=device),
                         torch.tensor(parents, dtype=torch.long, device=device))

    def children(self) -> list[list[int]]:
        """children()[r] = node indices whose parent row is r (row 0 = root), in proposal order."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents.tolist()):
            out[p + 1].append(i)
        return out
