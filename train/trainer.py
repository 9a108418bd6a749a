"""Model-agnostic trainer: AdamW + warmup/cosine, exact resume from pickle-free checkpoints (train.checkpoint),
optional DeepSpeed ZeRO-1/2 data parallelism (train.distributed).

The rows of a step come from `batches.batch_at(step)` and the learning rate is a function of the step, so a
checkpoint needs no iterator or scheduler state, and a run resumed from step k ends bit-identical to one that
never stopped.

Data parallel: every rank rebuilds the same global batch and takes its own rows; each shard's loss is weighted
by its share of the step's loss tokens, so W ranks x A micro-batches reproduce the token mean of one process
over the whole batch (up to float summation order).
"""
from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import Tensor, nn
from tqdm import tqdm

from runtime.host_memory import release_freed_memory
from train.batches import Batches, shard_rows
from train.checkpoint import (check_resumable, latest_checkpoint, load_moments, load_weights, save_checkpoint,
                              set_rng_state)
from train.distributed import deepspeed_setup, wants_deepspeed
from train.optim import Setup, adamw, trainable
from train.spec import TrainSpec

# steps between handing freed heap memory back: kept for reuse (runtime.host_memory), freed tensors pile up in the
# heap in fragments, gigabytes on a 1.5B target; each hand-back costs the next step its page faults (docs/qwen.md)
RELEASE_EVERY = 20

LossFn = Callable[[nn.Module, dict[str, Tensor]], tuple[Tensor, dict[str, float]]]
Logger = Callable[[int, dict[str, float]], None]
EvalFn = Callable[[nn.Module], dict[str, float]]


def lr_at(spec: TrainSpec, step: int) -> float:
    """Learning rate of 0-based `step`: linear warm-up, then cosine from lr to lr * min_lr_ratio."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - 1 - spec.warmup)
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _all_reduce_sum(values: dict[str, float], setup: Setup) -> dict[str, float]:
    if setup.world == 1:
        return values
    keys = sorted(values)  # same order on every rank
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def _train_step(setup: Setup, loss_fn: LossFn, batches: Batches, spec: TrainSpec, step: int) -> dict[str, float]:
    lr = lr_at(spec, step)
    for group in setup.optimizer.param_groups:
        group["lr"] = lr
    batch = batches.batch_at(step)
    step_tokens = max(int(batch["loss_mask"].sum()), 1)
    shards = spec.grad_accum * setup.world
    device = next(iter(setup.named.values())).device
    sums: dict[str, float] = {}
    for micro in range(spec.grad_accum):
        shard = {k: v.to(device) for k, v in shard_rows(batch, micro * setup.world + setup.rank, shards).items()}
        share = int(shard["loss_mask"].sum()) / step_tokens  # this shard's part of the step's token mean
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.bf16_autocast):
            loss, metrics = loss_fn(setup.model, shard)
        if setup.engine is None:
            (loss * share).backward()
        else:  # DeepSpeed divides by grad_accum and averages over ranks: undo both
            setup.engine.backward(loss * (share * shards))
            setup.engine.step()  # applies the update only at the last micro-batch
        for k, v in {"loss": loss, **metrics}.items():
            sums[k] = sums.get(k, 0.0) + float(v.detach() if torch.is_tensor(v) else v) * share
    if setup.engine is None:
        norm = nn.utils.clip_grad_norm_(list(setup.named.values()), spec.grad_clip or math.inf)
        setup.optimizer.step()
        setup.optimizer.zero_grad(set_to_none=True)
    else:
        norm = setup.engine.get_global_grad_norm()
    out = _all_reduce_sum(sums, setup)
    if not math.isfinite(out["loss"]):
        raise FloatingPointError(f"step {step + 1}: loss is {out['loss']}; lower TrainSpec.lr (now {spec.lr})")
    out.update(lr=lr, loss_tokens=float(step_tokens))
    if norm is not None:
        out["grad_norm"] = float(norm)
    return out


@torch.no_grad()
def _evaluate(model: nn.Module, eval_fn: EvalFn) -> dict[str, float]:
    model.eval()
    try:
        return {f"eval_{k}": float(v) for k, v in eval_fn(model).items()}
    finally:
        model.train()


def train(model: nn.Module, loss_fn: LossFn, batches: Batches, spec: TrainSpec, ckpt_dir: Path,
          log: Logger | None = None, eval_fn: EvalFn | None = None) -> dict:
    """Train `model` in place for spec.steps optimizer steps, resuming from the newest checkpoint in `ckpt_dir`.

    loss_fn(model, batch) -> (mean loss over the batch's loss tokens, {name: float}); the batch is a shard of
    `batches.batch_at(step)` on the model's device, weighted by its count of loss_mask tokens.
    eval_fn(model) -> {name: float} runs every eval_every steps and at the end, in eval mode without grad,
    on every rank. log(step, metrics) runs on rank 0.
    Returns {"step", "resumed_from", "metrics", "checkpoint", "seconds"}.
    """
    started = time.perf_counter()
    ckpt_dir = Path(ckpt_dir)
    resume = latest_checkpoint(ckpt_dir)
    state = json.loads((resume / "state.json").read_text()) if resume else None
    if resume:
        check_resumable(state, spec, batches, resume)
        load_weights(model, resume)  # before DeepSpeed copies the weights into its fp32 partitions
    if wants_deepspeed(spec):
        setup = deepspeed_setup(model, spec, batches.batch_size)
    else:
        named = trainable(model)
        setup = Setup(model, named, adamw(named, spec), None)
    if setup.rank == 0:  # what a crash left mid-write is never read; clear it
        for stale in ckpt_dir.glob(".tmp-*"):
            shutil.rmtree(stale)
    if resume:
        load_moments(setup, load_file(str(resume / "optimizer.safetensors")))
        set_rng_state(json.loads((resume / f"rng-rank{setup.rank % state['world_size']}.json").read_text()))
        start, metrics = state["step"], state["metrics"]
    else:
        torch.manual_seed(spec.seed + setup.rank)  # dropout and noise differ between ranks' rows
        start, metrics = 0, {}
    checkpoint = resume
    model.train()
    with tqdm(total=spec.steps, initial=start, desc="train", unit="step", mininterval=1.0,
              disable=setup.rank != 0) as bar:
        for step in range(start, spec.steps):
            metrics = _train_step(setup, loss_fn, batches, spec, step)
            done = step + 1
            if done % RELEASE_EVERY == 0:
                release_freed_memory()
            last = done == spec.steps
            evaluated = eval_fn is not None and (last or (spec.eval_every and done % spec.eval_every == 0))
            if evaluated:
                metrics.update(_evaluate(model, eval_fn))
                release_freed_memory()
            if log is not None and setup.rank == 0 and (evaluated or last or done % spec.log_every == 0):
                log(done, metrics)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)
            bar.update()
            if last or (spec.ckpt_every and done % spec.ckpt_every == 0):
                checkpoint = save_checkpoint(setup, spec, batches, done, metrics, ckpt_dir)
    return {"step": spec.steps, "resumed_from": start, "metrics": metrics, "checkpoint": str(checkpoint),
            "seconds": time.perf_counter() - started}


def mlflow_logger() -> Logger:
    """log(step, metrics) into the active MLflow run (the stage's nested run), if there is one."""
    import mlflow

    def log(step: int, metrics: dict[str, float]) -> None:
        if mlflow.active_run() is not None:
            mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    return log
