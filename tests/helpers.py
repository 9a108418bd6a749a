"""Helpers shared by several test modules (imported as `helpers`, like mlflow_server)."""
from __future__ import annotations

import torch

from pipeline.runstore import RunStore
from pipeline.stages import StageContext
from runtime.engine import Engine, EngineConfig
from runtime.model import Transformer
from runtime.sampling import SamplingParams
from train.data import TokenizedSet


def self_distilled_rows(target: Transformer, rows: int, prompt_vocab: int, new_tokens: int,
                        max_seq_len: int = 256) -> TokenizedSet:
    """The target's own greedy continuations of random 6-token prompts, loss on the continuation: what
    regeneration gives a real drafter."""
    engine = Engine(target, None, EngineConfig(max_seq_len=max_seq_len))
    g = torch.Generator().manual_seed(0)
    out_rows = []
    for _ in range(rows):
        prompt = torch.randint(0, prompt_vocab, (6,), generator=g).tolist()
        out = engine.generate(prompt, new_tokens, SamplingParams()).tokens
        out_rows.append((prompt + out, [0] * len(prompt) + [1] * len(out)))
    return TokenizedSet.from_rows(out_rows)


def run_stage_on(store: RunStore, stage: str, cfg, target_dir, fn) -> dict:
    """A stage's function run atomically in `store` against `target_dir` (no preset resolution); stage.json."""
    def body(out):
        ctx = StageContext(cfg, store, out, f"digest-{stage}")
        ctx.__dict__["target_dir"] = target_dir  # the cached_property, without resolving a preset
        return fn(ctx)
    return store.run_stage(stage, f"digest-{stage}", body)
