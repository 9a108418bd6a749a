"""SpecAttn layer map: which draft layer's attention stands in for each target layer's.

S[i][j] = -KL(A_target_j || A_draft_i), averaged over calibration rows (one row = one query's attention
distribution over keys). Every target layer j gets a draft layer m(j), non-decreasing in j (deeper target
layers look like deeper draft layers; monotonicity also keeps the map from overfitting noise in S), chosen to
maximise sum_j S[m(j)][j]. The first `dense_first` target layers keep full attention (marked -1): early layers
attend broadly and are cheap to keep exact.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

DENSE = -1


def kl_similarity(att_target: torch.Tensor, att_draft: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """att_target [Lt, ..., S], att_draft [Ld, ..., S] (rows are distributions over S keys) -> S [Ld, Lt] fp64.

    Both must share the row layout [..., S] (average or select heads beforehand if head counts differ).
    Zero target probabilities contribute 0 (p log p -> 0); draft probabilities are floored at eps so a key the
    draft ignores costs a large but finite penalty.
    """
    if att_target.dim() < 2 or att_draft.dim() < 2 or att_target.shape[1:] != att_draft.shape[1:]:
        raise ValueError(f"expected att_target [Lt, ..., S] and att_draft [Ld, ..., S] with the same row layout, "
                         f"got {tuple(att_target.shape)} and {tuple(att_draft.shape)}")
    S = att_target.shape[-1]
    log_q = att_draft.reshape(att_draft.shape[0], -1, S).double().clamp_min(eps).log()  # [Ld, rows, S]
    scores = torch.empty(att_draft.shape[0], att_target.shape[0], dtype=torch.float64)
    for j, a in enumerate(att_target):  # one target layer at a time bounds memory to Ld x rows x S
        p = a.reshape(-1, S).double()
        kl = (p * (p.clamp_min(eps).log() - log_q)).sum(-1).mean(-1)  # [Ld]
        scores[:, j] = -kl
    return scores


def monotone_layer_map(S: torch.Tensor | Sequence[Sequence[float]], dense_first: int = 0) -> list[int]:
    """Best non-decreasing map target layer -> draft layer for S [Ld, Lt]; the first `dense_first` are -1.

    Dynamic programming, O(Lt * Ld): best[j][i] = S[i][j] + max_{i' <= i} best[j-1][i'], the inner max being a
    running prefix maximum. Ties are broken deterministically (earliest draft layer).
    """
    S = torch.as_tensor(S, dtype=torch.float64)
    if S.dim() != 2 or S.shape[0] == 0 or not torch.isfinite(S).all():
        raise ValueError(f"expected a finite score matrix [Ld >= 1, Lt], got shape {tuple(S.shape)}")
    n_draft, n_target = S.shape
    if not 0 <= dense_first <= n_target:
        raise ValueError(f"dense_first must be in [0, {n_target}] (number of target layers), got {dense_first}")
    scores = S.tolist()
    best = [0.0] * n_draft
    back: list[list[int]] = []  # back[k][i]: draft layer of the previous column on the best path ending at i
    for j in range(dense_first, n_target):
        prefix_arg = [0] * n_draft
        for i in range(1, n_draft):
            prefix_arg[i] = i if best[i] > best[prefix_arg[i - 1]] else prefix_arg[i - 1]
        back.append(prefix_arg)
        best = [scores[i][j] + best[prefix_arg[i]] for i in range(n_draft)]
    path: list[int] = []
    i = max(range(n_draft), key=lambda k: (best[k], -k))
    for prefix_arg in reversed(back):
        path.append(i)
        i = prefix_arg[i]
    return [DENSE] * dense_first + path[::-1]


@dataclass(frozen=True)
class LayerMap:
    mapping: tuple[int, ...]  # target layer -> draft layer, DENSE (-1) for the first dense_first layers
    scores: tuple[tuple[float, ...], ...]  # S [Ld][Lt] the map was fitted on
    dense_first: int = 0

    def __post_init__(self):
        n_draft, n_target = len(self.scores), len(self.scores[0]) if self.scores else 0
        if n_draft == 0 or any(len(row) != n_target for row in self.scores):
            raise ValueError(f"scores must be a non-empty rectangular [Ld][Lt] matrix, got row lengths "
                             f"{[len(row) for row in self.scores]}")
        if not 0 <= self.dense_first <= n_target:
            raise ValueError(f"dense_first must be in [0, {n_target}] (number of target layers), "
                             f"got {self.dense_first}")
        if len(self.mapping) != n_target:
            raise ValueError(f"mapping has {len(self.mapping)} entries, expected one per target layer ({n_target})")
        if list(self.mapping[: self.dense_first]) != [DENSE] * self.dense_first:
            raise ValueError(f"the first {self.dense_first} target layers must be dense (-1): {self.mapping}")
        mapped = self.mapping[self.dense_first:]
        if any(not 0 <= m < n_draft for m in mapped) or any(a > b for a, b in zip(mapped, mapped[1:])):
            raise ValueError(f"mapping after the dense layers must be non-decreasing in [0, {n_draft}): "
                             f"{self.mapping}")

    @classmethod
    def fit(cls, S: torch.Tensor, dense_first: int = 0) -> LayerMap:
        S = torch.as_tensor(S, dtype=torch.float64)
        return cls(tuple(monotone_layer_map(S, dense_first)), tuple(map(tuple, S.tolist())), dense_first)

    @property
    def total_score(self) -> float:
        return math.fsum(self.scores[m][j] for j, m in enumerate(self.mapping) if m != DENSE)

    def to_json(self) -> str:
        return json.dumps({"mapping": list(self.mapping), "scores": [list(r) for r in self.scores],
                           "dense_first": self.dense_first})

    @classmethod
    def from_json(cls, text: str) -> LayerMap:
        d = json.loads(text)
        if set(d) != {"mapping", "scores", "dense_first"}:
            raise ValueError(f"layer map JSON must have keys mapping, scores, dense_first; got {sorted(d)}")
        return cls(tuple(d["mapping"]), tuple(map(tuple, d["scores"])), d["dense_first"])


def plot_layer_map(S: torch.Tensor, mapping: Sequence[int], path: str | Path) -> Path:
    """Heatmap of S [Ld, Lt] (target layers across, draft layers up) with the chosen map drawn over it."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state, renders with Agg

    S = torch.as_tensor(S, dtype=torch.float64)
    if len(mapping) != S.shape[1]:
        raise ValueError(f"mapping has {len(mapping)} entries, expected one per target layer ({S.shape[1]})")
    fig = Figure(figsize=(max(4.0, 0.3 * S.shape[1] + 2), max(2.5, 0.4 * S.shape[0] + 1.5)))
    ax = fig.add_subplot()
    image = ax.imshow(S.numpy(), aspect="auto", origin="lower", cmap="viridis")
    fig.colorbar(image, ax=ax, label="-KL(target || draft)")
    mapped = [(j, m) for j, m in enumerate(mapping) if m != DENSE]
    if mapped:
        ax.plot(*zip(*mapped), color="red", marker="o", markersize=3, linewidth=1.5, label="layer map")
        ax.legend(loc="upper left", fontsize="small")
    for j, m in enumerate(mapping):
        if m == DENSE:
            ax.axvspan(j - 0.5, j + 0.5, color="white", alpha=0.5, hatch="//")
    ax.set_xlabel("target layer")
    ax.set_ylabel("draft layer")
    ax.set_yticks(range(S.shape[0]))
    ax.set_title("SpecAttn layer map")
    path = Path(path)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path
