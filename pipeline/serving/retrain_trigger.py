"""Triggering the retraining DAG when the drift alert goes up: one DAG run per alert through Airflow's REST API
(POST /api/v2/dags/{dag_id}/dagRuns), sent from a thread of its own so that no request waits on Airflow, with a
timeout per call and a bounded number of retries with backoff. Off unless an Airflow URL is given.

Airflow 3's API takes a bearer JWT: a given token, or one obtained from /auth/token with a username and password;
with neither, no Authorization header is sent (a simple auth manager that lets everyone in as admin needs none).
Every attempt for one alert sends the same run id and logical date, so a retry after a reply that was lost cannot
start a second run: Airflow answers 409, and the run is looked up instead.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone

from pipeline.errors import DraftsmithError
from pipeline.serving.settings import env_number

URL_ENV, DAG_ENV, CONF_ENV = "DRAFTSMITH_AIRFLOW_URL", "DRAFTSMITH_AIRFLOW_DAG", "DRAFTSMITH_AIRFLOW_CONF"
TOKEN_ENV, USER_ENV, PASSWORD_ENV = "DRAFTSMITH_AIRFLOW_TOKEN", "DRAFTSMITH_AIRFLOW_USERNAME", "DRAFTSMITH_AIRFLOW_PASSWORD"
TIMEOUT_ENV, RETRIES_ENV = "DRAFTSMITH_AIRFLOW_TIMEOUT_S", "DRAFTSMITH_AIRFLOW_RETRIES"
COOLDOWN_ENV = "DRAFTSMITH_AIRFLOW_COOLDOWN_S"
OUTCOMES = ("triggered", "failed", "cooldown")
log = logging.getLogger("draftsmith.serving")


@dataclass(frozen=True)
class TriggerSettings:
    url: str | None = None  # the Airflow API server's base URL; None: triggering is off
    dag_id: str = "draft_retraining"
    conf: dict = field(default_factory=dict)  # the run's conf: the DAG's params to override
    token: str | None = None
    username: str | None = None
    password: str | None = None
    timeout_s: float = 10.0  # per HTTP call
    retries: int = 3  # further attempts after a failed one (connection errors, timeouts, 5xx, 429)
    backoff_s: float = 1.0  # before the first retry; doubled before each next one
    # after a trigger, alerts this soon start nothing: the run it started is retraining (an alert hovering at its
    # threshold rises again and again)
    cooldown_s: float = 21600.0

    def __post_init__(self):
        if self.url is not None and urllib.parse.urlsplit(self.url).scheme not in ("http", "https"):
            raise DraftsmithError(f"Airflow URL {self.url!r}: expected http://HOST:PORT or https://...")
        if not isinstance(self.conf, dict):
            raise DraftsmithError(f"Airflow run conf {self.conf!r}: expected a JSON object of DAG params")
        if (self.username is None) != (self.password is None):
            raise DraftsmithError(f"${USER_ENV} and ${PASSWORD_ENV}: expected both or neither")
        if self.token and self.username:
            raise DraftsmithError(f"${TOKEN_ENV} and ${USER_ENV}: expected a token or a username and password, "
                                  "not both")

    @staticmethod
    def from_env(url: str | None = None, conf: str | None = None) -> "TriggerSettings":
        """`url` and `conf` (flags) over $DRAFTSMITH_AIRFLOW_URL and $DRAFTSMITH_AIRFLOW_CONF (a JSON object); the
        rest from their variables. A bad one is a one-line error naming it."""
        d = TriggerSettings()
        conf_name = "--airflow-conf" if conf else f"${CONF_ENV}"
        raw = conf or os.environ.get(CONF_ENV) or "{}"
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError as e:
            raise DraftsmithError(f"{conf_name}={raw!r}: expected a JSON object ({e.msg})") from None
        if not isinstance(parsed, dict):
            raise DraftsmithError(f"{conf_name}={raw!r}: expected a JSON object of DAG params")
        return TriggerSettings(url or os.environ.get(URL_ENV) or None, os.environ.get(DAG_ENV) or d.dag_id, parsed,
                               os.environ.get(TOKEN_ENV) or None, os.environ.get(USER_ENV) or None,
                               os.environ.get(PASSWORD_ENV) or None, env_number(TIMEOUT_ENV, d.timeout_s, float, 0.001),
                               env_number(RETRIES_ENV, d.retries, int, 0), d.backoff_s,
                               env_number(COOLDOWN_ENV, d.cooldown_s, float, 0))


class _Refused(Exception):
    """Airflow answered, and asking again would get the same answer."""


class _Retry(Exception):
    """Airflow answered with an error that may pass (5xx, 429)."""


class RetrainTrigger:
    """`fire(reason)` triggers one DAG run in the background; `outcomes` counts them (read by /metrics)."""

    def __init__(self, settings: TriggerSettings):
        if settings.url is None:
            raise DraftsmithError("retraining trigger: no Airflow URL given")
        self.settings = settings
        self.base = settings.url.rstrip("/")
        self.outcomes = Counter({o: 0 for o in OUTCOMES})
        self._count_lock = threading.Lock()  # the checking thread and trigger threads count
        self.thread: threading.Thread | None = None  # the latest trigger's, for whoever wants to wait on it
        self._last: float | None = None  # when the latest trigger that has not failed began (monotonic)

    def fire(self, reason: str) -> threading.Thread | None:
        """Trigger one run from a new daemon thread, unless one began within the cooldown (then None); returns at
        once."""
        with self._count_lock:
            now, last = time.monotonic(), self._last
            if last is not None and now - last < self.settings.cooldown_s:
                self.outcomes["cooldown"] += 1
                log.info("retrain: the drift alert rose again %.0f s after the last trigger, within the %.0f s "
                         "cooldown: no new run", now - last, self.settings.cooldown_s)
                return None
            self._last = now
        when = datetime.now(timezone.utc)
        self.thread = threading.Thread(target=self.run, args=(when, reason), name="retrain-trigger", daemon=True)
        self.thread.start()
        return self.thread

    def run(self, when: datetime, reason: str) -> bool:
        """Trigger the run for an alert raised at `when`, in this thread: whether it was (or had been) created."""
        s = self.settings
        run_id = f"drift__{when.isoformat()}"
        body = {"dag_run_id": run_id, "logical_date": when.isoformat(), "conf": s.conf, "note": reason}
        path = f"/api/v2/dags/{urllib.parse.quote(s.dag_id, safe='')}/dagRuns"
        error = "no attempt made"
        for attempt in range(s.retries + 1):
            if attempt:
                time.sleep(s.backoff_s * 2 ** (attempt - 1))
            try:
                headers = self._auth()
                status, reply = self._call("POST", path, body, headers)
                if status == 409:  # this run id exists: an earlier attempt got through, or the logical date is taken
                    status, reply = self._call("GET", f"{path}/{urllib.parse.quote(run_id, safe='')}", None, headers)
                    if status != 200:
                        raise _Refused(f"HTTP 409 and no run {run_id}: another run of {s.dag_id} has logical date "
                                       f"{when.isoformat()}")
                if status not in (200, 201):
                    raise _Refused(f"POST {path} answered HTTP {status}: {reply.get('detail', reply)}")
            except _Refused as e:
                error = str(e)
                break
            except (OSError, _Retry) as e:  # URLError, timeouts, refused connections, 5xx and 429
                error = f"{e} (attempt {attempt + 1} of {s.retries + 1})"
                continue
            self._count("triggered")
            log.info("retrain: triggered DAG run %s of %s at %s (%s)", reply.get("dag_run_id", run_id), s.dag_id,
                     self.base, reason)
            return True
        with self._count_lock:
            self.outcomes["failed"] += 1
            self._last = None  # nothing is retraining: the next alert tries again
        log.warning("retrain: could not trigger DAG %s at %s: %s", s.dag_id, self.base, error[:500])
        return False

    def _count(self, outcome: str) -> None:
        with self._count_lock:
            self.outcomes[outcome] += 1

    def _auth(self) -> dict[str, str]:
        s = self.settings
        if s.token:
            return {"Authorization": f"Bearer {s.token}"}
        if s.username is None:
            return {}
        status, reply = self._call("POST", "/auth/token", {"username": s.username, "password": s.password}, {})
        if status not in (200, 201) or "access_token" not in reply:
            raise _Refused(f"POST /auth/token for user {s.username!r} answered HTTP {status}: {reply}")
        return {"Authorization": f"Bearer {reply['access_token']}"}

    def _call(self, method: str, path: str, body: dict | None, headers: dict[str, str]) -> tuple[int, dict]:
        """(status, JSON reply) for any answer below 500 but 429; _Retry for those, OSError without an answer."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method,
                                         headers={"Content-Type": "application/json", "Accept": "application/json",
                                                  **headers})
        try:
            with urllib.request.urlopen(request, timeout=self.settings.timeout_s) as r:
                return r.status, _json(r.read())
        except urllib.error.HTTPError as e:
            reply = _json(e.read())
            if e.code >= 500 or e.code == 429:
                raise _Retry(f"{method} {path} answered HTTP {e.code}: {reply}") from None
            return e.code, reply


def _json(raw: bytes) -> dict:
    try:
        value = json.loads(raw)
    except ValueError:
        return {"text": raw.decode(errors="replace")[:300]}
    return value if isinstance(value, dict) else {"value": value}
