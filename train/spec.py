"""What a training run is: steps, the learning-rate schedule, AdamW, checkpoints, evaluation and DeepSpeed, checked
at construction. The trainer, its checkpoints, its optimiser and its DeepSpeed setup all read it."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

ZERO_PRESETS = {"zero1": 1, "zero2": 2}  # DeepSpeed ZeRO stages by preset name


@dataclass(frozen=True)
class TrainSpec:
    steps: int
    lr: float = 3e-4
    warmup: int = 0  # linear warm-up steps, then cosine down to lr * min_lr_ratio at the last step
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0  # applied to matrices only (dim >= 2), never to biases and norms
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    grad_accum: int = 1  # micro-batches per step; the batch is split, not multiplied
    ckpt_every: int = 0  # 0: only at the last step
    keep_checkpoints: int = 2
    log_every: int = 1
    eval_every: int = 0  # 0: evaluate only at the last step (when an eval_fn is given)
    seed: int = 0
    deepspeed: str | None = None  # zero1 | zero2 | path to a DeepSpeed JSON config (ZeRO stage 1 or 2)
    bf16_autocast: bool = False  # forward and loss under bf16 torch.autocast; weights and AdamW stay fp32

    def __post_init__(self):
        for name in ("steps", "grad_accum", "keep_checkpoints", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainSpec.{name}={getattr(self, name)}: expected >= 1")
        for name in ("warmup", "ckpt_every", "eval_every", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainSpec.{name}={getattr(self, name)}: expected >= 0")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainSpec lr={self.lr}, min_lr_ratio={self.min_lr_ratio}: "
                             "expected lr > 0 and 0 <= min_lr_ratio <= 1")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"TrainSpec.betas={self.betas}: expected two values in [0, 1)")
        ds = self.deepspeed
        if ds is not None and ds not in ZERO_PRESETS and not (ds.endswith(".json") and Path(ds).is_file()):
            raise ValueError(f"TrainSpec.deepspeed={ds!r}: expected one of {sorted(ZERO_PRESETS)} "
                             "or the path of an existing DeepSpeed .json config")

    def trajectory(self) -> dict:
        """The fields that decide the final weights: a resumed run must agree on all of them."""
        skip = {"ckpt_every", "keep_checkpoints", "log_every", "eval_every", "deepspeed"}
        return json.loads(json.dumps({k: v for k, v in asdict(self).items() if k not in skip}))
