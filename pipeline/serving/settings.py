"""How a served drafter is run, from the environment: the device, where its draft budget comes from, and how
concurrent requests are batched (read at load; a bad value is a one-line error naming its variable):
- DRAFTSMITH_DEVICE (cpu | cuda): default cuda where torch sees a GPU;
- DRAFTSMITH_BUDGET (calibrated | device): the budget calibrate chose by CPU speed, or the bundle's device candidate
  timed fastest here (runtime.serving.budget_tuner); default device on CUDA, calibrated on the CPU;
- DRAFTSMITH_MAX_BATCH (8): rows decoded together;
- DRAFTSMITH_MAX_QUEUE (64): rows waiting for a free one beyond those; a request that does not fit is refused at
  once (HTTP 429);
- DRAFTSMITH_REQUEST_TIMEOUT_S (120): a request not answered this long after it was accepted gets an error (HTTP
  504) and its rows leave the batch;
- DRAFTSMITH_BATCH_POLICY (measured | fixed | plain): the draft budget at each batch size measured at load among
  the bundle's budgets and plain decoding (runtime.serving.budget_tuner; kept per host and bundle,
  pipeline.serving.policy_cache), the served budget at every size, or no drafting at all (plain batched decoding:
  the baseline the load test compares with);
- DRAFTSMITH_LEARN_TOKENS (16384): tokens of the latest served replies the lookup corpus learns
  (runtime.serving.reply_corpus); 0: the bundle's corpus only.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from pipeline.errors import DraftsmithError

DEVICE_ENV = "DRAFTSMITH_DEVICE"
BUDGET_ENV = "DRAFTSMITH_BUDGET"
BUDGET_SOURCES = ("calibrated", "device")
MAX_BATCH_ENV, MAX_QUEUE_ENV, TIMEOUT_ENV = "DRAFTSMITH_MAX_BATCH", "DRAFTSMITH_MAX_QUEUE", "DRAFTSMITH_REQUEST_TIMEOUT_S"
POLICY_ENV, POLICIES = "DRAFTSMITH_BATCH_POLICY", ("measured", "fixed", "plain")
LEARN_ENV = "DRAFTSMITH_LEARN_TOKENS"


def env_number(name: str, default, kind, least):
    """$name as an int or a finite float >= least, `default` where unset; a bad one is a one-line error naming it."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not value >= least or (kind is float and not math.isfinite(value)):
        raise DraftsmithError(f"${name}={raw!r}: expected {'an integer' if kind is int else 'a number'} >= {least}")
    return value


@dataclass(frozen=True)
class BatchSettings:
    max_batch: int = 8
    max_queue: int = 64
    timeout_s: float = 120.0
    policy: str = "measured"
    learn_tokens: int = 16384

    @staticmethod
    def from_env() -> "BatchSettings":
        """The settings in the environment, each checked: a bad one is a one-line error naming it."""
        d = BatchSettings()
        policy = os.environ.get(POLICY_ENV) or d.policy
        if policy not in POLICIES:
            raise DraftsmithError(f"${POLICY_ENV}={policy!r}: expected one of {', '.join(POLICIES)}")
        return BatchSettings(env_number(MAX_BATCH_ENV, d.max_batch, int, 1),
                             env_number(MAX_QUEUE_ENV, d.max_queue, int, 0),
                             env_number(TIMEOUT_ENV, d.timeout_s, float, 0.001), policy,
                             env_number(LEARN_ENV, d.learn_tokens, int, 0))


def serving_device():
    """$DRAFTSMITH_DEVICE, else cuda where torch sees a GPU, else cpu."""
    import torch

    name = os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") or (name == "cuda" and not torch.cuda.is_available()):
        raise DraftsmithError(f"${DEVICE_ENV}={name!r}: expected cpu, or cuda on a machine where torch sees a GPU")
    return torch.device(name)


def budget_source(device) -> str:
    """$DRAFTSMITH_BUDGET: `calibrated` serves the budget calibrate chose by CPU speed, `device` times the bundle's
    device candidates here and serves the fastest (runtime.serving.budget_tuner); default: device on CUDA, where the
    CPU's choice is too small, calibrated on the CPU."""
    name = os.environ.get(BUDGET_ENV) or ("device" if device.type == "cuda" else "calibrated")
    if name not in BUDGET_SOURCES:
        raise DraftsmithError(f"${BUDGET_ENV}={name!r}: expected one of {', '.join(BUDGET_SOURCES)}")
    return name
