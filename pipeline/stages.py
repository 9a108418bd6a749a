"""The stage graph: what each stage reads from the config and from earlier stages, and how it runs."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pipeline.config import Config
from pipeline.errors import DraftsmithError
from pipeline.home import digest_json
from pipeline.runstore import RunStore, StageResult


@dataclass
class StageContext:
    cfg: Config
    store: RunStore
    out: Path  # the stage's temp dir; renamed into place when the stage returns
    digest: str = ""  # this stage's inputs digest

    @cached_property
    def target_dir(self) -> Path:
        from pipeline.sources import resolve_target

        return resolve_target(self.cfg.target)

    def input(self, stage: str) -> Path:
        """An earlier stage's finished output dir (the graph already checked it exists)."""
        return self.store.stage_dir(stage)


@dataclass(frozen=True)
class Stage:
    name: str
    sections: tuple[str, ...]  # config sections whose values feed the inputs digest
    impl: str | None  # "module:function" taking a StageContext; None: not implemented yet
    issue: int

    @property
    def implemented(self) -> bool:
        return self.impl is not None

    def run(self, ctx: StageContext) -> StageResult:
        # imported only when the stage runs: `pipeline status` and the DAG never pay for torch/mlflow imports
        module, function = self.impl.split(":")
        return getattr(importlib.import_module(module), function)(ctx)


STAGES: tuple[Stage, ...] = (
    Stage("prepare", ("target", "data"), "pipeline.prepare:run_prepare", 4),
    Stage("distill", ("drafter", "distill"), "pipeline.distill:run_distill", 4),
    Stage("calibrate", ("calibrate",), "pipeline.calibrate:run_calibrate", 5),
    Stage("export", ("export",), "pipeline.export_stage:run_export", 6),
    Stage("validate", ("validate", "run"), "pipeline.validate:run_validate", 6),
    Stage("register", ("register",), "pipeline.registry:run_register", 7),
    Stage("promote", ("promote",), "pipeline.registry:run_promote", 7),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


def get_stage(name: str) -> Stage:
    for s in STAGES:
        if s.name == name:
            return s
    raise DraftsmithError(f"unknown stage {name!r}: expected one of {', '.join(STAGE_NAMES)}")


def previous(stage: Stage) -> Stage | None:
    i = STAGES.index(stage)
    return STAGES[i - 1] if i else None


def inputs_digest(stage: Stage, cfg: Config, store: RunStore) -> str:
    """Config sections this stage reads + the digest of the stage before it (a chain, like a Makefile)."""
    dump = cfg.model_dump(mode="json")
    prev = previous(stage)
    upstream = store.record(prev.name)["inputs_digest"] if prev else None
    return digest_json({"stage": stage.name, "config": {k: dump[k] for k in stage.sections}, "upstream": upstream})


def check_ready(stage: Stage, store: RunStore) -> None:
    prev = previous(stage)
    if prev is None:
        return
    rec = store.record(prev.name)
    if rec is None:
        raise DraftsmithError(
            f"stage {stage.name} needs the output of {prev.name}: {store.stage_dir(prev.name)}/stage.json is "
            f"missing; run `pipeline run --stage {prev.name} --run-id {store.run_id}` first")
    if rec["status"] != "completed":  # e.g. validate's gate failed: nothing downstream may use it
        raise DraftsmithError(f"stage {stage.name} refuses run {store.run_id}: {prev.name} finished with status "
                              f"{rec['status']} ({rec.get('message') or 'no message'})")
