"""The MLflow pyfunc that generates with a registered drafter bundle (`pipeline serve` runs it in MLflow's scoring
server).

The pyfunc holds only the bundle (an artifact) and the target's spec (model_config); at load it runs the loading
path every server shares (pipeline.serving.served_model), with the settings pipeline.serving.settings reads from the
environment. Concurrent requests are batched: one scheduler thread owns a batched engine, and every request, from
whichever of the scoring server's threads, joins its queue and waits for its own rows (a request's rows run
together); a full queue is HTTP 429, a timeout 504 (the scoring server's own limit is set above ours by `pipeline
serve`).
"""
from __future__ import annotations

import math

import mlflow.pyfunc
import pandas as pd

from pipeline.serving.settings import BatchSettings


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
        from pipeline.serving.served_model import load_served

        self.served = load_served(context.model_config, context.artifacts["bundle"])
        _widen_scoring_threads(self.served.settings)

    def predict(self, context, model_input: pd.DataFrame, params=None) -> list[str]:
        """Every row of the frame in the batch at once; the answers in row order."""
        from runtime.serving.batch_engine import BatchRequest
        from runtime.serving.scheduler import SchedulerError
        from runtime.speculation.sampling import SamplingParams
        from runtime.target.model_config import context_error

        served, requests = self.served, []
        for row in model_input.to_dict(orient="records"):
            prompt = row.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"prompt={prompt!r}: expected a non-empty string")
            max_new = _cell(row, "max_new_tokens", served.max_new_tokens)
            if not float(max_new).is_integer() or max_new < 1:
                raise ValueError(f"max_new_tokens={max_new!r}: expected a whole number >= 1")
            sampling = SamplingParams(temperature=float(_cell(row, "temperature", 0.0)))
            ids = served.chat_ids(prompt)
            overflow = context_error(len(ids), int(max_new), served.max_seq_len, "the served context of max_seq_len")
            if overflow:  # refused before it joins the queue
                raise ValueError(f"row {len(requests)}: {overflow}")
            requests.append(BatchRequest(len(requests), ids, int(max_new), sampling, served.stop_ids))
        try:
            out = served.scheduler.generate(requests)
        except SchedulerError as e:
            raise _http_error(e) from None
        return [served.tokenizer.decode(g.tokens, skip_special_tokens=True) for g in out]


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
