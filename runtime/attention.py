"""Attention behind one small interface: a registry of backends, picked per device, overridable.

A backend computes softmax(q k^T / sqrt(D)) v for queries q [B, H, T, D] over the live keys and values
[B, Hkv, S, D] (grouped-query: each of the Hkv kv heads serves H / Hkv query heads). `mask` [B, 1, T, S] says
which keys each query may see (None: every key); `keep` [B, Hkv, 1 or T, S] -- SpecAttn sparse verification --
narrows each kv head further to the keys it reads, one set for every query or one per query.

Choice: the first registered backend in AUTO_ORDER that runs on the tensors' device, unless the environment
variable DRAFTSMITH_ATTENTION_BACKEND names one. "sdpa" (torch SDPA) runs everywhere and is the reference every
other backend is compared with. "triton_sparse" (CUDA) reads only SpecAttn's kept keys; "flashinfer" (CUDA) where
the package is installed.

SpecAttn (`SpecAttnConfig`, `kept_keys`): target layer j >= dense_first, mapped by the layer map to draft layer
i, reads per kv head only the prefix keys holding top_p of draft layer i's attention (a sorting-free threshold,
kernels.topp), plus the first `sink` keys, the `recent` newest prefix keys and every new (root/tree) token.
"""
from __future__ import annotations

import abc
import importlib.util
import json
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.sdpa import sdpa_kernels
from kernels.sparse_attention import kept_positions, sparse_attention_triton
from kernels.topp import topp_mask

BACKEND_ENV = "DRAFTSMITH_ATTENTION_BACKEND"
# fastest first, as measured; a name is skipped until a backend registers it. flashinfer is correct on an H100
# but was slower than SDPA at every size measured (docs/gpu.md), so it runs only when named; so does
# triton_sparse until it is measured on a GPU.
AUTO_ORDER = ("sdpa",)


class AttentionBackend(abc.ABC):
    name: ClassVar[str]

    @staticmethod
    @abc.abstractmethod
    def runs_on(device: torch.device) -> bool:
        """Whether this backend can run on tensors of `device`."""

    @abc.abstractmethod
    def __call__(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None,
                 keep: Tensor | None) -> Tensor:
        """q [B, H, T, D], keys/values [B, Hkv, S, D], mask [B, 1, T, S] or None, keep [B, Hkv, 1|T, S] or None
        -> [B, H, T, D]. A mask is read-only once passed: every layer of a forward gets the same one, and a
        backend may keep what it derived from it for the next call with that same tensor. So is `keep`: the layers
        mapped to one draft layer get the same one (SpecAttnConfig.layer_keep)."""


BACKENDS: dict[str, AttentionBackend] = {}


def register_backend(backend: AttentionBackend) -> AttentionBackend:
    BACKENDS[backend.name] = backend
    return backend


def pick_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    """`name`, else $DRAFTSMITH_ATTENTION_BACKEND, else the first of AUTO_ORDER that runs on `device`."""
    name = name or os.environ.get(BACKEND_ENV) or None
    if name is None:
        return next(BACKENDS[n] for n in AUTO_ORDER if n in BACKENDS and BACKENDS[n].runs_on(device))
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not available; expected one of {sorted(BACKENDS)}")
    if not BACKENDS[name].runs_on(device):
        raise ValueError(f"attention backend {name!r} cannot run on device {device.type!r}")
    return BACKENDS[name]


