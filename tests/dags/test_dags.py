"""The retraining DAG: it parses, its graph is the stage graph, commands render safely, the gate branches."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DAGS = REPO / "dags"


@pytest.fixture(scope="module")
def airflow_env(tmp_path_factory):
    """Airflow reads AIRFLOW_HOME when first imported: point it at a temp dir before anything imports it."""
    home = tmp_path_factory.mktemp("airflow")
    env = {"AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def load_dag(monkeypatch=None, **variables):
    from airflow.dag_processing.dagbag import DagBag

    for name, value in variables.items():
        monkeypatch.setenv(f"AIRFLOW_VAR_{name.upper()}", value)
    bag = DagBag(str(DAGS))
    assert bag.import_errors == {}
    return bag.dags["draft_retraining"]


def test_dag_graph(airflow_env):
    dag = load_dag()
    stages = ["prepare", "distill", "calibrate", "export", "validate", "register", "promote"]
    assert set(dag.task_ids) == {*stages, "gate", "gate_failed"}
    for up, down in zip(stages[:5], stages[1:5]):
        assert dag.get_task(up).downstream_task_ids == {down}
    assert dag.get_task("validate").downstream_task_ids == {"gate"}
    assert dag.get_task("gate").downstream_task_ids == {"register", "gate_failed"}
    assert dag.get_task("register").downstream_task_ids == {"promote"}
    assert dag.max_active_runs == 1 and dag.catchup is False
    assert dag.schedule == "@weekly"
    assert all(dag.get_task(s).retries == 2 for s in stages)


def test_schedule_and_workdir_from_variables(airflow_env, monkeypatch, tmp_path):
    dag = load_dag(monkeypatch, draftsmith_retraining_schedule="0 3 * * 1", draftsmith_workdir=str(tmp_path))
    assert dag.schedule == "0 3 * * 1"
    assert dag.params["workdir"] == str(tmp_path)


def test_schedule_none_runs_only_when_triggered(airflow_env, monkeypatch):
    """A host retrained only by the drift alert: no scheduled run to race the triggered one."""
    assert load_dag(monkeypatch, draftsmith_retraining_schedule="None").schedule is None


def test_commands_render_with_run_id_and_quoted_params(airflow_env):
    dag = load_dag()
    run = SimpleNamespace(logical_date=datetime(2025, 1, 6, tzinfo=timezone.utc), run_after=None)
    params = {**{k: dag.params[k] for k in dag.params}, "data_source": "my data.jsonl; rm -rf ~"}
    env = dag.get_template_env()

    def render(task_id: str, dag_run=run) -> str:
        return env.from_string(dag.get_task(task_id).bash_command).render(params=params, dag_run=dag_run)

    distill = render("distill")
    assert distill.startswith("pipeline run --stage distill --run-id dag-20250106-000000 --config configs/default.yaml")
    assert "data.source='my data.jsonl; rm -rf ~'" in distill  # one shell word, not a second command
    assert render("validate").endswith("|| test $? -eq 3")
    manual = SimpleNamespace(logical_date=None, run_after=datetime(2025, 2, 1, 12, 30, tzinfo=timezone.utc))
    assert "--run-id dag-20250201-123000 " in render("prepare", manual)


@pytest.mark.parametrize("status,branch", [("completed", "register"), ("gate_failed", "gate_failed")])
def test_gate_branch_reads_validate_record(airflow_env, tmp_path, status, branch):
    dag = load_dag()
    record = tmp_path / "runs" / "dag-20250106-000000" / "validate" / "stage.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"status": status}))
    run = SimpleNamespace(logical_date=datetime(2025, 1, 6, tzinfo=timezone.utc), run_after=None)
    choose = dag.get_task("gate").python_callable
    assert choose(params={"workdir": str(tmp_path), "runs_dir": "runs"}, dag_run=run) == branch


FAKE_PIPELINE = r"""#!/usr/bin/env bash
# Stand-in for the pipeline CLI: log each call; validate records the gate outcome the test asks for.
echo "$*" >> "$FAKE_PIPELINE_LOG"
while [ $# -gt 0 ]; do
  case "$1" in
    --stage) stage=$2; shift;;
    --run-id) run_id=$2; shift;;
    run.dir=*) runs=${1#run.dir=};;
  esac
  shift
done
if [ "$stage" = validate ]; then
  mkdir -p "$runs/$run_id/validate"
  echo "{\"status\": \"$FAKE_GATE\"}" > "$runs/$run_id/validate/stage.json"
  [ "$FAKE_GATE" = completed ] || exit 3
fi
"""


def airflow_cli_env(tmp_path: Path, path_first: Path) -> dict[str, str]:
    return {**os.environ, "AIRFLOW_HOME": str(tmp_path / "airflow"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS), "AIRFLOW_VAR_DRAFTSMITH_WORKDIR": str(tmp_path),
            "PATH": f"{path_first}{os.pathsep}{os.environ['PATH']}"}


def dags_test(env: dict, day: str, conf: dict, timeout: int) -> None:
    airflow = [sys.executable, "-m", "airflow"]
    if not Path(env["AIRFLOW_HOME"], "airflow.db").exists():
        subprocess.run([*airflow, "db", "migrate"], env=env, check=True, capture_output=True)
    res = subprocess.run([*airflow, "dags", "test", "draft_retraining", day, "-c", json.dumps(conf)], env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def test_dag_run_publishes_only_past_the_gate(tmp_path):
    """Real Airflow runs of the DAG with a stand-in `pipeline` on PATH: both sides of the gate."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pipeline").write_text(FAKE_PIPELINE)
    (bin_dir / "pipeline").chmod(0o755)
    env = airflow_cli_env(tmp_path, bin_dir)
    calls = {}
    for day, gate_status in (("2025-01-06", "completed"), ("2025-01-13", "gate_failed")):
        log = tmp_path / f"calls-{gate_status}.txt"
        dags_test({**env, "FAKE_PIPELINE_LOG": str(log), "FAKE_GATE": gate_status}, day,
                  {"data_source": "my chats.jsonl"}, timeout=300)
        calls[gate_status] = log.read_text().splitlines()
    stages = {gate_status: [line.split()[2] for line in lines] for gate_status, lines in calls.items()}
    assert stages["completed"] == ["prepare", "distill", "calibrate", "export", "validate", "register", "promote"]
    assert stages["gate_failed"] == ["prepare", "distill", "calibrate", "export", "validate"]
    assert calls["completed"][0] == ("run --stage prepare --run-id dag-20250106-000000 --config configs/default.yaml "
                                     "data.source=my chats.jsonl run.dir=runs")


