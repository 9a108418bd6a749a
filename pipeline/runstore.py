"""The run store: runs/<run_id>/<stage>/ directories, each written atomically with a stage.json.

A stage directory exists only once its stage finished (temp dir + rename), so a later stage can never read
half an output. A stage whose inputs digest matches a finished one is skipped unless forced.
"""
from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import DraftsmithError
from pipeline.home import atomic_dir, write_json_atomic

DONE_STATES = ("completed", "gate_failed")  # a finished stage; gate_failed still blocks register


@dataclass
class StageResult:
    status: str = "completed"  # completed | gate_failed
    outputs: dict = field(default_factory=dict)  # name -> path relative to the stage dir, or a value
    metrics: dict = field(default_factory=dict)
    message: str = ""


class RunStore:
    def __init__(self, root: Path, run_id: str):
        if not run_id or "/" in run_id or run_id.startswith("."):
            raise DraftsmithError(f"run id {run_id!r}: expected a plain name (letters, digits, - _ .)")
        self.root = Path(root)
        self.run_id = run_id
        self.dir = self.root / run_id

    def stage_dir(self, stage: str) -> Path:
        return self.dir / stage

    def record(self, stage: str) -> dict | None:
        """The stage.json of a finished stage, or None."""
        p = self.stage_dir(stage) / "stage.json"
        return json.loads(p.read_text()) if p.exists() else None

    def error_path(self, stage: str) -> Path:
        """Where a failed attempt at `stage` left its error and traceback (removed when the stage completes)."""
        return self.dir / f"{stage}.error.json"

    def last_error(self, stage: str) -> dict | None:
        p = self.error_path(stage)
        return json.loads(p.read_text()) if p.exists() else None

    def is_current(self, stage: str, digest: str) -> bool:
        rec = self.record(stage)
        return rec is not None and rec.get("status") in DONE_STATES and rec.get("inputs_digest") == digest

    def run_stage(self, stage: str, digest: str, fn, **info) -> dict:
        """Run fn(out_dir) -> StageResult inside an atomic stage dir; return the stage.json written."""
        started = time.time()
        err_path = self.error_path(stage)
        try:
            with atomic_dir(self.stage_dir(stage)) as tmp:
                result: StageResult = fn(tmp)
                rec = {"stage": stage, "run_id": self.run_id, "status": result.status, "inputs_digest": digest,
                       "outputs": result.outputs, "metrics": result.metrics, "message": result.message,
                       "started": started, "finished": time.time(),
                       "seconds": round(time.time() - started, 3), **info}
                write_json_atomic(tmp / "stage.json", rec)
        except BaseException as e:
            write_json_atomic(err_path, {"stage": stage, "error": f"{type(e).__name__}: {e}",
                                         "traceback": traceback.format_exc(), "inputs_digest": digest,
                                         "time": time.time()})
            raise
        err_path.unlink(missing_ok=True)
        return rec


def latest_run_id(root: Path) -> str | None:
    runs = [p.parent for p in Path(root).glob("*/config.yaml")]  # run dirs only, not mlflow's files
    return max(runs, key=lambda p: p.stat().st_mtime).name if runs else None


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S")
