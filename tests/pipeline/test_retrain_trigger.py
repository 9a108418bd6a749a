"""The drift alert triggers the retraining DAG through a real Airflow API server on 127.0.0.1 (the repository's
dags folder, sqlite, the simple auth manager): one run per alert with the configured conf, seen through the API;
refusals and an unreachable server end in one log line, retried only where asking again can help, and never on
the thread that checked the alert."""
from __future__ import annotations

import logging
import time
from datetime import datetime, timezone

import httpx
import pytest

from pipeline.bench.airflow_local import airflow_api_server
from pipeline.bench.load import free_port
from pipeline.bench.openai_stream import running, served_ngram
from pipeline.errors import DraftsmithError
from pipeline.serving.api_server import build_app
from pipeline.serving.drift import DriftMonitor, DriftSettings
from pipeline.serving.retrain_trigger import RetrainTrigger, TriggerSettings
from runtime.serving.spec_counters import SpecCounters

DAG = "draft_retraining"
CONF = {"data_source": "captured traffic.jsonl", "runs_dir": "runs-drift"}  # plain DAG params


@pytest.fixture(scope="module")
def airflow(tmp_path_factory):
    with airflow_api_server(tmp_path_factory.mktemp("airflow")) as server:
        yield server


def drive(counters: SpecCounters, tokens_per_verify: int, n: int = 4) -> None:
    for _ in range(n):
        counters.record_row(4, tokens_per_verify - 1, True)


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("retrain:")]


def test_each_rising_alert_triggers_one_run_with_the_conf(airflow, caplog):
    caplog.set_level(logging.INFO, logger="draftsmith.serving")
    trigger = RetrainTrigger(TriggerSettings(airflow.url, conf=CONF, username=airflow.username,
                                             password=airflow.password, cooldown_s=0))
    counters = SpecCounters()
    monitor = DriftMonitor(counters, 3.0, DriftSettings(window=4, margin=0.5), trigger.fire)
    runs = []
    for _ in range(2):  # up, down, up again: two alerts, two runs
        drive(counters, 2)
        assert monitor.check()
        first = trigger.thread
        for _ in range(5):  # checks while the alert stays up start nothing
            assert monitor.check() and trigger.thread is first
        first.join(timeout=60)
        assert not first.is_alive()
        runs.append(lines(caplog)[-1].split()[4])
        drive(counters, 4)
        assert not monitor.check()
    assert trigger.outcomes == {"triggered": 2, "failed": 0, "cooldown": 0}
    assert len(lines(caplog)) == 2 and lines(caplog)[0].startswith(f"retrain: triggered DAG run drift__")
    assert f"of {DAG} at {airflow.url} (drift alert: rolling tau 2.00" in lines(caplog)[0]
    listed = {r["dag_run_id"]: r for r in airflow.get(f"dags/{DAG}/dagRuns?limit=100")["dag_runs"]}
    for run_id in runs:
        run = airflow.get(f"dags/{DAG}/dagRuns/{run_id}")
        assert run["conf"] == CONF and run["run_type"] == "manual" and run["state"] == "queued"
        assert run["note"].startswith("drift alert: rolling tau 2.00 over the last 4 drafted verifies, validated "
                                      "tau 3.00, margin 0.50") and run_id in listed


def test_an_alert_rising_again_within_the_cooldown_starts_no_run(airflow, caplog):
    """An alert hovering at its threshold rises again and again: one run per cooldown, the others counted; a trigger
    that failed leaves no cooldown behind."""
    caplog.set_level(logging.INFO, logger="draftsmith.serving")
    trigger = RetrainTrigger(TriggerSettings(airflow.url, conf=CONF, username=airflow.username,
                                             password=airflow.password, cooldown_s=3600))
    counters = SpecCounters()
    monitor = DriftMonitor(counters, 3.0, DriftSettings(window=4, margin=0.5), trigger.fire)
    for _ in range(3):  # up, down, up, down, up
        drive(counters, 2)
        assert monitor.check()
        drive(counters, 4)
        assert not monitor.check()
    trigger.thread.join(timeout=60)
    assert trigger.outcomes == {"triggered": 1, "failed": 0, "cooldown": 2}
    assert sum("within the 3600 s cooldown: no new run" in line for line in lines(caplog)) == 2

    down = RetrainTrigger(TriggerSettings(f"http://127.0.0.1:{free_port()}", retries=0, timeout_s=2, cooldown_s=3600))
    for _ in range(2):  # nothing listens: each alert tries, fails, and leaves the next free to try
        down.fire("test").join(timeout=30)
    assert down.outcomes == {"triggered": 0, "failed": 2, "cooldown": 0}


def test_a_retry_finds_the_run_an_earlier_attempt_created(airflow, caplog):
    """The same alert sent twice (as after a lost reply) is one run, counted as triggered both times; a given
    token is used as it is."""
    caplog.set_level(logging.INFO, logger="draftsmith.serving")
    trigger = RetrainTrigger(TriggerSettings(airflow.url, conf=CONF, token=airflow.token()))
    when = datetime.now(timezone.utc)
    assert trigger.run(when, "first") and trigger.run(when, "again")
    assert trigger.outcomes["triggered"] == 2 and len({line.split()[4] for line in lines(caplog)}) == 1
    run = airflow.get(f"dags/{DAG}/dagRuns/drift__{when.isoformat().replace('+', '%2B')}")
    assert run["note"] == "first" and run["conf"] == CONF


