"""DeepSpeed ZeRO-1/2 data parallelism for the trainer: the DeepSpeed config derived from a TrainSpec (the
trainer owns batch sizes, AdamW, the schedule and fp32), forming the process group (gloo on CPU; a world of one
when a plain process asks for DeepSpeed), wrapping the model in an engine, and launch_local, which spawns ranks
on loopback as the deepspeed launcher would.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from train.optim import Setup, adamw, trainable
from train.spec import ZERO_PRESETS, TrainSpec


# ZeRO-3 is not offered: on the test model it drifted from the one-process run (loss 3.131 vs 3.096 after 6
# steps, where ZeRO-1/2 agree to 1e-7), cause not established; drafters are small enough for ZeRO-2 anyway.
TRAINER_OWNED_DS_KEYS = ("optimizer", "scheduler", "fp16", "bf16")  # AdamW, the schedule and fp32 are ours


def wants_deepspeed(spec: TrainSpec) -> bool:
    return spec.deepspeed is not None or int(os.environ.get("WORLD_SIZE", "1")) > 1


def deepspeed_config(spec: TrainSpec, batch_size: int, world: int) -> dict:
    shards = spec.grad_accum * world
    if batch_size % shards:
        raise ValueError(f"batch size {batch_size} is not divisible by grad_accum x world size = {shards}")
    owned = {"train_batch_size": batch_size, "train_micro_batch_size_per_gpu": batch_size // shards,
             "gradient_accumulation_steps": spec.grad_accum, "gradient_clipping": spec.grad_clip,
             "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1}
    if spec.deepspeed is None or spec.deepspeed in ZERO_PRESETS:  # launched without a preset: ZeRO-2
        return {**owned, "zero_optimization": {"stage": ZERO_PRESETS[spec.deepspeed or "zero2"]}}
    base = json.loads(Path(spec.deepspeed).read_text())
    stage = base.get("zero_optimization", {}).get("stage", 0)
    if stage not in ZERO_PRESETS.values():
        raise ValueError(f"deepspeed config {spec.deepspeed}: zero_optimization.stage={stage}; the trainer "
                         f"supports stages {sorted(ZERO_PRESETS.values())}")
    for key in TRAINER_OWNED_DS_KEYS:
        if key in base and (key not in ("fp16", "bf16") or base[key].get("enabled", False)):
            raise ValueError(f"deepspeed config {spec.deepspeed}: remove '{key}'; the trainer owns the optimizer, "
                             "the schedule and fp32 precision")
    for key, value in owned.items():
        if base.get(key, "auto") not in ("auto", value):
            raise ValueError(f"deepspeed config {spec.deepspeed}: {key}={base[key]!r} conflicts with the "
                             f"trainer's {value!r}; remove it or set it to \"auto\"")
    return {**base, **owned}


def _init_distributed() -> None:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    on_cpu = get_accelerator().device_name() == "cpu"
    if on_cpu:  # its shared-memory all-reduce serves inference only, yet building it JIT-compiles C++ for minutes
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not dist.is_initialized() and "RANK" not in os.environ:
        # A plain process asked for DeepSpeed: a world of one, set up as a launcher would (DeepSpeed insists on
        # LOCAL_RANK, and without RANK & co it goes looking for MPI).
        _set_rank_env(0, 1, _free_port())
    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else None)


def deepspeed_setup(model: nn.Module, spec: TrainSpec, batch_size: int) -> Setup:
    import deepspeed

    _init_distributed()
    named, world = trainable(model), dist.get_world_size()
    optimizer = adamw(named, spec)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=deepspeed_config(spec, batch_size, world))
    return Setup(model, named, optimizer, engine, dist.get_rank(), world)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_rank_env(rank: int, world: int, port: int) -> None:
    """The environment a launcher gives each rank, on loopback only."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")


def _rank_main(rank: int, world: int, port: int, results, fn: Callable, args: tuple) -> None:
    _set_rank_env(rank, world, port)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the cores: no oversubscription
    out = fn(*args)
    if rank == 0:
        results.put(out)


def launch_local(world_size: int, fn: Callable, *args) -> Any:
    """Run fn(*args) in `world_size` spawned processes that form one process group on 127.0.0.1 (env:// on a
    free port, as the deepspeed launcher would set up); returns rank 0's (picklable) result."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: expected >= 1")
    results = mp.get_context("spawn").SimpleQueue()
    procs = mp.start_processes(_rank_main, args=(world_size, _free_port(), results, fn, args), nprocs=world_size,
                               join=False, start_method="spawn")
    out = None
    while not procs.join(timeout=0.5):  # raises if a rank failed; drain so a large result cannot block rank 0
        if not results.empty():
            out = results.get()
    return results.get() if not results.empty() else out
