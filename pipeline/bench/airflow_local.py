"""A real Airflow on 127.0.0.1, for tests and the drift run (scripts/drift_run.py): its own AIRFLOW_HOME with a
sqlite db, the repository's dags folder serialized into it, and the simple auth manager with one user whose password
is known. The API server alone leaves a triggered run queued; one started with `execute` can run a scheduler and a
dag processor beside it (LocalExecutor, `AirflowServer.executing`), which carry triggered runs out."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from pipeline.bench.load import free_port, stop, wait_healthy

DAGS = Path(__file__).resolve().parents[2] / "dags"
DAG_STATES_DONE = ("success", "failed")
USER, PASSWORD = "draftsmith", "retrain-me"


@dataclass(frozen=True)
class AirflowServer:
    url: str
    username: str
    password: str
    home: Path
    env: dict[str, str]

    def token(self) -> str:
        """A JWT for the test user, from /auth/token as any API client gets one."""
        body = json.dumps({"username": self.username, "password": self.password}).encode()
        request = urllib.request.Request(f"{self.url}/auth/token", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.loads(r.read())["access_token"]

    def get(self, path: str) -> dict:
        """GET /api/v2/`path` as the test user."""
        request = urllib.request.Request(f"{self.url}/api/v2/{path}",
                                         headers={"Authorization": f"Bearer {self.token()}"})
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.loads(r.read())

    def wait_for_run(self, dag_id: str, run_id: str, timeout_s: float, poll_s: float = 10.0) -> dict:
        """The DAG run once it has succeeded or failed (its JSON); TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            run = self.get(f"dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id, safe='')}")
            if run["state"] in DAG_STATES_DONE:
                return run
            if time.monotonic() > deadline:
                raise TimeoutError(f"DAG run {run_id} still {run['state']} after {timeout_s:.0f}s")
            time.sleep(poll_s)

    @contextmanager
    def executing(self) -> Iterator[None]:
        """`airflow scheduler` and `airflow dag-processor` while inside: queued runs are carried out (the server must
        have been started with execute=True, whose environment they share)."""
        airflow = [sys.executable, "-m", "airflow"]
        procs = [start(self.home, self.env, self.home / f"{part}.log", [*airflow, part])
                 for part in ("scheduler", "dag-processor")]
        try:
            yield
        finally:
            for proc in reversed(procs):
                stop(proc)


def airflow_env(home: Path, port: int | None = None, **variables: str) -> dict[str, str]:
    """The environment every Airflow process of `home` shares; `port`: the API server's, which task runs report to;
    `variables`: Airflow Variables (AIRFLOW_VAR_<NAME>)."""
    executing = {} if port is None else {
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        # the scheduler and the API server must sign and check task tokens with one key
        "AIRFLOW__API_AUTH__JWT_SECRET": (home / "jwt_secret").read_text()}
    return {**os.environ, **executing, **{f"AIRFLOW_VAR_{k.upper()}": v for k, v in variables.items()},
            "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:user",  # the role allowed to trigger runs
            # a passwords file that already names the user: the manager keeps its password instead of making one
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json")}


@contextmanager
def airflow_api_server(home: Path, timeout_s: float = 600.0, execute: bool = False,
                       **variables: str) -> Iterator[AirflowServer]:
    """`airflow db migrate`, `airflow dags reserialize`, then `airflow api-server` (one worker, a free port) until
    /api/v2/monitor/health answers; yields it, and stops it after. Each step gets `timeout_s`: together they need
    about 10 s of CPU, which a host busy with other work at a higher priority can stretch to minutes. `execute`: the
    server also serves the API task runs report to, and the environment is one a scheduler can run in.
    `variables`: Airflow Variables, as airflow_env."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "passwords.json").write_text(json.dumps({USER: PASSWORD}))
    (home / "jwt_secret").write_text(secrets.token_hex(32))
    port = free_port()
    env, airflow = airflow_env(home, port if execute else None, **variables), [sys.executable, "-m", "airflow"]
    for step in (["db", "migrate"], ["dags", "reserialize"]):
        done = subprocess.run([*airflow, *step], env=env, cwd=home, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"airflow {' '.join(step)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    log = home / "api-server.log"
    proc = start(home, env, log, [*airflow, "api-server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                                  "--apps", "all" if execute else "core"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{url}/api/v2/monitor/health", proc, log, timeout_s)
        yield AirflowServer(url, USER, PASSWORD, home, env)
    finally:
        stop(proc)


def start(home: Path, env: dict[str, str], log: Path, argv: list[str]) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(argv, env=env, cwd=home, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
