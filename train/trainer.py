"""Model-agnostic trainer: AdamW + warmup/cosine, exact resume from pickle-free checkpoints, optional DeepSpeed.

The rows of a step come from `batches.batch_at(step)` and the learning rate is a function of the step, so a
checkpoint is only tensors (trainable weights, optimizer moments: safetensors) and scalars (step, RNG: JSON),
and a run resumed from step k ends bit-identical to one that never stopped.

Data parallel (DeepSpeed ZeRO): every rank rebuilds the same global batch and takes its own rows; each shard's
loss is weighted by its share of the step's loss tokens, so W ranks x A micro-batches reproduce the token mean
of one process over the whole batch (up to float summation order).
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm import tqdm

from train.batches import Batches, shard_rows

LossFn = Callable[[nn.Module, dict[str, Tensor]], tuple[Tensor, dict[str, float]]]
Logger = Callable[[int, dict[str, float]], None]
EvalFn = Callable[[nn.Module], dict[str, float]]

# ZeRO-3 is not offered: on the test model it drifted from the one-process run (loss 3.131 vs 3.096 after 6
# steps, where ZeRO-1/2 agree to 1e-7), cause not established; drafters are small enough for ZeRO-2 anyway.
ZERO_PRESETS = {"zero1": 1, "zero2": 2}
TRAINER_OWNED_DS_KEYS = ("optimizer", "scheduler", "fp16", "bf16")  # AdamW, the schedule and fp32 are ours
STEP_DIR = "step-{:08d}"


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


def lr_at(spec: TrainSpec, step: int) -> float:
    """Learning rate of 0-based `step`: linear warm-up, then cosine from lr to lr * min_lr_ratio."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - 1 - spec.warmup)
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class _Setup:
    model: nn.Module
    named: dict[str, nn.Parameter]  # the trainable parameters, the only ones checkpointed
    optimizer: torch.optim.AdamW  # under DeepSpeed the client optimizer that ZeRO steps on its partitions
    engine: Any | None  # a DeepSpeedEngine, or None in a plain single process
    rank: int = 0
    world: int = 1


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not named:
        raise ValueError(f"{type(model).__name__} has no parameter with requires_grad=True: nothing to train")
    return named


def _adamw(named: dict[str, nn.Parameter], spec: TrainSpec) -> torch.optim.AdamW:
    decay = [p for p in named.values() if p.dim() >= 2]
    rest = [p for p in named.values() if p.dim() < 2]
    groups = [{"params": ps, "weight_decay": wd} for ps, wd in ((decay, spec.weight_decay), (rest, 0.0)) if ps]
    return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas)


# ---------------------------------------------------------------- DeepSpeed

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


def _deepspeed_setup(model: nn.Module, spec: TrainSpec, batch_size: int) -> _Setup:
    import deepspeed

    _init_distributed()
    named, world = _trainable(model), dist.get_world_size()
    optimizer = _adamw(named, spec)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=deepspeed_config(spec, batch_size, world))
    return _Setup(model, named, optimizer, engine, dist.get_rank(), world)


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


# ---------------------------------------------------------------- checkpoints

