"""Attention behind one small interface: a registry of backends, picked per device, overridable.

A backend computes softmax(q k^T / sqrt(D)) v for queries q [B, H, T, D] over the live keys and values
[B, Hkv, S, D] (grouped-query: each of the Hkv kv heads serves H / Hkv query heads). `mask` [B, 1, T, S] says
which keys each query may see (None: every key), or is a `Causal`: the plain causal case (a prefill), which a backend
may compute without materialising a mask; `keep` [B, Hkv, 1 or T, S] -- SpecAttn sparse verification -- narrows
each kv head further to the keys it reads, one set for every query or one per query.

Choice: the first registered backend in AUTO_ORDER that runs on the tensors' device, unless the environment
variable DRAFTSMITH_ATTENTION_BACKEND names one.
"""
from __future__ import annotations

import abc
import math
import os
from typing import ClassVar

import torch
from torch import Tensor

from runtime.target.attention.masks import Causal, Mask, dense_mask
from runtime.target.thread_flag import ThreadFlag

BACKEND_ENV = "DRAFTSMITH_ATTENTION_BACKEND"
# fastest first, as measured (docs/gpu.md, "Current figures"); flashinfer and triton_sparse run only when named
# until a GPU has shown them faster than sdpa
AUTO_ORDER = ("sdpa",)


class AttentionBackend(abc.ABC):
    name: ClassVar[str]

    @staticmethod
    @abc.abstractmethod
    def runs_on(device: torch.device) -> bool:
        """Whether this backend can run on tensors of `device`."""

    @abc.abstractmethod
    def __call__(self, q: Tensor, keys: Tensor, values: Tensor, mask: Mask, keep: Tensor | None) -> Tensor:
        """q [B, H, T, D], keys/values [B, Hkv, S, D], mask [B, 1, T, S], Causal or None, keep [B, Hkv, 1|T, S] or None
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


def grouped(q: Tensor, keys: Tensor, mask: Mask, keep: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Grouped-query attention without repeating KV: fold each group's query heads into the row axis,
    q [B, H, T, D] -> [B, Hkv, G*T, D], and the mask (narrowed by `keep`) to [B, 1|Hkv, G*T, S]."""
    B, H, T, D = q.shape
    G = H // keys.shape[1]
    mask = dense_mask(mask, q)
    if keep is not None:
        mask = keep if mask is None else mask & keep
    return q.reshape(B, -1, G * T, D), None if mask is None else mask.repeat(1, 1, G, 1)


_drafting = ThreadFlag()  # per thread: a draft proposing in one thread leaves another's verify exact


def draft_attention_dtype():
    """Inside, attention computes in its inputs' own dtype, as in a prefill: a draft's forwards, whose results no
    decode is compared with, skip exact_dtype's fp64 (most of a draft step at a few thousand tokens of context)."""
    return _drafting.raised()


def exact_dtype(q: Tensor, mask: Mask = None) -> torch.dtype:
    """The dtype attention computes in. bf16/fp16 CPU inference computes in fp64: SDPA's fp32 result for a query
    depends on how many queries and keys the call has (its blocking), and rounded to bf16 those last-bit
    differences flip whole bf16 steps, so a tree verify and a one-token decode of the same token disagree and
    greedy speculation is not lossless. In fp64 they agree bit for bit after rounding (every other op of a
    forward, the matmuls included, computes a row the same way whatever the batch: runtime.target.cpu_packing pads
    and slices bf16 products so that it does). A Causal mask is a prefill's, whose rows no decode is compared with:
    it computes in q's own dtype, as the model's reference does."""
    if isinstance(mask, Causal) or _drafting.on:
        return q.dtype
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and not torch.is_grad_enabled():
        return torch.float64
    return q.dtype


def last_query_row(q: Tensor, mask: Mask) -> tuple[Tensor, Mask]:
    """The last query [B, H, 1, D] and its mask: it sees every key a causal mask lets any query see."""
    return q[:, :, -1:], mask[:, :, -1:] if isinstance(mask, Tensor) else None


def attention_weights(q: Tensor, keys: Tensor, mask: Mask, last_row: bool = False) -> Tensor:
    """The softmax weights [B, H, T, S] that attention applies (for taps and calibration; reference math); with
    `last_row` the last query's only, [B, H, 1, S]."""
    if last_row:
        q, mask = last_query_row(q, mask)
    qg, mask_g = grouped(q, keys, mask, None)
    scores = qg @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask_g is not None:
        scores = scores.masked_fill(~mask_g, float("-inf"))
    return scores.softmax(-1).view(*q.shape[:3], keys.shape[2])
