"""Draft trees: the one shape every drafter proposes and every verifier consumes.

A tree hangs below the *root*, the last committed token whose KV is not yet in the target cache.
Nodes are numbered 0..N-1 in topological order (parents before children); parent -1 means the root.
Row 0 of any per-position tensor (logits, hidden, q) belongs to the root, row i+1 to node i.
"""
from __future__ import annotations

from array import array
from dataclasses import InitVar, dataclass

import torch


@dataclass(frozen=True)  # its host copy (host_lists) stays the tensors' copy
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
    # the same tokens, parents and scores as host lists, where the maker has them (see HostLists)
    host: InitVar["HostLists | None"] = None

    def __post_init__(self, host: "HostLists | None"):
        n = self.tokens.numel()
        if self.parents.numel() != n:
            raise ValueError(f"DraftTree: {n} tokens but {self.parents.numel()} parents")
        if self.scores is not None and self.scores.numel() != n:
            raise ValueError(f"DraftTree: {n} tokens but {self.scores.numel()} scores")
        object.__setattr__(self, "_host", host)
        if any(p >= i for i, p in enumerate(self.host_lists().parents)):
            raise ValueError("DraftTree: every parent must come before its child")

    def host_lists(self) -> "HostLists":
        """Tokens, parents and scores on the host, read from the device once (on a GPU each read waits for it; the
        engine walks a tree several times a step)."""
        if self._host is None:
            object.__setattr__(self, "_host", HostLists.read(self.tokens, self.parents, self.scores))
        return self._host

    @staticmethod
    def from_lists(tokens: list[int], parents: list[int], scores: list[float] | None, device: torch.device | str,
                   q: torch.Tensor | None = None) -> "DraftTree":
        """A tree made on the host: its tensors in two copies to `device` (one without scores), none read back."""
        ids = torch.tensor([tokens, parents], dtype=torch.long, device=device)
        scores = None if scores is None else array("f", scores).tolist()  # float32, as the tensor holds them
        return DraftTree(ids[0], ids[1], q, None if scores is None else torch.tensor(scores, device=device),
                         host=HostLists(tokens, parents, scores))

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> "DraftTree":
        z = torch.zeros(0, dtype=torch.long, device=device)
        return DraftTree(z, z.clone(), host=HostLists([], [], None))

    @staticmethod
    def chain(tokens: torch.Tensor, q: torch.Tensor | None = None) -> "DraftTree":
        n = tokens.numel()
        return DraftTree(tokens.long(), torch.arange(-1, n - 1, device=tokens.device), q)

    def __len__(self) -> int:
        return self.tokens.numel()

    def depth_list(self) -> list[int]:
        """Depth of each node; children of the root have depth 1."""
        d: list[int] = []
        for p in self.host_lists().parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def depths(self) -> torch.Tensor:
        """[N] depth of each node, on the tree's device."""
        return torch.tensor(self.depth_list(), dtype=torch.long, device=self.tokens.device)

    def ancestor_rows(self) -> list[list[bool]]:
        """[N+1][N+1] over rows (root first): row r may attend to column c iff c is r or an ancestor."""
        n = len(self)
        rows = [[True] + [False] * n]
        for i, p in enumerate(self.host_lists().parents):
            row = rows[p + 1].copy()
            row[i + 1] = True
            rows.append(row)
        return rows

    def ancestor_mask(self) -> torch.Tensor:
        """[N+1, N+1] bool ancestor_rows, on the tree's device."""
        return torch.tensor(self.ancestor_rows(), dtype=torch.bool, device=self.tokens.device)

    def union(self, other: "DraftTree", limit: int | None = None) -> "DraftTree":
        """Both trees as one trie below the same root: `other`'s nodes that repeat a path of this tree are merged
        into it, the rest appended (topological order kept); a merged node keeps the higher score (scores only if
        both trees have them). Deterministic trees only: drawn siblings' q would no longer describe how the merged
        children were drawn. `limit`: cut to its best `limit` nodes (as `best`) before it is made."""
        if self.q is not None or other.q is not None:
            raise ValueError("DraftTree.union: trees with draft distributions q cannot be merged (greedy only)")
        if not len(other):  # the common step where the lookup found no match: nothing to rebuild
            return self if limit is None else self.best(limit)
        ranked = self.scores is not None and other.scores is not None
        index: dict[tuple[int, int], int] = {}
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        for tree in (self, other):
            merged: list[int] = []  # this tree's node -> its node in the union
            h = tree.host_lists()
            for token, parent, score in zip(h.tokens, h.parents, h.scores if ranked else [0.0] * len(tree)):
                key = (-1 if parent < 0 else merged[parent], token)
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(token)
                    parents.append(key[0])
                    scores.append(score)
                scores[index[key]] = max(scores[index[key]], score)
                merged.append(index[key])
        union = HostLists(tokens, parents, scores if ranked else None)
        if limit is not None and len(tokens) > limit:
            union = union.best(limit)
        return DraftTree.from_lists(union.tokens, union.parents, union.scores, self.tokens.device)

    def best(self, n: int) -> "DraftTree":
        """The tree cut to its n best-scored nodes (unranked: the first n), parents before children as before. A
        node never outscores its parent, so the kept nodes hang together (on equal scores the parent, numbered
        first, goes first). Deterministic trees only, as for union."""
        if len(self) <= n:
            return self
        if self.q is not None:
            raise ValueError("DraftTree.best: trees with draft distributions q cannot be cut (greedy only)")
        cut = self.host_lists().best(n)
        return DraftTree.from_lists(cut.tokens, cut.parents, cut.scores, self.tokens.device)

    def children(self) -> list[list[int]]:
        """children()[r] = node indices whose parent row is r (row 0 = root), in proposal order."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.host_lists().parents):
            out[p + 1].append(i)
        return out


@dataclass(frozen=True)
class HostLists:
    """A tree's tokens, parents and scores (None: unranked) as Python lists."""
    tokens: list[int]
    parents: list[int]
    scores: list[float] | None

    @staticmethod
    def read(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor | None) -> "HostLists":
        """One read from the device: tokens and parents, and scores if any, copied together (float64 holds every
        token id and float32 score exactly)."""
        rows = [tokens.double(), parents.double()] + ([] if scores is None else [scores.double()])
        t, p, *s = torch.stack(rows).tolist()
        return HostLists([int(x) for x in t], [int(x) for x in p], s[0] if s else None)

    def best(self, n: int) -> "HostLists":
        """The n best-scored nodes (DraftTree.best)."""
        s = self.scores if self.scores is not None else [0.0] * len(self.tokens)
        keep = sorted(sorted(range(len(s)), key=lambda i: (-s[i], i))[:n])
        new = {old: i for i, old in enumerate(keep)}
        if any(self.parents[i] >= 0 and self.parents[i] not in new for i in keep):
            raise ValueError("DraftTree.best: a node scores above its parent")
        return HostLists([self.tokens[i] for i in keep], [new.get(self.parents[i], -1) for i in keep],
                         None if self.scores is None else [s[i] for i in keep])
