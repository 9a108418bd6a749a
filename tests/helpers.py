"""Helpers shared by several test modules (imported as `helpers`, like mlflow_server)."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
from typing import Callable

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


def run_in_triton_interpreter(check: Callable[..., None], *args: str) -> None:
    """Run `check(*args)`, a module-level function of a test module, in a fresh Python with TRITON_INTERPRET=1.

    Triton chooses interpreter or compiler when a function is decorated -- its own library (tl.sum, tl.zeros)
    included, at `import triton` -- so the variable only works if set before anything imports triton, which
    this pytest process cannot promise."""
    path = inspect.getfile(check)
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(path)!r}); import importlib.util as u; "
            f"s = u.spec_from_file_location('checks', {path!r}); m = u.module_from_spec(s); s.loader.exec_module(m); "
            f"m.{check.__name__}(*{args!r})")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
