"""Retrain the drafter on a schedule: one Airflow task per pipeline stage; publish only what passes the gate.

Tasks shell out to the `pipeline` CLI, so this file needs only Airflow and the standard library. Every stage
is idempotent (unchanged inputs are skipped, `register` finds the version it created before), so retries are
safe. Settings:
- Airflow Variables (or AIRFLOW_VAR_<NAME> environment variables), read when the DAG is parsed:
  `draftsmith_retraining_schedule` (default @weekly; `none`: runs only when triggered, by the drift alert say),
  `draftsmith_workdir` (default: this repository).
- DAG params, per run: `config` (YAML, relative to workdir), `data_source`, `runs_dir`, `workdir`; and the
  retraining loop's: `traffic` (the database URL serving captures into; empty: none), `traffic_share` (of the
  training rows), `warm_start` (distill starts from the champion's drafter). With `traffic`, validate measures the
  candidate beside the champion on the newest traffic and promote moves `champion` only when it wins there.
"""
from __future__ import annotations

import json
import shlex
from datetime import datetime, timedelta, timezone
from pathlib import Path

from airflow.providers.standard.operators.bash import BashOperator
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, Param, Variable, task

DAG_ID = "draft_retraining"
TRAIN_STAGES = ("prepare", "distill", "calibrate", "export", "validate")
PUBLISH_STAGES = ("register", "promote")
GATE_FAILED_EXIT = 3  # `pipeline run` exits with this when validate finished but the gate failed
REPO = Path(__file__).resolve().parents[1]


def schedule(value: str) -> str | None:
    """The schedule Variable: a cron expression or preset, or `none` for no schedule (triggered runs only)."""
    return None if value.strip().lower() == "none" else value


def pipeline_run_id(dag_run) -> str:
    """One pipeline run per DAG run, named after its logical date (manual runs may have none: trigger time)."""
    when = dag_run.logical_date or dag_run.run_after
    return f"dag-{when:%Y%m%d-%H%M%S}"


# every stage gets the same overrides, so each computes the same inputs digests
LOOP_OVERRIDES = ("{% if params.traffic %} data.traffic={{ params.traffic | sh }} "
                  "data.traffic_share={{ params.traffic_share | float }}{% endif %}"
                  "{% if params.warm_start %} distill.warm_start=champion{% endif %}")


def stage_command(stage: str) -> str:
    cmd = (f"pipeline run --stage {stage} --run-id {{{{ draftsmith_run_id(dag_run) }}}} "
           "--config {{ params.config | sh }} data.source={{ params.data_source | sh }} "
           "run.dir={{ params.runs_dir | sh }}" + LOOP_OVERRIDES)
    # A failed gate is a result, not an error: validate succeeds and the branch below skips publishing.
    return f"{cmd} || test $? -eq {GATE_FAILED_EXIT}" if stage == "validate" else cmd


@task.branch(task_id="gate")
def gate(params=None, dag_run=None) -> str:
    """Publish only a drafter whose validation gate passed (validate/stage.json status "completed")."""
    record = Path(params["workdir"], params["runs_dir"], pipeline_run_id(dag_run), "validate", "stage.json")
    status = json.loads(record.read_text())["status"]
    return PUBLISH_STAGES[0] if status == "completed" else "gate_failed"


with DAG(
    DAG_ID,
    schedule=schedule(Variable.get("draftsmith_retraining_schedule", default="@weekly")),
    start_date=datetime(2025, 1, 1, tzinfo=timezone.utc),
    catchup=False,  # a missed week is not worth training for after the fact; the next run uses newer data
    max_active_runs=1,  # runs share the registry and the machine: never overlap
    default_args={"retries": 2, "retry_delay": timedelta(minutes=5),
                  "execution_timeout": timedelta(hours=12)},  # a hung stage must not block every later run
    params={
        "config": Param("configs/default.yaml", type="string", minLength=1,
                        description="pipeline YAML config, relative to workdir"),
        "data_source": Param("sharegpt", type="string", minLength=1,
                             description="dataset preset or ShareGPT-style .json/.jsonl file"),
        "traffic": Param("", type="string", description="SQLAlchemy URL of the captured traffic "
                         "(`pipeline serve --openai --capture URL`) to retrain on; empty: none"),
        "traffic_share": Param(0.5, type="number", exclusiveMinimum=0, maximum=1,
                               description="the share of the training rows that are traffic (1: traffic alone)"),
        "warm_start": Param(False, type="boolean", description="distill starts from the champion's drafter and "
                            "trains distill.warm_steps"),
        "runs_dir": Param("runs", type="string", minLength=1, description="run store root, relative to workdir"),
        "workdir": Param(Variable.get("draftsmith_workdir", default=str(REPO)), type="string", minLength=1,
                         description="directory the pipeline runs in"),
    },
    user_defined_macros={"draftsmith_run_id": pipeline_run_id},
    user_defined_filters={"sh": shlex.quote},  # params come from whoever triggers the run: quote them
    tags=["draftsmith"],
    doc_md=__doc__,
) as dag:
    tasks = {s: BashOperator(task_id=s, bash_command=stage_command(s), cwd="{{ params.workdir }}")
             for s in TRAIN_STAGES + PUBLISH_STAGES}
    for upstream, downstream in zip(TRAIN_STAGES, TRAIN_STAGES[1:]):
        tasks[upstream] >> tasks[downstream]
    branch = gate()
    tasks["validate"] >> branch >> [tasks["register"], EmptyOperator(task_id="gate_failed")]
    tasks["register"] >> tasks["promote"]
