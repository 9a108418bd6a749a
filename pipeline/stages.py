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
    """What a stage runs with: the run's config and store, its temp output dir, and the helpers stages share."""

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

    def load_target(self, max_seq_len: int | None = None, precision: str = "fp32"):
        """The target on the CPU with a cache of max_seq_len (default: 2048, or the model's context if shorter);
        precision auto|fp32|bf16 (runtime.target.precision: auto is bf16 where bf16 is fast)."""
        import torch

        from runtime.target.model import ModelConfig
        from runtime.target.weights import from_pretrained
        from runtime.target.precision import float_dtype

        if max_seq_len is None:
            max_seq_len = min(2048, ModelConfig.from_dir(self.target_dir).max_position_embeddings)
        return from_pretrained(self.target_dir, max_seq_len=max_seq_len,
                                           dtype=float_dtype(precision, torch.device("cpu")))

    def configured_budget(self):
        """The largest draft budget the run allows (drafter.depth/width/nodes and its lookup branch)."""
        from runtime.speculation.draft_budget import DraftBudget, ServedBudget

        d = self.cfg.drafter
        return ServedBudget(DraftBudget(depth=d.depth, width=d.width, nodes=d.nodes), lookup=d.lookup)

    def stop_ids(self) -> tuple[int, ...]:
        """Where the target's generation ends, as HF `generate` stops for it."""
        from pipeline.tokens import generation_stop_ids

        return generation_stop_ids(self.target_dir)

    def tau_probe(self, prompts: list[list[int]], new_tokens: int):
        """How distill and calibrate measure real tau: the configured tree, greedy, ending at end of turn."""
        from runtime.speculation.tau_probe import TauProbe

        return TauProbe(prompts, self.configured_budget().tree, new_tokens, self.stop_ids())

    def result(self, outputs: dict, metrics: dict, message: str) -> StageResult:
        """A completed stage's result, for stages in the layers below (export.calibrate)."""
        return StageResult(outputs=outputs, metrics=metrics, message=message)

    def validation_set(self):
        """prepare's held-out rows (train.data.TokenizedSet: row(i) -> token ids and assistant mask)."""
        from train.data import TokenizedSet

        return TokenizedSet.load(self.input("prepare") / "val.safetensors")

    def validation_prompts(self, n: int) -> list[list[int]]:
        """Up to n held-out prompts: each row's tokens before its assistant turn."""
        from train.data import prompts_from

        return prompts_from(self.validation_set(), n)

    def lookup_corpus_file(self) -> Path | None:
        """The lookup branch's corpus distill wrote (the target's answers in the training rows); None without."""
        from runtime.bundle_reader import LOOKUP_CORPUS

        path = self.input("distill") / LOOKUP_CORPUS
        return path if path.is_file() else None


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
    Stage("prepare", ("target", "data", "run"), "pipeline.prepare:run_prepare", "pipeline.prepare:cached_streams"),
    Stage("distill", ("drafter", "distill"), "pipeline.distill:run_distill"),
    Stage("calibrate", ("calibrate", "validate"), "export.calibrate.stage:run_calibrate"),
    Stage("export", ("export",), "pipeline.export_stage:run_export"),
    Stage("validate", ("validate", "run"), "pipeline.validate:run_validate"),
    Stage("register", ("register",), "pipeline.registry:run_register"),
    Stage("promote", ("promote",), "pipeline.registry:run_promote"),
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
