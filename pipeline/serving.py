"""Serving: the MLflow pyfunc that generates with a registered drafter bundle, and `pipeline serve`.

The pyfunc holds only the bundle (an artifact) and the target's spec (model_config): at load it resolves the
target, checks that the bundle was built for exactly these weights, and runs our own speculative engine: on a GPU
where one is present ($DRAFTSMITH_DEVICE=cpu|cuda chooses), there with every verify and draft step a CUDA graph
and the draft budget that runs fastest there ($DRAFTSMITH_BUDGET=calibrated|device chooses).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import mlflow.pyfunc
import pandas as pd

from pipeline.config import Config
from pipeline.errors import DraftsmithError
from pipeline.tracking import tracking_uri

DEVICE_ENV = "DRAFTSMITH_DEVICE"
BUDGET_ENV = "DRAFTSMITH_BUDGET"
BUDGET_SOURCES = ("calibrated", "device")


def serving_device():
    """$DRAFTSMITH_DEVICE, else cuda where torch sees a GPU, else cpu."""
    import torch

    name = os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") or (name == "cuda" and not torch.cuda.is_available()):
        raise DraftsmithError(f"${DEVICE_ENV}={name!r}: expected cpu, or cuda on a machine where torch sees a GPU")
    return torch.device(name)


def budget_source(device) -> str:
    """$DRAFTSMITH_BUDGET: `calibrated` serves the budget calibrate chose by CPU speed, `device` times the bundle's
    device candidates here and serves the fastest (runtime.device_budget); default: device on CUDA, where the CPU's
    choice is too small, calibrated on the CPU."""
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
        from runtime.budget import ServedBudget
        from runtime.bundle import read_bundle
        from runtime.device_budget import describe
        from runtime.model import Transformer
        from runtime.precision import float_dtype
        from runtime.served import served_engine
        from runtime.tokens import stop_ids

        settings = context.model_config
        target_dir = resolve_target(settings["target"])
        # Refuse to serve a drafter against weights other than those it was trained and validated for.
        bundle = read_bundle(context.artifacts["bundle"], expect_target_fingerprint=target_fingerprint(target_dir))
        device = serving_device()
        # validate's precision, resolved on this device; models registered before it was recorded ran fp32
        dtype = float_dtype(settings.get("precision", "fp32"), device)
        target = Transformer.from_pretrained(target_dir, dtype=dtype, device=device)
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        on_device = budget_source(device) == "device"
        served = served_engine(bundle, target, target.max_seq_len, fallback=ServedBudget.from_dict(settings["budget"]),
                               device_prompt=self._prompt_ids(default_bench_prompts()[0]) if on_device else None)
        if served.device_report is not None:
            print(describe(served.device_report), file=sys.stderr)
        self.engine = served.engine  # the target's whole context
        self.stop_ids = stop_ids(self.tokenizer)
        self.max_new_tokens = int(settings["max_new_tokens"])  # a row without max_new_tokens gets validate's
        self.lock = threading.Lock()  # one engine, one KV cache: requests take turns

    def _prompt_ids(self, prompt: str) -> list[int]:
        from runtime.tokens import encode

        return encode(self.tokenizer, prompt)  # the same encoding the benchmark measures

    def predict(self, context, model_input: pd.DataFrame, params=None) -> list[str]:
        from runtime.model import context_error
        from runtime.sampling import SamplingParams

        answers = []
        for i, row in enumerate(model_input.to_dict(orient="records")):
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
            if overflow:  # refused before the lock: a too-long request never holds up the others
                raise ValueError(f"row {i}: {overflow}")
            with self.lock:
                out = self.engine.generate(ids, int(max_new), sampling, stop_ids=self.stop_ids)
            answers.append(self.tokenizer.decode(out.tokens, skip_special_tokens=True))
        return answers


def serve_invocation(cfg: Config, port: int, host: str = "127.0.0.1",
                     alias: str = "champion") -> tuple[list[str], dict[str, str]]:
    """The `mlflow models serve` command line and environment that serve models:/NAME@alias (which must exist:
    checked here, so a missing one is a one-line error rather than the scoring server's traceback)."""
    uri = tracking_uri(cfg)
    _check_alias(cfg, alias, uri)
    argv = [sys.executable, "-m", "mlflow", "models", "serve", "-m", f"models:/{cfg.register.model_name}@{alias}",
            "--host", host, "--port", str(port), "--env-manager", "local"]
    # mlflow execs `uvicorn` by name: find it beside this interpreter even when the venv is not activated.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return argv, {**os.environ, "PATH": path, "MLFLOW_TRACKING_URI": uri, "MLFLOW_REGISTRY_URI": uri}


def _check_alias(cfg: Config, alias: str, uri: str) -> None:
    from mlflow.exceptions import MlflowException

    from pipeline.registry import registry_client

    name = cfg.register.model_name
    try:
        registry_client(cfg).get_model_version_by_alias(name, alias)
    except MlflowException:
        raise DraftsmithError(f"models:/{name}@{alias}: no such model version in the registry at {uri} (register "
                              f"a validated run, then promote it or pass --alias)") from None


def serve(cfg: Config, port: int, host: str = "127.0.0.1", alias: str = "champion") -> int:
    """Run the MLflow scoring server in the foreground until it stops; return its exit status."""
    argv, env = serve_invocation(cfg, port, host, alias)
    return subprocess.run(argv, env=env).returncode