def _grouped(q: Tensor, keys: Tensor, mask: Tensor | None, keep: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Grouped-query attention without repeating KV: fold each group's query heads into the row axis,
    q [B, H, T, D] -> [B, Hkv, G*T, D], and the mask (narrowed by `keep`) to [B, 1|Hkv, G*T, S]."""
    B, H, T, D = q.shape
    G = H // keys.shape[1]
    if keep is not None:
        mask = keep if mask is None else mask & keep
    return q.reshape(B, -1, G * T, D), None if mask is None else mask.repeat(1, 1, G, 1)


def exact_dtype(q: Tensor) -> torch.dtype:
    """The dtype attention computes in. bf16/fp16 CPU inference computes in fp64: SDPA's fp32 result for a query
    depends on how many queries and keys the call has (its blocking), and rounded to bf16 those last-bit
    differences flip whole bf16 steps, so a tree verify and a one-token decode of the same token disagree and
    greedy speculation is not lossless. In fp64 they agree bit for bit after rounding (every other op of a
    forward, the matmuls included, computes a row the same way whatever the batch). Costs ~2 ms of a 28 ms
    SmolLM2 decode step."""
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and not torch.is_grad_enabled():
        return torch.float64
    return q.dtype


class SdpaBackend(AttentionBackend):
    """torch SDPA: the CPU path and the GPU reference. Sparse verification masks the skipped keys, so it gives
    the sparse result exactly but does not save the reads themselves."""

    name = "sdpa"

    @staticmethod
    def runs_on(device: torch.device) -> bool:
        return True

    def __init__(self):
        self._mask: tuple[Tensor, Tensor] | None = None  # (a forward's mask, its grouped additive form)

    def __call__(self, q, keys, values, mask, keep):
        dtype = exact_dtype(q)
        if keep is None and mask is not None:  # every layer of a forward gets the same mask: convert it once
            qg = q.reshape(q.shape[0], keys.shape[1], -1, q.shape[-1])
            mask_g = self._additive(mask, qg.shape[2] // q.shape[2], dtype)
        else:
            qg, mask_g = _grouped(q, keys, mask, keep)
        with sdpa_kernels(q.device):
            out = F.scaled_dot_product_attention(qg.to(dtype), keys.to(dtype), values.to(dtype), attn_mask=mask_g)
        return out.to(q.dtype).reshape(q.shape)

    def _additive(self, mask: Tensor, groups: int, dtype: torch.dtype) -> Tensor:
        """mask [B, 1, T, S] bool -> [B, 1, G*T, S] of 0 / -inf in `dtype`, kept for the next call with the same
        mask object (held here, so its id cannot be reused; masks are read-only, see AttentionBackend). Saves
        ~1 ms of a 7-token SmolLM2 verify."""
        compiling = torch.compiler.is_compiling()  # a compiled step keeps no memo: dynamo would guard on its state
        last = None if compiling else self._mask  # one read: another thread may replace it
        if last is not None and last[0] is mask and last[1].dtype == dtype and last[1].shape[2] == groups * mask.shape[2]:
            return last[1]
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        additive = additive.repeat(1, 1, groups, 1)
        if not compiling:
            self._mask = (mask, additive)
        return additive


class TritonSparseBackend(AttentionBackend):
    """SpecAttn sparse verification through kernels/sparse_attention.py: a sparse layer reads only the keys each kv
    head keeps, where sdpa reads them all and masks. Dense calls (no `keep`) go to sdpa. Runs on CUDA, and on the
    CPU inside Triton's interpreter (TRITON_INTERPRET=1), where the tests run it."""

    name = "triton_sparse"

    @staticmethod
    def runs_on(device: torch.device) -> bool:
        return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"

    def __init__(self):
        self._listed: tuple[Tensor, tuple[Tensor, Tensor]] | None = None  # (a keep mask, its kept positions)

    def __call__(self, q, keys, values, mask, keep):
        if keep is None:
            return BACKENDS["sdpa"](q, keys, values, mask, keep)
        last = self._listed  # the layers mapped to one draft layer share its keep object (layer_keep): list it once
        if last is None or last[0] is not keep:
            last = self._listed = (keep, kept_positions(keep))
        return sparse_attention_triton(q, keys, values, mask, keep, last[1])


register_backend(SdpaBackend())
register_backend(TritonSparseBackend())
# flashinfer (issue #8, GPU only) registers when the package is installed (found without importing it), with
# runs_on = CUDA (kernels/flashinfer_attention.py): decode and tree verification over the paged cache in place, and
# SpecAttn sparse verification through its variable block-sparse wrapper. fp32, batch > 1 and graph capture go to
# sdpa from inside it.
if importlib.util.find_spec("flashinfer") is not None:
    from kernels.flashinfer_attention import FlashInferBackend

    register_backend(FlashInferBackend())  # type: ignore[arg-type]


def attention_weights(q: Tensor, keys: Tensor, mask: Tensor | None) -> Tensor:
    """The softmax weights [B, H, T, S] that attention applies (for taps and calibration; reference math)."""
    qg, mask_g = _grouped(q, keys, mask, None)
    scores = qg @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask_g is not None:
        scores = scores.masked_fill(~mask_g, float("-inf"))
    return scores.softmax(-1).view(*q.shape[:3], keys.shape[2])


# ---------------------------------------------------------------- SpecAttn key selection


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

    def layer_keep(self, keep: Tensor) -> list[Tensor | None]:
        """kept_keys' [Ld, Hkv, R, S] -> per target layer the keep mask [1, Hkv, R, S] of the draft layer it is
        mapped to, None where it attends densely."""
        if max(self.layer_map, default=-1) >= keep.shape[0]:
            raise ValueError(f"SpecAttnConfig: layer_map={self.layer_map} names a draft layer beyond the drafter's "
                             f"{keep.shape[0]}")
        views = {i: keep[i][None] for i in set(self.layer_map) if i >= 0}  # one per draft layer, for backends to reuse
        return [views[i] if j >= self.dense_first and i >= 0 else None for j, i in enumerate(self.layer_map)]


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
    nothing about any one of them: every kv head then keeps the keys of all draft heads averaged.
    """
    Ld, H, R, K = draft_attention.shape
    if prefix_len.shape != (R,) or int(prefix_len.max()) > min(K, n_keys):
        raise ValueError(f"draft attention {tuple(draft_attention.shape)} does not fit prefix lengths "
                         f"{tuple(prefix_len.shape)} <= {min(K, n_keys)}")
    if top_p >= 1.0:  # every key by definition: no threshold search, no rounding of the mass near 1
        return torch.ones(Ld, n_kv_heads, R, n_keys, dtype=torch.bool, device=draft_attention.device)
    key = torch.arange(n_keys, device=draft_attention.device)
    always = (key < sink) | (key >= prefix_len[:, None] - recent)  # [R, n_keys]
    w = draft_attention.float()
    if H % n_kv_heads:
        w = w.mean(1, keepdim=True).expand(Ld, n_kv_heads, R, K)
    else:
        w = w.view(Ld, n_kv_heads, H // n_kv_heads, R, K).mean(2)
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
