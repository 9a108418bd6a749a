"""What every recipe reads of the frozen target: its features, computed or read from prepare's cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.target.model import Taps, Transformer
from train.losses import topk_accuracy


@dataclass(frozen=True)
class TargetOutputs:
    features: Tensor  # [B, T, H] last hidden after the final norm
    mask: Tensor  # [B, T] bool, assistant tokens
    streams: Tensor | None = None  # [B, T, n * H]: the residual streams entering the layers asked for, if any

    @property
    def drafter_input(self) -> Tensor:
        """What a drafter's committed pairs carry: the streams where it reads them, else the final hidden state."""
        return self.features if self.streams is None else self.streams


@torch.no_grad()
def target_features(target: Transformer, batch: dict, streams: tuple[int, ...] = ()) -> TargetOutputs:
    """The frozen target's final hidden states, and the residual streams entering the `streams` layers: read from
    the batch where prepare cached them (ForwardOutput.with_streams), else computed."""
    if "features" in batch:
        cached = batch["features"].to(target.dtype)
        dim = target.config.dim
        if cached.shape[-1] != dim * (1 + len(streams)):
            raise ValueError(f"prepare's feature cache holds {cached.shape[-1] // dim - 1} residual streams beside "
                             f"the final hidden state, this drafter reads {len(streams)}: rerun prepare")
        features = cached.split(dim, -1)
    else:
        ids = batch["input_ids"]
        B, T = ids.shape
        positions = torch.arange(T, device=ids.device).expand(B, T)
        out = target(ids, target.new_cache(B, T), positions, taps=Taps.entering(streams), no_logits=True)
        features = out.with_streams(streams).split(target.config.dim, -1)
    aux = torch.cat(features[1:], -1) if streams else None
    return TargetOutputs(features[0], batch["loss_mask"].bool(), aux)


def top1(draft_logits: Tensor, target_logits: Tensor, mask: Tensor) -> float:
    return topk_accuracy(draft_logits, target_logits.argmax(-1), mask)[1]
