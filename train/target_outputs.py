"""What every recipe reads of the frozen target: its features, computed or read from prepare's cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.model import Transformer
from train.losses import topk_accuracy


@dataclass(frozen=True)
class TargetOutputs:
    features: Tensor  # [B, T, H] last hidden after the final norm
    mask: Tensor  # [B, T] bool, assistant tokens


@torch.no_grad()
def target_features(target: Transformer, batch: dict) -> TargetOutputs:
    """The frozen target's features: read from the batch when prepare cached them (offline), else computed."""
    if "features" in batch:
        return TargetOutputs(batch["features"].to(target.dtype), batch["loss_mask"].bool())
    ids = batch["input_ids"]
    B, T = ids.shape
    cache = target.new_cache(B, T)
    positions = torch.arange(T, device=ids.device).expand(B, T)
    out = target.run(ids, cache, positions, no_logits=True)
    return TargetOutputs(out.hidden, batch["loss_mask"].bool())


def top1(draft_logits: Tensor, target_logits: Tensor, mask: Tensor) -> float:
    return topk_accuracy(draft_logits, target_logits.argmax(-1), mask)[1]
