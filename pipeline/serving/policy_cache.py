"""The batch policy `pipeline serve` measures at start-up (runtime.serving.budget_tuner.measure_policy), kept per host
and bundle under the project home so that the next start on the same host reuses it instead of timing every batch
size again.

A kept policy is found by the digest of everything that changes what the timing would say: the bundle (its manifest,
which holds every file's sha256), the host (CPU model, cores, torch's threads, the GPU), torch's version, the device
and dtype, the batched engine's settings, the candidate budgets, the batch size and the timing prompts. Any change
is another file, so it is measured afresh; a file that cannot be read is logged in one line and measured over.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from pipeline.home import digest_json, home, write_json_atomic
from runtime.device import cpu_model

FORMAT = 1  # bumped when what a kept file holds, or how a policy is measured, changes
log = logging.getLogger("draftsmith.serving")


def cache_dir() -> Path:
    return home() / "serving" / "batch_policies"


def host_key(device) -> dict:
    """What about this machine and process a timing depends on."""
    import torch

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "device": device.type, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def policy_key(bundle, served, max_batch: int, prompts: list[list[int]], new_tokens: int) -> dict:
    """The key of the batch policy of `served` (runtime.serving.served_engine.ServedEngine of `bundle`) up to
    `max_batch` rows, timed on `prompts` for `new_tokens` tokens a row."""
    from runtime.serving.budget_tuner import BATCH_REPEATS
    from runtime.serving.served_engine import batch_config

    target = served.engine.target
    return {"format": FORMAT, "bundle": digest_json(bundle.manifest), "host": host_key(target.device),
            "dtype": str(target.dtype), "engine": repr(batch_config(served.engine.cfg)[0]),
            "candidates": [[b.to_dict(), tau] for b, tau in served.policy_candidates()], "max_batch": max_batch,
            "prompts": digest_json(prompts), "new_tokens": new_tokens, "repeats": BATCH_REPEATS}


def read_kept(path: Path, key: dict):
    """The BatchPolicy kept at `path` for `key`; None where there is none (or it was kept for another key), or the
    file is unreadable (logged in one line)."""
    from runtime.speculation.draft_budget import BatchPolicy

    if not path.exists():
        return None
    try:
        kept = json.loads(path.read_text())
        if kept["key"] != key:
            return None
        return BatchPolicy.from_dict(kept["policy"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning(f"batch policy cache {path}: unreadable ({type(e).__name__}: {e}); measuring it again")
        return None


def kept_policy(bundle, served, max_batch: int, prompts: list[list[int]], new_tokens: int,
                measure: Callable[[], object]) -> tuple[object, Path, bool]:
    """(policy, its file, whether it was kept from before): the kept one for this key, else `measure()`'s, kept
    (written atomically) for the next start; a home that cannot be written costs only the keeping (logged)."""
    key = policy_key(bundle, served, max_batch, prompts, new_tokens)
    path = cache_dir() / f"{digest_json(key)[:32]}.json"
    policy = read_kept(path, key)
    if policy is not None:
        return policy, path, True
    policy = measure()
    try:
        write_json_atomic(path, {"key": key, "policy": policy.to_dict()})
    except OSError as e:
        log.warning(f"batch policy cache {path}: not written ({e}); the next start measures again")
    return policy, path, False
