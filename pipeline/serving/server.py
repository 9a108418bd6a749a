"""`pipeline serve`: MLflow's scoring server over models:/NAME@alias, on 127.0.0.1 by default."""
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
