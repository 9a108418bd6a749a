"""Our AR decode against quantspec self-speculation at several chain budgets, in one process on one lean target,
alternating prompt by prompt (best of the rounds per method and prompt): tokens a second, the ratio to AR, tau, and
whether every greedy reply equals AR's. No HF phase: `pipeline bench --drafter quantspec` has that.

    python scripts/quantspec_budgets.py --target qwen2.5-coder-0.5b-instruct --budgets 4x1,6x1 --max-new-tokens 64
"""
from __future__ import annotations

import argparse
import time

from pathlib import Path

from pipeline.cli import _bench_prompts
from pipeline.sources import resolve_target
from pipeline.tokens import encode
from runtime.drafters import get_kind
from runtime.speculation.decode_stats import tokens_per_forward
from runtime.speculation.draft_budget import ServedBudget
from runtime.speculation.engine import Engine, EngineConfig
from runtime.target.loading import from_pretrained


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--prompts", default="docs/qwen_bench_prompts.jsonl")
    p.add_argument("--budgets", default="4x1,6x1")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    from transformers import AutoTokenizer

    target_dir = resolve_target(args.target)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [p if isinstance(p, list) else encode(tokenizer, p, True) for p in _bench_prompts(Path(args.prompts))]
    budgets = [ServedBudget.parse(b) for b in args.budgets.split(",")]
    max_len = max(map(len, prompts)) + args.max_new_tokens + max(b.tree.max_nodes for b in budgets) + 1
    target = from_pretrained(target_dir, max_seq_len=max_len, lean=True)
    kind = get_kind("quantspec")
    engines = {"ar": Engine(target, None, EngineConfig(max_seq_len=max_len))}
    for b in budgets:
        drafter = kind.drafter(None, kind.config(None, 0, None), target, max_len, None)
        engines[b.spec] = Engine(target, drafter, EngineConfig(max_seq_len=max_len, speed_check=False,
                                                               **b.engine_fields()))
    for engine in engines.values():  # warm-up
        engine.generate(prompts[0][:8], 4)
    best: dict[tuple[str, int], float] = {}
    replies: dict[tuple[str, int], list[int]] = {}
    forwards: dict[tuple[str, int], int] = {}
    for _ in range(args.rounds):
        for i, ids in enumerate(prompts):
            for name, engine in engines.items():
                start = time.perf_counter()
                out = engine.generate(ids, args.max_new_tokens)
                seconds = time.perf_counter() - start
                best[name, i] = min(best.get((name, i), seconds), seconds)
                replies[name, i], forwards[name, i] = out.tokens, out.metrics.target_forwards
                print(f"prompt {i + 1} {name}: {len(out.tokens) / seconds:.2f} tok/s", flush=True)
    tokens = sum(len(replies["ar", i]) for i in range(len(prompts)))
    ar_rate = tokens / sum(best["ar", i] for i in range(len(prompts)))
    print(f"{args.target}, {len(prompts)} prompts, {args.max_new_tokens} new tokens; ar {ar_rate:.2f} tok/s")
    for b in budgets:
        n = range(len(prompts))
        rate = sum(len(replies[b.spec, i]) for i in n) / sum(best[b.spec, i] for i in n)
        tau = tokens_per_forward(sum(len(replies[b.spec, i]) for i in n), len(prompts),
                                 sum(forwards[b.spec, i] for i in n))
        same = all(replies[b.spec, i] == replies["ar", i] for i in n)
        print(f"quantspec {b.spec}: {rate:.2f} tok/s, {rate / ar_rate:.2f}x AR, tau {tau:.2f}, greedy = AR: {same}")


if __name__ == "__main__":
    main()
