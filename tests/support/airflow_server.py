"""A real Airflow API server on 127.0.0.1 for tests: its own AIRFLOW_HOME with a sqlite db, the repository's dags
folder serialized into it (no scheduler or dag processor runs, so a triggered run stays queued), and the simple auth
manager with one user whose password is known."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from pipeline.bench.load import free_port, stop, wait_healthy

DAGS = Path(__file__).resolve().parents[2] / "dags"
USER, PASSWORD = "draftsmith", "retrain-me"


@dataclass(frozen=True)
class AirflowServer:
    url: str
    username: str
    password: str

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


def airflow_env(home: Path) -> dict[str, str]:
    return {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:user",  # the role allowed to trigger runs
            # a passwords file that already names the user: the manager keeps its password instead of making one
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json")}


@contextmanager
def airflow_api_server(home: Path, timeout_s: float = 600.0) -> Iterator[AirflowServer]:
    """`airflow db migrate`, `airflow dags reserialize`, then `airflow api-server` (one worker, a free port) until
    /api/v2/monitor/health answers; yields it, and stops it after. Each step gets `timeout_s`: together they need
    about 10 s of CPU, which a host busy with other work at a higher priority can stretch to minutes."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "passwords.json").write_text(json.dumps({USER: PASSWORD}))
    env, airflow = airflow_env(home), [sys.executable, "-m", "airflow"]
    for step in (["db", "migrate"], ["dags", "reserialize"]):
        done = subprocess.run([*airflow, *step], env=env, cwd=home, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"airflow {' '.join(step)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    port, log = free_port(), home / "api-server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*airflow, "api-server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                                 "--apps", "core"], env=env, cwd=home, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{url}/api/v2/monitor/health", proc, log, timeout_s)
        yield AirflowServer(url, USER, PASSWORD)
    finally:
        stop(proc)
