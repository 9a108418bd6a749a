"""SpecAttn key selection: target layer j >= dense_first, mapped by the layer map to draft layer i, reads per kv head
only the prefix keys holding top_p of draft layer i's attention (a sorting-free threshold, kernels.topp), plus the
first `sink` keys, the `recent` newest prefix keys and every new (root/tree) token."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.topp import topp_mask


@dataclass(frozen=True)
class SpecAttnConfig:
    """Sparse verification settings (from calibrate's specattn.json). Lossy w.r.t. the dense target by design:
    top_p trades KV reads for perplexity; top_p = 1.0 reads every key and equals dense verification exactly."""
    layer_map: tuple[int, ...]  # target layer -> draft layer whose attention selects its keys; -1 = dense
    top_p: float
    dense_first: int = 2  # target layers below this always attend densely, whatever the map says
    sink: int = 4  # first keys always read: attention sinks (EAGLE's own sink is its first pair, target key 1)
    recent: int = 8  # newest prefix keys always read: local context the draft's view may miss

    def __post_init__(self):
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SpecAttnConfig: top_p={self.top_p!r}, expected a number in (0, 1]")
        for name in ("dense_first", "sink", "recent"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"SpecAttnConfig: {name}={v!r}, expected an int >= 0")
        if any(not isinstance(m, int) or m < -1 for m in self.layer_map):
            raise ValueError(f"SpecAttnConfig: layer_map={self.layer_map}, expected draft layers >= 0 or -1 (dense)")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> SpecAttnConfig:
        """The settings calibrate writes as specattn.json (carried into the bundle for serving)."""
        d = json.loads(text)
        names = {f.name for f in fields(SpecAttnConfig)}
        if not isinstance(d, dict) or not set(d) <= names or "layer_map" not in d or "top_p" not in d:
            raise ValueError(f"SpecAttn settings must be a JSON object with layer_map, top_p and optionally "
                             f"{sorted(names - {'layer_map', 'top_p'})}; got {text[:80]!r}")
        return SpecAttnConfig(**{**d, "layer_map": tuple(d["layer_map"])})

    def sparse_layers(self) -> dict[int, int]:
        """Target layer -> the draft layer choosing its keys, for the target layers that verify sparsely."""
        return {j: i for j, i in enumerate(self.layer_map) if j >= self.dense_first and i >= 0}

    def draft_layers(self) -> tuple[int, ...]:
        """The draft layers whose attention chooses some target layer's keys, ascending: the rest need not be read."""
        return tuple(sorted(set(self.sparse_layers().values())))

    def over(self, layers: tuple[int, ...]) -> SpecAttnConfig:
        """These settings over a draft attention holding only `layers` (a superset of draft_layers), in that order."""
        index, sparse = {i: k for k, i in enumerate(layers)}, self.sparse_layers()
        return replace(self, layer_map=tuple(index[sparse[j]] if j in sparse else -1
                                             for j in range(len(self.layer_map))))

    def layer_keep(self, keep: Tensor) -> list[Tensor | None]:
        """kept_keys' [Ld, Hkv, R, S] -> per target layer the keep mask [1, Hkv, R, S] of the draft layer it is
        mapped to, None where it attends densely."""
        if max(self.layer_map, default=-1) >= keep.shape[0]:
            raise ValueError(f"SpecAttnConfig: layer_map={self.layer_map} names a draft layer beyond the drafter's "
                             f"{keep.shape[0]}")
        sparse = self.sparse_layers()
        views = {i: keep[i][None] for i in set(sparse.values())}  # one per draft layer, for backends to reuse
        return [views[sparse[j]] if j in sparse else None for j in range(len(self.layer_map))]


def query_slices(attention: Tensor, rows: int) -> Iterator[Tensor]:
    """[L, H, T, T] -> `rows` queries at a time, each over the keys up to its last query."""
    T = attention.shape[-1]
    return (attention[:, :, start:start + rows, :min(start + rows, T)] for start in range(0, T, rows))


def head_groups(attention: Tensor, n_kv_heads: int) -> Tensor:
    """[..., H, R, K] -> [..., n_kv_heads, R, K]: the draft heads averaged per target kv head (groups of H /
    n_kv_heads), or [..., 1, R, K], all of them averaged, where they do not group (another model's heads);
    n_kv_heads 0: every head as it is."""
    H = attention.shape[-3]
    if not n_kv_heads:
        return attention
    if H % n_kv_heads:
        return attention.mean(-3, keepdim=True)
    return attention.unflatten(-3, (n_kv_heads, H // n_kv_heads)).mean(-3)


def kept_keys(draft_attention: Tensor, prefix_len: Tensor, n_keys: int, n_kv_heads: int, top_p: float,
              sink: int, recent: int) -> Tensor:
    """draft_attention [Ld, H, R, K]: per draft layer and head, R query rows' attention over target key positions
    (weights at or beyond a row's prefix_len [R] are ignored; rows need not be normalised) -> keep
    [Ld, Hkv, R, n_keys] bool.

    Always kept: the first `sink` keys, the `recent` newest prefix keys, and the keys at or beyond prefix_len (the
    tokens being verified). Of the other prefix keys, per kv head, the minimal set holding top_p of the draft
    attention they receive (its query heads averaged; ties kept): the mass sinks absorb says nothing about which
    other keys matter, so it does not count toward p. A key the draft gives no weight is never selected.
    Draft heads that do not group onto the target's kv heads (another model's, as an `lm` drafter's may be) say
    nothing about any one of them: every kv head then keeps the keys of all draft heads averaged (head_groups: a
    draft attention already so averaged gives the same keys).
    """
    Ld, H, R, K = draft_attention.shape
    if prefix_len.shape != (R,) or int(prefix_len.max()) > min(K, n_keys):
        raise ValueError(f"draft attention {tuple(draft_attention.shape)} does not fit prefix lengths "
                         f"{tuple(prefix_len.shape)} <= {min(K, n_keys)}")
    if top_p >= 1.0:  # every key by definition: no threshold search, no rounding of the mass near 1
        return torch.ones(Ld, n_kv_heads, R, n_keys, dtype=torch.bool, device=draft_attention.device)
    key = torch.arange(n_keys, device=draft_attention.device)
    always = (key < sink) | (key >= prefix_len[:, None] - recent)  # [R, n_keys]
    w = head_groups(draft_attention.float(), n_kv_heads).expand(Ld, n_kv_heads, R, K)
    w = F.pad(w[..., :n_keys], (0, max(0, n_keys - K))) * ~always
    w = w / w.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return topp_mask(w, top_p)[0] & (w > 0) | always  # all-zero rows: the threshold is 0, yet nothing is needed


def kv_reads(layer_keep: list[Tensor | None], visible: Tensor, n_kv_heads: int) -> tuple[int, int]:
    """(reads, dense reads) of one forward, counted per layer and kv head over the `visible` [R, S] keys (those
    some query may attend): a sparse layer reads the kept ones."""
    dense = n_kv_heads * int(visible.sum())
    sparse = [(k & visible).sum() for k in layer_keep if k is not None]
    reads = dense * (len(layer_keep) - len(sparse)) + (int(torch.stack(sparse).sum()) if sparse else 0)  # one sync
    return reads, len(layer_keep) * dense