@pytest.mark.slow
def test_full_dag_run_on_tiny_config(tmp_path):
    """`airflow dags test` runs every task, shelling out to the real CLI, on a tiny config and data file."""
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"conversations": [
        {"from": "human", "value": f"Count from {i} to {i + 5}."},
        {"from": "gpt", "value": ", ".join(str(j) for j in range(i, i + 6)) + "."}]}) + "\n" for i in range(60)))
    config = tmp_path / "tiny.yaml"
    tiny = yaml.safe_load((REPO / "configs/tiny.yaml").read_text())
    tiny.update(drafter={"kind": "ngram"}, register={"model_name": "dag-test"})
    tiny["data"].update(min_assistant_tokens=4, val_fraction=0.2)
    tiny["validate"]["gate"] = {"min_tau": 1.0, "min_speedup": 0.0}
    config.write_text(yaml.safe_dump(tiny))
    env = airflow_cli_env(tmp_path, Path(sys.executable).parent)  # the `pipeline` entry point of this venv
    dags_test(env, "2025-01-06", {"config": str(config), "data_source": str(data)}, timeout=1500)
    run_dir = tmp_path / "runs" / "dag-20250106-000000"
    validate = json.loads((run_dir / "validate/stage.json").read_text())
    if validate["status"] == "completed":
        promote = json.loads((run_dir / "promote/stage.json").read_text())
        assert promote["metrics"]["promoted"] and promote["metrics"]["champion_version"] == 1
    else:
        assert not (run_dir / "register").exists()


