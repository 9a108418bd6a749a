"""tau (tokens per target forward) of a SmolLM2-135M-Instruct bundle on a prompt file for each draft budget: what a
bigger verify buys. The speed check is off: it measures how far each budget reaches, as validate does.
tau does not depend on the device in fp32 greedy decoding, so this CPU run tells a GPU, where a verify of 16-32
tokens costs little more than one of 5, which budgets to time there (pipeline.bench.step_costs has the costs).

    python scripts/tau_by_budget.py runs/<id>/export/bundle runs/<id>/validate/prompts.jsonl 1x3/3+16@5 4x4/16+16@31
"""
from __future__ import annotations

import json
import sys
import time

import torch

from pipeline.sources import resolve_target, target_fingerprint
from pipeline.tokens import stop_ids
from runtime.bundle_reader import read_bundle
from runtime.serving.served_engine import served_engine
from runtime.speculation.decode_stats import tokens_per_forward
from runtime.speculation.draft_budget import ServedBudget
from runtime.speculation.sampling import SamplingParams
from runtime.target.loading import from_pretrained

NEW_TOKENS = 128


def main(bundle_dir: str, prompts_file: str, *budgets: str) -> None:
    from transformers import AutoTokenizer

    target_dir = resolve_target("smollm2-135m-instruct")
    bundle = read_bundle(bundle_dir, target_fingerprint(target_dir))
    prompts = [json.loads(line)["ids"] for line in open(prompts_file) if line.strip()]
    stops = stop_ids(AutoTokenizer.from_pretrained(target_dir))
    max_len = max(map(len, prompts)) + NEW_TOKENS + 80
    target = from_pretrained(target_dir, dtype=torch.float32, max_seq_len=max_len)
    for spec in budgets:
        engine = served_engine(bundle, target, max_len, budget=ServedBudget.parse(spec), speed_check=False).engine
        new = forwards = nodes = 0
        start = time.perf_counter()
        for ids in prompts:
            out = engine.generate(ids, NEW_TOKENS, SamplingParams(), stop_ids=stops)
            new, forwards = new + len(out.tokens), forwards + out.metrics.target_forwards
            nodes += out.metrics.draft_nodes
        print(f"{spec}: tau {tokens_per_forward(new, len(prompts), forwards):.2f}, {nodes / forwards:.1f} draft "
              f"nodes a verify, {time.perf_counter() - start:.0f} s on this CPU", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
