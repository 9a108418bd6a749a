"""Pickle-free checkpoints for exact resume: one step-NNNNNNNN directory per checkpoint, holding only tensors
(trainable weights, optimizer moments: safetensors) and scalars (step, spec, batches, per-rank RNG: JSON). A
checkpoint is written into a hidden temp dir and renamed, so it is either whole or absent. Under ZeRO the
partitioned weights and moments are gathered whole on save and re-partitioned on load, so the format is the
same with or without DeepSpeed.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from train.batches import Batches
from train.optim import Setup, trainable
from train.spec import TrainSpec


STEP_DIR = "step-{:08d}"


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint: directories appear by atomic rename, so any step-* one is whole."""
    done = sorted(Path(ckpt_dir).glob("step-*"))
    return done[-1] if done else None


def load_weights(model: nn.Module, checkpoint: Path) -> None:
    """Copy a checkpoint's trainable weights into `model` (names must match exactly)."""
    saved, named = load_file(str(Path(checkpoint) / "model.safetensors")), trainable(model)
    if saved.keys() != named.keys():
        missing, unexpected = sorted(named.keys() - saved.keys())[:5], sorted(saved.keys() - named.keys())[:5]
        raise ValueError(f"checkpoint {checkpoint} does not fit {type(model).__name__}: "
                         f"missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(saved[name])


def _full_state(setup: Setup) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
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


def load_moments(setup: Setup, moments: dict[str, Tensor]) -> None:
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


def set_rng_state(state: dict) -> None:
    as_bytes = lambda h: torch.frombuffer(bytearray.fromhex(h), dtype=torch.uint8)  # noqa: E731
    torch.set_rng_state(as_bytes(state["torch"]))
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    np.random.set_state((state["numpy"][0], np.array(state["numpy"][1], dtype=np.uint32), *state["numpy"][2:]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([as_bytes(h) for h in state["cuda"]])


def _barrier(setup: Setup) -> None:
    if setup.world > 1:  # ranks must not rename or read the temp dir before every rank has written its part
        dist.barrier()


def save_checkpoint(setup: Setup, spec: TrainSpec, batches: Batches, step: int, metrics: dict,
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


def check_resumable(state: dict, spec: TrainSpec, batches: Batches, checkpoint: Path) -> None:
    for what, saved, now in (("spec", state["spec"], spec.trajectory()), ("batches", state["batches"],
                                                                          batches.describe())):
        diff = {k: (saved.get(k), now.get(k)) for k in saved.keys() | now.keys() if saved.get(k) != now.get(k)}
        if diff:
            raise ValueError(f"cannot resume from {checkpoint}: {what} differs (saved, now): {diff}; "
                             "use a fresh checkpoint directory")
