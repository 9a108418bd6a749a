"""`pipeline serve`: MLflow's scoring server over models:/NAME@alias, or (--openai) the OpenAI-compatible server
in this process; on 127.0.0.1 by default."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

from pipeline.config import Config
from pipeline.errors import DraftsmithError
from pipeline.registry import registry_client
from pipeline.serving.settings import BatchSettings
from pipeline.tracking import tracking_uri

SCORING_TIMEOUT_MARGIN_S = 30  # the scoring server's request limit sits this far above ours: ours answers first


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
    timeout = BatchSettings.from_env().timeout_s + SCORING_TIMEOUT_MARGIN_S
    return argv, {**os.environ, "PATH": path, "MLFLOW_TRACKING_URI": uri, "MLFLOW_REGISTRY_URI": uri,
                  "MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT": str(math.ceil(timeout))}


def _check_alias(cfg: Config, alias: str, uri: str) -> None:
    from mlflow.exceptions import MlflowException

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


API_KEY_ENV = "DRAFTSMITH_API_KEY"


def load_champion(cfg: Config, alias: str = "champion"):
    """models:/NAME@alias loaded as the pyfunc loads it (every hash checked), and the tau its validation measured
    (None where the version records none): (ServedModel, validated tau)."""
    import mlflow.pyfunc

    from pipeline.registry import tag_metric

    uri = tracking_uri(cfg)
    _check_alias(cfg, alias, uri)
    name = cfg.register.model_name
    version = registry_client(cfg).get_model_version_by_alias(name, alias)
    model = mlflow.pyfunc.load_model(f"models:/{name}@{alias}")
    return model.unwrap_python_model().served, tag_metric(version.tags, "tau")


def serve_openai(cfg: Config, port: int, host: str = "127.0.0.1", alias: str = "champion",
                 api_key: str | None = None, capture_url: str | None = None, airflow_url: str | None = None,
                 airflow_conf: str | None = None) -> int:
    """The OpenAI-compatible server (pipeline.serving.api_server) over models:/NAME@alias, in the foreground.
    `api_key` (default $DRAFTSMITH_API_KEY): when set, /v1/ requests without it are refused with 401.
    `capture_url` (default $DRAFTSMITH_CAPTURE_URL): a database URL that answered requests are recorded in.
    `airflow_url`, `airflow_conf` (default $DRAFTSMITH_AIRFLOW_URL, $DRAFTSMITH_AIRFLOW_CONF): the Airflow API server
    the drift alert triggers the retraining DAG on, and the run's conf (JSON)."""
    import logging

    import uvicorn

    from pipeline.serving.api_server import build_app
    from pipeline.serving.capture import CaptureSettings, TrafficCapture
    from pipeline.serving.drift import DriftSettings
    from pipeline.serving.retrain_trigger import RetrainTrigger, TriggerSettings

    BatchSettings.from_env()  # bad settings fail here, before the model loads
    drift, capturing = DriftSettings.from_env(), CaptureSettings.from_env(capture_url)
    triggering = TriggerSettings.from_env(airflow_url, airflow_conf)
    capture = TrafficCapture(capturing) if capturing.url else None
    retrain = RetrainTrigger(triggering) if triggering.url else None
    served, tau = load_champion(cfg, alias)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = build_app(served, cfg.register.model_name, api_key=api_key or os.environ.get(API_KEY_ENV) or None,
                    validated_tau=tau, drift=drift, capture=capture, retrain=retrain)
    print(f"OpenAI-compatible API for models:/{cfg.register.model_name}@{alias} (validated tau "
          f"{'unknown' if tau is None else f'{tau:.2f}'}) on http://{host}:{port}/v1"
          + (f"; the drift alert triggers DAG {triggering.dag_id} at {triggering.url}" if retrain else ""),
          file=sys.stderr)
    # no access log: it would record requests refused for want of the API key
    uvicorn.run(app, host=host, port=port, access_log=False, log_level="info")
    return 0
