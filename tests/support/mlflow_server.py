"""Registry test fixtures: a real `mlflow server` on 127.0.0.1 (sqlite backend, proxied artifacts, a free
port), and a run store holding a validated bundle to register."""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from export.bundle_writer import write_bundle
from pipeline.bench.load import free_port, stop, wait_healthy
from pipeline.home import write_json_atomic
from pipeline.runstore import RunStore, StageResult
from pipeline.stages.context import StageContext
from pipeline.tracking import stage_run

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # the test process is an MLflow client too


@contextmanager
def mlflow_server(root: Path) -> Iterator[str]:
    """Start `mlflow server` with its sqlite db and artifacts under `root`; yield its http:// URL."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = root / "mlflow-server.log"
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
           "--artifacts-destination", str(root / "artifacts")]
    # No job runner: it starts seven huey consumer processes (GenAI jobs) that the registry does not use.
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{url}/health", proc, log)
        yield url
    finally:
        stop(proc)


def validated_run(cfg, run_id: str, speedup: float, *, validation_digest: str = "prompts-a", passed: bool = True,
                  target_fingerprint: str = "target-fp", extra_files: dict | None = None) -> RunStore:
    """A run store holding what export and validate leave behind: a bundle (an n-gram drafter, with `extra_files`)
    and a validation report."""
    store = RunStore(cfg.run.dir, run_id)

    def export(out):
        write_bundle(out / "bundle", {"kind": "ngram", "max_ngram": 4}, None, target_fingerprint=target_fingerprint,
                     data_digest=f"data-{run_id}", config={"drafter": {"kind": "ngram"}, "run": run_id},
                     code_version="test-code", extra_files=extra_files)
        return StageResult(outputs={"bundle": "bundle"})

    def validate(out):
        metrics = {"tau": 2.0, "speedup": speedup, "speedup_hf": speedup * 1.1, "tokens_per_s": 40.0 * speedup,
                   "lossless": True, "acceptance": {"depth1": 0.7}}
        gate = {"passed": passed, "reasons": [] if passed else ["speedup 0.9 < min_speedup 1.0"]}
        budget = {"depth": 3, "width": 1, "nodes": 3, "adaptive": False, "lookup": 0, "max_tree": 0,
                  "lookup_corpus": False}  # what validate ran, as it reports it
        write_json_atomic(out / "report.json", {"metrics": metrics, "gate": gate, "budget": budget,
                                                "validation_digest": validation_digest})
        return StageResult(status="completed" if passed else "gate_failed", metrics={"speedup": speedup})

    store.run_stage("export", "export-digest", export)
    store.run_stage("validate", "validate-digest", validate)
    return store


def run_stage(cfg, store: RunStore, stage: str, fn) -> dict:
    """What `pipeline run --stage` does: an atomic stage dir inside the stage's MLflow run; returns stage.json."""
    with stage_run(cfg, store, stage, (stage,)):
        return store.run_stage(stage, f"{stage}-digest", lambda out: fn(StageContext(cfg, store, out)))