@pytest.mark.parametrize("settings, reason", [
    (dict(password="wrong"), "POST /auth/token for user 'draftsmith' answered HTTP 401"),
    (dict(conf={"data_source": ""}), "HTTP 400"),  # the DAG's param needs minLength 1
    (dict(dag_id="no_such_dag"), "HTTP 404"),
])
def test_a_refusal_is_one_line_and_not_retried(airflow, caplog, settings, reason):
    caplog.set_level(logging.INFO, logger="draftsmith.serving")
    s = dict(url=airflow.url, conf=CONF, username=airflow.username, password=airflow.password, retries=3,
             backoff_s=30.0) | settings
    trigger = RetrainTrigger(TriggerSettings(**s))
    start = time.monotonic()
    assert not trigger.run(datetime.now(timezone.utc), "test")
    assert time.monotonic() - start < 30  # a retry would have waited out the backoff first
    assert trigger.outcomes == {"triggered": 0, "failed": 1, "cooldown": 0}
    (line,) = lines(caplog)
    assert line.startswith(f"retrain: could not trigger DAG {s['dag_id'] if 'dag_id' in s else DAG} at "
                           f"{airflow.url}: ") and reason in line


def test_an_unreachable_airflow_is_retried_a_bounded_number_of_times_off_the_checking_thread(caplog):
    caplog.set_level(logging.INFO, logger="draftsmith.serving")
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    trigger = RetrainTrigger(TriggerSettings(url, retries=2, backoff_s=0.5, timeout_s=2))
    counters = SpecCounters()
    monitor = DriftMonitor(counters, 3.0, DriftSettings(window=4, margin=0.5), trigger.fire)
    drive(counters, 1)
    assert monitor.check()
    assert trigger.thread.is_alive()  # the check returned while the trigger was still trying (1.5 s of backoff)
    trigger.thread.join(timeout=60)
    assert trigger.outcomes == {"triggered": 0, "failed": 1, "cooldown": 0}
    (line,) = lines(caplog)
    assert line.startswith(f"retrain: could not trigger DAG {DAG} at {url}: ") and line.endswith("(attempt 3 of 3)")


def test_the_server_counts_triggers_on_metrics(airflow, tiny_chat_target, tmp_path):
    served = served_ngram(tmp_path, tiny_chat_target)
    trigger = RetrainTrigger(TriggerSettings(airflow.url, conf=CONF, username=airflow.username,
                                             password=airflow.password))
    app = build_app(served, "drafter", validated_tau=3.0, drift=DriftSettings(window=4, margin=0.5), retrain=trigger)
    with running(app) as url:
        assert 'draftsmith_retrain_triggers_total{outcome="triggered"} 0.0' in httpx.get(f"{url}/metrics").text
        drive(served.engine.counters, 2)
        assert "draftsmith_drift_alert 1.0" in httpx.get(f"{url}/metrics").text  # the scrape's check fires it
        trigger.thread.join(timeout=60)
        text = httpx.get(f"{url}/metrics").text
    assert 'draftsmith_retrain_triggers_total{outcome="triggered"} 1.0' in text
    assert 'draftsmith_retrain_triggers_total{outcome="failed"} 0.0' in text


@pytest.mark.parametrize("name, value, message", [
    ("DRAFTSMITH_AIRFLOW_URL", "localhost:8080", "Airflow URL 'localhost:8080': expected http://HOST:PORT"),
    ("DRAFTSMITH_AIRFLOW_CONF", "{data_source: x}", "$DRAFTSMITH_AIRFLOW_CONF='{data_source: x}': expected a JSON "
                                                    "object"),
    ("DRAFTSMITH_AIRFLOW_CONF", "[1]", "$DRAFTSMITH_AIRFLOW_CONF='[1]': expected a JSON object of DAG params"),
    ("DRAFTSMITH_AIRFLOW_USERNAME", "me", "$DRAFTSMITH_AIRFLOW_USERNAME and $DRAFTSMITH_AIRFLOW_PASSWORD: expected "
                                          "both or neither"),
    ("DRAFTSMITH_AIRFLOW_RETRIES", "-1", "$DRAFTSMITH_AIRFLOW_RETRIES='-1': expected an integer >= 0"),
    ("DRAFTSMITH_AIRFLOW_TIMEOUT_S", "soon", "$DRAFTSMITH_AIRFLOW_TIMEOUT_S='soon': expected a number >= 0.001"),
])
def test_bad_trigger_settings_are_one_line_errors_naming_them(monkeypatch, name, value, message):
    monkeypatch.setenv("DRAFTSMITH_AIRFLOW_URL", "http://127.0.0.1:8080")
    monkeypatch.setenv(name, value)
    with pytest.raises(DraftsmithError) as e:
        TriggerSettings.from_env()
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_triggering_is_off_unless_a_url_is_given(monkeypatch):
    monkeypatch.delenv("DRAFTSMITH_AIRFLOW_URL", raising=False)
    s = TriggerSettings.from_env()
    assert s.url is None and s.dag_id == DAG and s.conf == {}
    s = TriggerSettings.from_env("http://127.0.0.1:8080", '{"runs_dir": "r"}')
    assert s.url == "http://127.0.0.1:8080" and s.conf == {"runs_dir": "r"}
    with pytest.raises(DraftsmithError, match="^--airflow-conf='x': expected a JSON object"):
        TriggerSettings.from_env("http://127.0.0.1:8080", "x")


def test_pipeline_serve_checks_the_trigger_flags_before_loading_anything(capsys):
    from pipeline.cli import main

    assert main(["serve", "--airflow-url", "http://127.0.0.1:8080"]) == 2  # the OpenAI server's flag
    assert "pass --openai too" in " ".join(capsys.readouterr().err.split())
    assert main(["serve", "--openai", "--airflow-url", "http://127.0.0.1:8080", "--airflow-conf", "[1]"]) == 2
    assert "--airflow-conf='[1]': expected a JSON object of DAG params" in " ".join(capsys.readouterr().err.split())
