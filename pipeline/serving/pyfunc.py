"""Serving: the MLflow pyfunc that generates with a registered drafter bundle, and `pipeline serve`.

The pyfunc holds only the bundle (an artifact) and the target's spec (model_config): at load it resolves the
target, checks that the bundle was built for exactly these weights, and runs our own speculative engine: on a GPU
where one is present ($DRAFTSMITH_DEVICE=cpu|cuda chooses), there with the draft budget that runs fastest there
($DRAFTSMITH_BUDGET=calibrated|device chooses).

Concurrent requests are batched: one scheduler thread owns a batched engine (runtime.serving.batch_engine), and every
request, from whichever of the scoring server's threads, joins its queue and waits for its own rows (a request's
rows run together). The settings, read at load ($NAME, default):
- DRAFTSMITH_MAX_BATCH (8): rows decoded together;
- DRAFTSMITH_MAX_QUEUE (64): rows waiting for a free one beyond those; a request that does not fit is refused at
  once (HTTP 429);
- DRAFTSMITH_REQUEST_TIMEOUT_S (120): a request not answered this long after it was accepted gets an error (HTTP
  504) and its rows leave the batch (the scoring server's own limit is set above it by `pipeline serve`);
- DRAFTSMITH_BATCH_POLICY (measured | fixed | plain): the draft budget at each batch size measured at load among
  the bundle's budgets and plain decoding (runtime.serving.budget_tuner), the served budget at every size, or no
  drafting at all (plain batched decoding: the baseline the load test compares with).
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import mlflow.pyfunc
import pandas as pd

from pipeline.errors import DraftsmithError

DEVICE_ENV = "DRAFTSMITH_DEVICE"
BUDGET_ENV = "DRAFTSMITH_BUDGET"
BUDGET_SOURCES = ("calibrated", "device")
MAX_BATCH_ENV, MAX_QUEUE_ENV, TIMEOUT_ENV = "DRAFTSMITH_MAX_BATCH", "DRAFTSMITH_MAX_QUEUE", "DRAFTSMITH_REQUEST_TIMEOUT_S"
POLICY_ENV, POLICIES = "DRAFTSMITH_BATCH_POLICY", ("measured", "fixed", "plain")
SCORING_TIMEOUT_MARGIN_S = 30  # the scoring server's request limit sits this far above ours: ours answers first


@dataclass(frozen=True)
class BatchSettings:
    max_batch: int = 8
    max_queue: int = 64
    timeout_s: float = 120.0
    policy: str = "measured"

    @staticmethod
    def from_env() -> "BatchSettings":
        """The settings in the environment, each checked: a bad one is a one-line error naming it."""
        d = BatchSettings()

        def number(name: str, default, kind, least):
            raw = os.environ.get(name)
            if raw is None or raw == "":
                return default
            try:
                value = kind(raw)
            except ValueError:
                value = None
            if value is None or not value >= least or (kind is float and not math.isfinite(value)):
                raise DraftsmithError(f"${name}={raw!r}: expected {'an integer' if kind is int else 'a number'} "
                                      f">= {least}")
            return value

        policy = os.environ.get(POLICY_ENV) or d.policy
        if policy not in POLICIES:
            raise DraftsmithError(f"${POLICY_ENV}={policy!r}: expected one of {', '.join(POLICIES)}")
        return BatchSettings(number(MAX_BATCH_ENV, d.max_batch, int, 1), number(MAX_QUEUE_ENV, d.max_queue, int, 0),
                             number(TIMEOUT_ENV, d.timeout_s, float, 0.001), policy)


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


def pyfunc_signature():
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    # max_new_tokens is double, not long: a row that leaves it out becomes NaN, which a long column refuses.
    inputs = Schema([ColSpec("string", "prompt"), ColSpec("double", "max_new_tokens", required=False),
                     ColSpec("double", "temperature", required=False)])
    return ModelSignature(inputs=inputs, outputs=Schema([ColSpec("string")]))


def _cell(row, column: str, default):
    """A row's optional value; absent columns and missing cells (NaN after DataFrame alignment) take the default."""
    v = row.get(column)
    return default if v is None or (isinstance(v, float) and math.isnan(v)) else v


