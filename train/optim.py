"""What a training run steps: the trainable parameters (the only ones checkpointed), the AdamW over them, and
the Setup that bundles both with the model and, under DeepSpeed, the engine and this process's rank and world.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from train.spec import TrainSpec


@dataclass
class Setup:
    model: nn.Module
    named: dict[str, nn.Parameter]  # the trainable parameters, the only ones checkpointed
    optimizer: torch.optim.AdamW  # under DeepSpeed the client optimizer that ZeRO steps on its partitions
    engine: Any | None  # a DeepSpeedEngine, or None in a plain single process
    rank: int = 0
    world: int = 1


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not named:
        raise ValueError(f"{type(model).__name__} has no parameter with requires_grad=True: nothing to train")
    return named


def adamw(named: dict[str, nn.Parameter], spec: TrainSpec) -> torch.optim.AdamW:
    decay = [p for p in named.values() if p.dim() >= 2]
    rest = [p for p in named.values() if p.dim() < 2]
    groups = [{"params": ps, "weight_decay": wd} for ps, wd in ((decay, spec.weight_decay), (rest, 0.0)) if ps]
    return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas)
