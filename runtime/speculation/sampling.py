"""Sampling parameters and the one warp from logits to probabilities.

The target and every drafter warp their logits with the same `warp`, so the draft distribution q and the
target distribution p that verification compares live on the same support and verification stays lossless.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"SamplingParams: temperature={self.temperature!r}, expected a finite number >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams: top_p={self.top_p!r}, expected 0 < top_p <= 1")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams: top_k={self.top_k!r}, expected an int >= 0 (0 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities: temperature, then top-k, then top-p.

    Greedy params give the point mass on the argmax (the temperature -> 0 limit), so code that samples from
    warped probabilities reproduces greedy decoding.
    """
    if params.greedy:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    x = logits.float() / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th logit survive, as in HF
    probs = x.softmax(-1)
    return _nucleus(probs, params.top_p) if params.top_p < 1.0 else probs


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most probable tokens until the ones before the next hold top_p of the mass; renormalise.

    Partial sorts (topk) of growing width instead of one full sort: nuclei of real LMs are usually a few dozen
    tokens, and a full sort of a 49k vocabulary costs about as much as a target forward on CPU.
    """
    vocab = probs.shape[-1]
    width = 64
    while True:
        if width >= vocab:
            top, order = probs.sort(dim=-1, descending=True)
        else:
            top, order = probs.topk(width, dim=-1)
        cumulative = top.cumsum(-1)
        # done when the first token outside the top `width` would be dropped in every row
        if width >= vocab or bool((cumulative[..., -1] >= top_p).all()):
            break
        width *= 16
    kept = torch.zeros_like(probs).scatter(-1, order, top * (cumulative - top < top_p))
    return kept / kept.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of [..., V] probabilities -> [...] long. The generator must live on probs' device."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