def test_loop_params_reach_every_stage_command(airflow_env):
    """The retraining loop's params (captured traffic, its share, the warm start) become the same overrides on every
    stage, quoted; unset, the commands are as before."""
    from airflow.sdk.exceptions import ParamValidationError

    dag = load_dag()
    run = SimpleNamespace(logical_date=datetime(2025, 1, 6, tzinfo=timezone.utc), run_after=None)
    params = {**{k: dag.params[k] for k in dag.params}, "traffic": "sqlite:////srv/traffic db.sqlite",
              "traffic_share": 0.25, "warm_start": True}
    env = dag.get_template_env()
    loop = " data.traffic='sqlite:////srv/traffic db.sqlite' data.traffic_share=0.25 distill.warm_start=champion"
    for stage in ("prepare", "distill", "calibrate", "export", "validate", "register", "promote"):
        command = env.from_string(dag.get_task(stage).bash_command).render(params=params, dag_run=run)
        assert command.removesuffix(" || test $? -eq 3").endswith(loop), command
        plain = env.from_string(dag.get_task(stage).bash_command).render(
            params={k: dag.params[k] for k in dag.params}, dag_run=run)
        assert "traffic" not in plain and "warm_start" not in plain
    with pytest.raises(ParamValidationError):
        dag.params.get_param("traffic_share").resolve(0)  # traffic's share must be in (0, 1]


@pytest.mark.slow
def test_dag_runs_the_retraining_loop_on_captured_traffic(tmp_path, tiny_chat_target):
    """`airflow dags test` of the loop with the real CLI: a champion (made in this process) served chat requests with
    capture on; the DAG run trains on that traffic from the champion's drafter, validates beside it, and promote
    follows the loop's rule."""
    from support.mlflow_server import mlflow_server
    from support.retraining import MODEL, TINY_EAGLE, base_chats, dotted, run_pipeline, serve_and_capture

    from pipeline.config import load_config
    from pipeline.registry import CHAMPION, registry_client

    chats = base_chats(tmp_path / "chats.jsonl")
    with mlflow_server(tmp_path / "mlflow") as url:
        tree = {**TINY_EAGLE, "target": str(tiny_chat_target), "register": {"model_name": MODEL, "tracking_uri": url}}
        config = tmp_path / "loop.yaml"
        config.write_text(yaml.safe_dump(tree))
        cold = load_config(config, [f"run.dir={tmp_path / 'runs'}", f"data.source={chats}"])
        run_pipeline(cold, "champion")
        traffic = f"sqlite:///{tmp_path / 'traffic.db'}"
        serve_and_capture(cold, traffic)
        env = airflow_cli_env(tmp_path, Path(sys.executable).parent)  # the `pipeline` entry point of this venv
        dags_test(env, "2025-01-06", {"config": str(config), "data_source": str(chats), "traffic": traffic,
                                      "traffic_share": 0.5, "warm_start": True}, timeout=1500)
        run_dir = tmp_path / "runs" / "dag-20250106-000000"
        assert json.loads((run_dir / "prepare/stage.json").read_text())["metrics"]["traffic_read"] == 12
        assert json.loads((run_dir / "distill/stage.json").read_text())["outputs"]["warm_start"] == f"models:/{MODEL}/1"
        m = json.loads((run_dir / "validate/report.json").read_text())["metrics"]
        assert m["compared_with_version"] == 1 and m["traffic_tau"] >= 1.0 and m["champion_traffic_tau"] >= 1.0
        promote = json.loads((run_dir / "promote/stage.json").read_text())
        wins = m["traffic_tau"] > m["champion_traffic_tau"] and m["base_tau"] >= m["champion_base_tau"] - 0.05
        assert promote["metrics"]["promoted"] == wins, promote["message"]
        assert registry_client(cold).get_model_version_by_alias(MODEL, CHAMPION).version == ("2" if wins else "1")
