"""MLflow tracking: one parent run per pipeline run, one nested run per stage.

Inside a stage the nested run is active, so stages log step curves with plain `mlflow.log_metric(..., step=)`.
Default backend: sqlite beside the run store; MLFLOW_TRACKING_URI or register.tracking_uri override it.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from pipeline.config import Config
from pipeline.runstore import RunStore

EXPERIMENT = "draftsmith"
ARTIFACT_SUFFIXES = (".png", ".json", ".jsonl", ".md", ".yaml")  # reports, plots and validate's prompts


def tracking_uri(cfg: Config) -> str:
    return (cfg.register.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{Path(cfg.run.dir).resolve() / 'mlflow.db'}")


def flatten(prefix: str, obj) -> dict:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(flatten(f"{prefix}.{k}" if prefix else k, v))
        return out
    return {prefix: obj}


def _parent_run_id(client, experiment_id: str, run_id: str) -> str:
    """Find or create the parent run of pipeline run `run_id`, so every stage of it nests under one run."""
    found = client.search_runs([experiment_id], f"tags.`draftsmith.run_id` = '{run_id}' and "
                                                "tags.`draftsmith.kind` = 'pipeline'", max_results=1)
    if found:
        return found[0].info.run_id
    run = client.create_run(experiment_id, run_name=run_id,
                            tags={"draftsmith.run_id": run_id, "draftsmith.kind": "pipeline"})
    return run.info.run_id


@contextmanager
def stage_run(cfg: Config, store: RunStore, stage: str, sections: tuple[str, ...]):
    """Open the nested MLflow run of `stage`; on exit log stage.json metrics and the stage's reports."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri(cfg))
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(EXPERIMENT)
    # Artifacts beside the run store rather than in ./mlruns of whatever directory the CLI ran from.
    local = tracking_uri(cfg).startswith("sqlite:")
    exp_id = exp.experiment_id if exp else client.create_experiment(
        EXPERIMENT, artifact_location=(Path(cfg.run.dir).resolve() / "mlartifacts").as_uri() if local else None)
    mlflow.set_experiment(experiment_id=exp_id)
    parent = _parent_run_id(client, exp_id, store.run_id)
    dump = cfg.model_dump(mode="json")
    with mlflow.start_run(run_id=parent):
        with mlflow.start_run(run_name=stage, nested=True,
                              tags={"draftsmith.run_id": store.run_id, "draftsmith.stage": stage}) as run:
            params = flatten("", {k: dump[k] for k in sections})
            mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
            yield run
            rec = store.record(stage) or {}
            numeric = {k: float(v) for k, v in rec.get("metrics", {}).items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if numeric:
                mlflow.log_metrics(numeric)
            mlflow.set_tag("draftsmith.status", rec.get("status", "unknown"))
            for f in sorted(store.stage_dir(stage).glob("*")):
                if f.suffix in ARTIFACT_SUFFIXES and f.is_file():
                    mlflow.log_artifact(str(f), artifact_path=stage)
