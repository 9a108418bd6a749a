"""What a stage runs with: the run's config and store, its temp output dir, and the helpers stages share."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pipeline.config import Config
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

    def load_target(self, max_seq_len: int | None = None, precision: str = "fp32", plain_blocks: tuple[int, ...] = (),
                    *, min_seq_len: int = 0, blocks: tuple[int, ...] | None = None):
        """The target on the CPU with a cache of max_seq_len (default: 2048, or the model's context if shorter, or
        min_seq_len if longer);
        precision auto|fp32|bf16 (runtime.target.precision: auto is bf16 where bf16 is fast). Lean: one copy of each
        block weight, read and packed block by block (stages only run it forward), but in `plain_blocks`, whose
        plain weights a drafter's initialisation copies. `blocks`: the blocks read (None: all), the others unread
        (runtime.target.loading.from_pretrained)."""
        import torch

        from runtime.host_memory import release_freed_memory
        from runtime.target.loading import from_pretrained
        from runtime.target.model_config import ModelConfig
        from runtime.target.precision import float_dtype

        if max_seq_len is None:
            max_seq_len = max(min_seq_len, min(2048, ModelConfig.from_dir(self.target_dir).max_position_embeddings))
        target = from_pretrained(self.target_dir, max_seq_len=max_seq_len,
                                 dtype=float_dtype(precision, torch.device("cpu")), lean=True,
                                 plain_blocks=plain_blocks, blocks=blocks)
        release_freed_memory()  # the load's buffers and the plain weights lean packing let go
        return target

    def configured_budget(self):
        """The largest draft budget the run allows (drafter.depth/width/nodes and its lookup branch)."""
        return configured_budget(self.cfg)

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


def configured_budget(cfg):
    """The largest draft budget `cfg` allows: drafter.depth/width/nodes and its lookup branch."""
    from runtime.speculation.draft_budget import DraftBudget, ServedBudget

    d = cfg.drafter
    return ServedBudget(DraftBudget(depth=d.depth, width=d.width, nodes=d.nodes), lookup=d.lookup)
