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
    # scores[i]: how likely node i is to be accepted, a log-probability never above its parent's (EAGLE/LM: the
    # cumulative draft log-probability; the n-gram lookup: a fixed log-rate per depth). None: the drafter does not
    # rank its nodes. `best` keeps the best-scored ones when a verify must hold fewer.
    scores: torch.Tensor | None = None  # [N] float

    def __post_init__(self):
        n = self.tokens.numel()
        if self.parents.numel() != n:
            raise ValueError(f"DraftTree: {n} tokens but {self.parents.numel()} parents")
        if self.scores is not None and self.scores.numel() != n:
            raise ValueError(f"DraftTree: {n} tokens but {self.scores.numel()} scores")
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
        into it, the rest appended (topological order kept); a merged node keeps the higher score (scores only if
        both trees have them). Deterministic trees only: drawn siblings' q would no longer describe how the merged
        children were drawn."""
        if self.q is not None or other.q is not None:
            raise ValueError("DraftTree.union: trees with draft distributions q cannot be merged (greedy only)")
        if not len(other):  # the common step where the lookup found no match: nothing to rebuild
            return self
        ranked = self.scores is not None and other.scores is not None
        index: dict[tuple[int, int], int] = {}
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        for tree in (self, other):
            merged: list[int] = []  # this tree's node -> its node in the union
            tree_scores = tree.scores.tolist() if ranked else [0.0] * len(tree)
            for token, parent, score in zip(tree.tokens.tolist(), tree.parents.tolist(), tree_scores):
                key = (-1 if parent < 0 else merged[parent], token)
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(token)
                    parents.append(key[0])
                    scores.append(score)
                scores[index[key]] = max(scores[index[key]], score)
                merged.append(index[key])
        return self._subtree(tokens, parents, scores if ranked else None)

    def best(self, n: int) -> "DraftTree":
        """The tree cut to its n best-scored nodes (unranked: the first n), parents before children as before. A
        node never outscores its parent, so the kept nodes hang together (on equal scores the parent, numbered
        first, goes first). Deterministic trees only, as for union."""
        if len(self) <= n:
            return self
        if self.q is not None:
            raise ValueError("DraftTree.best: trees with draft distributions q cannot be cut (greedy only)")
        s = self.scores.tolist() if self.scores is not None else [0.0] * len(self)
        keep = sorted(sorted(range(len(self)), key=lambda i: (-s[i], i))[:n])
        new = {old: i for i, old in enumerate(keep)}
        parents = self.parents.tolist()
        if any(parents[i] >= 0 and parents[i] not in new for i in keep):
            raise ValueError("DraftTree.best: a node scores above its parent")
        tokens = self.tokens.tolist()
        return self._subtree([tokens[i] for i in keep], [new.get(parents[i], -1) for i in keep],
                             None if self.scores is None else [s[i] for i in keep])

    def _subtree(self, tokens: list[int], parents: list[int], scores: list[float] | None) -> "DraftTree":
        device = self.tokens.device
        return DraftTree(torch.tensor(tokens, dtype=torch.long, device=device),
                         torch.tensor(parents, dtype=torch.long, device=device), None,
                         None if scores is None else torch.tensor(scores, device=device))

    def children(self) -> list[list[int]]:
        """children()[r] = node indices whose parent row is r (row 0 = root), in proposal order."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents.tolist()):
            out[p + 1].append(i)
        return out
