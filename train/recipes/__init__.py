"""Training recipes, one module per drafter kind (train/recipes/<kind>.py, its `RECIPE`): how the kind's module is
built from the target and what it is trained to match. Every loss reads the target's own outputs (features and
next-token distributions) under a frozen forward, so drafters learn the target's behaviour rather than the
dataset's; rows are masked to assistant tokens."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable

from torch import Tensor, nn

from runtime.target.model import Transformer

LossFn = Callable[[nn.Module, dict], tuple[Tensor, dict]]
EvalFn = Callable[[nn.Module], dict]


class Recipe:
    """`drafter` and `distill` are the run's config sections (pipeline.config.DrafterCfg, DistillCfg); a setting that
    does not fit the target raises ValueError naming it."""

    def build(self, target: Transformer, drafter: Any, distill: Any, keep_ids: Tensor | None) -> nn.Module:
        raise NotImplementedError

    def target_blocks(self, drafter: Any, n_layers: int) -> tuple[int, ...]:
        """The target's blocks whose plain weights `build` copies (distill loads the others lean: packed only)."""
        return ()

    def copies_target(self, drafter: Any) -> bool:
        """Whether `build` starts the drafter from the target's weights, so that it trains in the target's dtype
        (distill then holds the target in fp32)."""
        return True

    def loss(self, target: Transformer, drafter: Any, distill: Any, keep_ids: Tensor | None) -> LossFn:
        raise NotImplementedError

    def evaluator(self, target: Transformer, val_batch: dict, drafter: Any) -> EvalFn | None:
        """What the trainer evaluates on validation rows every distill.eval_every steps; None: nothing."""
        return None

    def finish(self, module: nn.Module) -> nn.Module:
        """The trained module as the bundle stores it."""
        return module


def get_recipe(kind: str) -> Recipe:
    if kind not in {m.name for m in pkgutil.iter_modules(__path__)}:
        raise ValueError(f"drafter kind {kind!r} has no training recipe (train/recipes/{kind}.py)")
    return importlib.import_module(f"{__name__}.{kind}").RECIPE