class DraftsmithPyfunc(mlflow.pyfunc.PythonModel):
    """Input: DataFrame with `prompt` (plain user text) and optional `max_new_tokens`, `temperature`.
    Output: one generated answer per row."""

    def load_context(self, context) -> None:
        from transformers import AutoTokenizer

        from pipeline.bench.harness import default_bench_prompts
        from pipeline.sources import resolve_target, target_fingerprint
        from runtime.speculation.draft_budget import ServedBudget
        from runtime.bundle_reader import read_bundle
        from runtime.serving.budget_tuner import describe
        from runtime.target.loading import from_pretrained
        from runtime.target.precision import float_dtype
        from runtime.serving.scheduler import Scheduler
        from runtime.serving.served_engine import served_engine
        from pipeline.tokens import stop_ids

        settings = context.model_config
        target_dir = resolve_target(settings["target"])
        # Refuse to serve a drafter against weights other than those it was trained and validated for.
        bundle = read_bundle(context.artifacts["bundle"], expect_target_fingerprint=target_fingerprint(target_dir))
        device = serving_device()
        # validate's precision, resolved on this device; models registered before it was recorded ran fp32
        dtype = float_dtype(settings.get("precision", "fp32"), device)
        target = from_pretrained(target_dir, dtype=dtype, device=device)
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        on_device = budget_source(device) == "device"
        batching = BatchSettings.from_env()
        probes = [self._prompt_ids(p) for p in default_bench_prompts()]
        served = served_engine(bundle, target, target.max_seq_len, fallback=ServedBudget.from_dict(settings["budget"]),
                               device_prompt=probes[0] if on_device else None)
        if served.device_report is not None:
            print(describe(served.device_report), file=sys.stderr)
        self.engine, note = served.batched(batching.max_batch, probes if batching.policy == "measured" else None,
                                           plain=batching.policy == "plain")
        print(f"serving {batching.max_batch} rows at once, a queue of {batching.max_queue}, a "
              f"{batching.timeout_s:g} s timeout; draft budget by batch size: "
              f"{self.engine.policy.describe() if self.engine.drafter is not None else 'none (plain decoding)'}"
              + f"; {note}" * bool(note), file=sys.stderr)
        self.scheduler = Scheduler(self.engine, batching.max_queue, batching.timeout_s)
        _widen_scoring_threads(batching)
        self.stop_ids = stop_ids(self.tokenizer)
        self.max_new_tokens = int(settings["max_new_tokens"])  # a row without max_new_tokens gets validate's

    def _prompt_ids(self, prompt: str) -> list[int]:
        from pipeline.tokens import encode

        return encode(self.tokenizer, prompt)  # the same encoding the benchmark measures

    def predict(self, context, model_input: pd.DataFrame, params=None) -> list[str]:
        """Every row of the frame in the batch at once; the answers in row order."""
        from runtime.serving.batch_engine import BatchRequest
        from runtime.target.model import context_error
        from runtime.speculation.sampling import SamplingParams
        from runtime.serving.scheduler import SchedulerError

        requests = []
        for row in model_input.to_dict(orient="records"):
            prompt = row.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"prompt={prompt!r}: expected a non-empty string")
            max_new = _cell(row, "max_new_tokens", self.max_new_tokens)
            if not float(max_new).is_integer() or max_new < 1:
                raise ValueError(f"max_new_tokens={max_new!r}: expected a whole number >= 1")
            sampling = SamplingParams(temperature=float(_cell(row, "temperature", 0.0)))
            ids = self._prompt_ids(prompt)
            overflow = context_error(len(ids), int(max_new), self.engine.cfg.max_seq_len,
                                     "the served context of max_seq_len")
            if overflow:  # refused before it joins the queue
                raise ValueError(f"row {len(requests)}: {overflow}")
            requests.append(BatchRequest(len(requests), ids, int(max_new), sampling, self.stop_ids))
        try:
            out = self.scheduler.generate(requests)
        except SchedulerError as e:
            raise _http_error(e) from None
        return [self.tokenizer.decode(g.tokens, skip_special_tokens=True) for g in out]


def _http_error(error):
    """The scheduler's refusal as the scoring server's error response: a full queue 429, a timeout 504."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import DEADLINE_EXCEEDED, INTERNAL_ERROR, RESOURCE_EXHAUSTED

    from runtime.serving.scheduler import QueueFull, RequestTimedOut

    code = RESOURCE_EXHAUSTED if isinstance(error, QueueFull) else DEADLINE_EXCEEDED \
        if isinstance(error, RequestTimedOut) else INTERNAL_ERROR
    return MlflowException(str(error), error_code=code)


def _widen_scoring_threads(settings: BatchSettings) -> None:
    """The scoring server runs each request's predict in its event loop's default thread pool, of a few threads
    (cores + 4): a request waiting for its answer holds one, so that pool would cap the batch. Under the scoring
    server the model loads inside its running loop; elsewhere (mlflow.pyfunc.load_model) there is none to widen."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    # every accepted row may hold a thread, and refusals need one each for a moment
    loop.set_default_executor(ThreadPoolExecutor(settings.max_batch + settings.max_queue + 8, "predict"))
