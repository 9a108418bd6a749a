"""The stages, one module each in this package, and their graph: what each stage reads from the config and from
earlier stages, and how it runs. StageContext (`context`) is what a stage runs with."""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from pipeline.config import DIGEST_EXEMPT, Config
from pipeline.errors import DraftsmithError
from pipeline.home import digest_json
from pipeline.runstore import RunStore, StageResult
from pipeline.stages.context import StageContext


@dataclass(frozen=True)
class Stage:
    name: str
    sections: tuple[str, ...]  # config sections it reads (beside those of every stage before it)
    impl: str  # "module:function" taking a StageContext
    derived: str | None = None  # "module:function" of the Config: what else it reads, folded into its digest

    def run(self, ctx: StageContext) -> StageResult:
        # imported only when the stage runs: `pipeline status` and the DAG never pay for torch/mlflow imports
        return _function(self.impl)(ctx)


def _function(path: str):
    module, function = path.split(":")
    return getattr(importlib.import_module(module), function)


STAGES: tuple[Stage, ...] = (
    Stage("prepare", ("target", "data", "run"), "pipeline.stages.prepare:run_prepare",
          "pipeline.stages.prepare:derived_inputs"),
    Stage("distill", ("drafter", "distill"), "pipeline.stages.distill:run_distill",
          "pipeline.stages.warm_start:warm_start_inputs"),
    Stage("calibrate", ("calibrate", "validate"), "pipeline.stages.calibrate:run_calibrate"),
    Stage("export", ("export",), "pipeline.stages.export:run_export"),
    Stage("validate", ("validate", "run"), "pipeline.stages.validate:run_validate",
          "pipeline.stages.versus_champion:champion_inputs"),
    Stage("register", ("register",), "pipeline.stages.register:run_register"),
    Stage("promote", ("promote",), "pipeline.stages.register:run_promote"),
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


def sections_through(name: str) -> tuple[str, ...]:
    """The config sections a stage's digest covers: its own and those of every stage before it."""
    stages = STAGES[:STAGES.index(get_stage(name)) + 1]
    return tuple(dict.fromkeys(section for stage in stages for section in stage.sections))


def inputs_digest(stage: Stage, cfg: Config, store: RunStore) -> str:
    """Config sections this stage reads + the digest of the stage before it (a chain, like a Makefile)."""
    dump = cfg.model_dump(mode="json")
    for key in DIGEST_EXEMPT:
        section, _, name = key.partition(".")
        dump[section].pop(name, None)
    prev = previous(stage)
    upstream = store.record(prev.name)["inputs_digest"] if prev else None
    derived = _function(stage.derived)(cfg) if stage.derived else {}
    return digest_json({"stage": stage.name, "config": {k: dump[k] for k in stage.sections}, "upstream": upstream}
                       | ({"derived": derived} if derived else {}))


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