def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint: directories appear by atomic rename, so any step-* one is whole."""
    done = sorted(Path(ckpt_dir).glob("step-*"))
    return done[-1] if done else None


def load_weights(model: nn.Module, checkpoint: Path) -> None:
    """Copy a checkpoint's trainable weights into `model` (names must match exactly)."""
    saved, named = load_file(str(Path(checkpoint) / "model.safetensors")), _trainable(model)
    if saved.keys() != named.keys():
        missing, unexpected = sorted(named.keys() - saved.keys())[:5], sorted(saved.keys() - named.keys())[:5]
        raise ValueError(f"checkpoint {checkpoint} does not fit {type(model).__name__}: "
                         f"missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(saved[name])


def _full_state(setup: _Setup) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Whole (unpartitioned) weights and optimizer state by parameter name; a collective under ZeRO."""
    weights, moments = {}, {}
    if setup.engine is None:
        for name, p in setup.named.items():
            weights[name] = p.detach()
            moments.update({f"{name}/{k}": v for k, v in setup.optimizer.state.get(p, {}).items()})
    else:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        # DeepSpeed links each parameter to its moments right after stepping the FIRST param group, when later
        # groups (our no-decay one) have none yet, and never again; link now that all exist.
        setup.engine.optimizer._hp_optimizer_states_linked = False
        setup.engine.optimizer._lazy_init_hp_params_optimizer_state()
        state = next(iter(setup.optimizer.state.values()))  # every partition steps together: one step count
        keys = [k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0]
        for name, p in setup.named.items():
            weights[name] = safe_get_full_fp32_param(p)
            moments.update({f"{name}/{k}": safe_get_full_optimizer_state(p, k) for k in keys})
            moments[f"{name}/step"] = state["step"]
    as_file = lambda t: t.detach().cpu().contiguous().clone()  # noqa: E731  safetensors wants unshared storage
    return {k: as_file(v) for k, v in weights.items()}, {k: as_file(v) for k, v in moments.items()}


def _load_moments(setup: _Setup, moments: dict[str, Tensor]) -> None:
    if setup.engine is None:
        for name, p in setup.named.items():
            keys = [k.rpartition("/")[2] for k in moments if k.rpartition("/")[0] == name]
            setup.optimizer.state[p] = {k: moments[f"{name}/{k}"].to(p.device if k != "step" else "cpu")
                                        for k in keys}
        return
    zero = setup.engine.optimizer
    name_of = {id(p): n for n, p in setup.named.items()}
    # ZeRO-1/2 keep each param group as one flat fp32 partition per rank; fill this rank's slice of every
    # moment from the whole tensors, through the fragment map DeepSpeed itself uses for universal checkpoints.
    for flat, params in zip(zero.single_partition_of_fp32_groups, zero.bit16_groups):
        first = name_of[id(params[0])]
        keys = [k.rpartition("/")[2] for k in moments if k.rpartition("/")[0] == first and not k.endswith("/step")]
        state = {"step": moments[f"{first}/step"].clone(), **{k: torch.zeros_like(flat) for k in keys}}
        for p in params:
            frag = p._hp_mapping
            if frag is None:  # no slice of this parameter lives on this rank
                continue
            hp, lp = frag.hp_fragment_address, frag.lp_fragment_address
            for k in keys:
                state[k].narrow(0, hp.start, hp.numel).copy_(
                    moments[f"{name_of[id(p)]}/{k}"].flatten().narrow(0, lp.start, lp.numel))
        zero.optimizer.state[flat] = state


def _rng_state() -> dict:
    py = random.getstate()
    np_state = np.random.get_state()
    out = {"torch": torch.get_rng_state().numpy().tobytes().hex(), "python": [py[0], list(py[1]), py[2]],
           "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    if torch.cuda.is_available():
        out["cuda"] = [s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
    return out


def _set_rng_state(state: dict) -> None:
    as_bytes = lambda h: torch.frombuffer(bytearray.fromhex(h), dtype=torch.uint8)  # noqa: E731
    torch.set_rng_state(as_bytes(state["torch"]))
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    np.random.set_state((state["numpy"][0], np.array(state["numpy"][1], dtype=np.uint32), *state["numpy"][2:]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([as_bytes(h) for h in state["cuda"]])


def _barrier(setup: _Setup) -> None:
    if setup.world > 1:  # ranks must not rename or read the temp dir before every rank has written its part
        dist.barrier()


def _save_checkpoint(setup: _Setup, spec: TrainSpec, batches: Batches, step: int, metrics: dict,
                     ckpt_dir: Path) -> Path:
    """Write into a hidden temp dir, then rename: a crash leaves either the whole checkpoint or none."""
    weights, moments = _full_state(setup)
    tmp, final = ckpt_dir / f".tmp-{STEP_DIR.format(step)}", ckpt_dir / STEP_DIR.format(step)
    if setup.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(setup)
    (tmp / f"rng-rank{setup.rank}.json").write_text(json.dumps(_rng_state()))
    if setup.rank == 0:
        save_file(weights, str(tmp / "model.safetensors"))
        save_file(moments, str(tmp / "optimizer.safetensors"))
        groups = [{k: v for k, v in g.items() if k != "params"} for g in setup.optimizer.param_groups]
        (tmp / "state.json").write_text(json.dumps(
            {"step": step, "world_size": setup.world, "spec": spec.trajectory(), "batches": batches.describe(),
             "param_groups": groups, "metrics": metrics}, indent=1))
    _barrier(setup)
    if setup.rank == 0:
        os.replace(tmp, final)
        for old in sorted(ckpt_dir.glob("step-*"))[: -spec.keep_checkpoints]:
            shutil.rmtree(old)
    _barrier(setup)
    return final


def _check_resumable(state: dict, spec: TrainSpec, batches: Batches, checkpoint: Path) -> None:
    for what, saved, now in (("spec", state["spec"], spec.trajectory()), ("batches", state["batches"],
                                                                          batches.describe())):
        diff = {k: (saved.get(k), now.get(k)) for k in saved.keys() | now.keys() if saved.get(k) != now.get(k)}
        if diff:
            raise ValueError(f"cannot resume from {checkpoint}: {what} differs (saved, now): {diff}; "
                             "use a fresh checkpoint directory")


# ---------------------------------------------------------------- the loop

def _all_reduce_sum(values: dict[str, float], setup: _Setup) -> dict[str, float]:
    if setup.world == 1:
        return values
    keys = sorted(values)  # same order on every rank
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def _train_step(setup: _Setup, loss_fn: LossFn, batches: Batches, spec: TrainSpec, step: int) -> dict[str, float]:
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
        _check_resumable(state, spec, batches, resume)
        load_weights(model, resume)  # before DeepSpeed copies the weights into its fp32 partitions
    if wants_deepspeed(spec):
        setup = _deepspeed_setup(model, spec, batches.batch_size)
    else:
        named = _trainable(model)
        setup = _Setup(model, named, _adamw(named, spec), None)
    if setup.rank == 0:  # what a crash left mid-write is never read; clear it
        for stale in ckpt_dir.glob(".tmp-*"):
            shutil.rmtree(stale)
    if resume:
        _load_moments(setup, load_file(str(resume / "optimizer.safetensors")))
        _set_rng_state(json.loads((resume / f"rng-rank{setup.rank % state['world_size']}.json").read_text()))
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
            last = done == spec.steps
            evaluated = eval_fn is not None and (last or (spec.eval_every and done % spec.eval_every == 0))
            if evaluated:
                metrics.update(_evaluate(model, eval_fn))
            if log is not None and setup.rank == 0 and (evaluated or last or done % spec.log_every == 0):
                log(done, metrics)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)
            bar.update()
            if last or (spec.ckpt_every and done % spec.ckpt_every == 0):
                checkpoint = _save_checkpoint(setup, spec, batches, done, metrics, ckpt_dir)
    return {"step": spec.steps, "resumed_from": start, "metrics": metrics, "checkpoint": str(checkpoint),
            "seconds": time.perf_counter() - started}


def mlflow_logger() -> Logger:
    """log(step, metrics) into the active MLflow run (the stage's nested run), if there is one."""
    import mlflow

    def log(step: int, metrics: dict[str, float]) -> None:
        if mlflow.active_run() is not None:
            mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    return log
