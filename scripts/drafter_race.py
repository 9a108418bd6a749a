"""Drafters for one target raced on the same prompts, in one process, alternating prompt by prompt: our AR decode,
quantspec (the target's quantised copy) at chain budgets, weight schemes and draft threads, bundles at their served
budgets, and a sibling LM (same tokenizer) used as it is as the draft model. Greedy; prints tokens a second, the
ratio to AR, tau, ms per step (draft and verify), and whether every reply equals plain decoding's over the same KV
(AR's, or a bundle's quantised one).

    python scripts/drafter_race.py --target qwen2.5-coder-1.5b-instruct --quantspec 4x1,5x1 \\
        --bundle runs/<id>/export/bundle --sibling qwen2.5-coder-0.5b-instruct --lm-budgets 4x1 --max-new-tokens 128
"""
from __future__ import annotations

import argparse
import itertools
import time
from types import SimpleNamespace
from pathlib import Path

import torch

from pipeline.cli import _bench_prompts
from pipeline.sources import resolve_target, target_fingerprint
from pipeline.tokens import encode, generation_stop_ids
from runtime.bundle_reader import read_bundle
from runtime.drafters import get_kind, quantspec
from runtime.drafters.lm import LMDrafter
from runtime.serving.served_engine import served_engine
from runtime.speculation.decode_stats import tokens_per_forward
from runtime.speculation.draft_budget import ServedBudget
from runtime.speculation.engine import Engine, EngineConfig
from runtime.target.loading import from_pretrained
from runtime.target.precision import PRECISIONS, float_dtype


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--prompts", default="docs/qwen_code_prompts.jsonl")
    p.add_argument("--quantspec", default="", help="chain budgets, e.g. 4x1,5x1")
    p.add_argument("--draft-threads", default="0", help="quantspec: threads a draft runs on, each raced, e.g. 1,2 "
                   "(0: torch's)")
    p.add_argument("--weights", default="auto", help="quantspec: weight schemes, each raced, e.g. int8,int4-g32")
    p.add_argument("--bundle", action="append", default=[], help="a bundle directory, raced at its served budget "
                   "(repeat for several)")
    p.add_argument("--sibling", help="a same-tokenizer LM (preset or directory) drafting as it is")
    p.add_argument("--lm-budgets", default="4x1")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--precision", choices=PRECISIONS, default="auto", help="the target's weights, as pipeline bench")
    args = p.parse_args()
    from transformers import AutoTokenizer

    target_dir = resolve_target(args.target)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [p if isinstance(p, list) else encode(tokenizer, p, True) for p in _bench_prompts(Path(args.prompts))]
    stops = generation_stop_ids(target_dir)
    qs = [ServedBudget.parse(b) for b in args.quantspec.split(",") if b]
    lms = [ServedBudget.parse(b) for b in args.lm_budgets.split(",") if b] if args.sibling else []
    max_len = max(map(len, prompts)) + args.max_new_tokens + 64
    dtype = float_dtype(args.precision, torch.device("cpu"))
    target = from_pretrained(target_dir, dtype=dtype, max_seq_len=max_len, lean=True)
    engines = {"ar": Engine(target, None, EngineConfig(max_seq_len=max_len))}
    reference: dict[str, str] = {}  # a method -> the plain decoding its greedy replies must equal, where not ar
    kind, threads = get_kind("quantspec"), {"ar": quantspec.DRAFT_THREADS}
    for b, n, weights in itertools.product(qs, map(int, args.draft_threads.split(",")), args.weights.split(",")):
        config = kind.config(None, 0, SimpleNamespace(quant_weights=weights))
        drafter = kind.drafter(None, config, target, max_len, None)
        name = f"quantspec {config['weights']} {b.spec}" + (f", draft on {n} thread{'s' * (n > 1)}" if n else "")
        engines[name], threads[name] = Engine(target, drafter, EngineConfig(
            max_seq_len=max_len, speed_check=False, **b.engine_fields())), n or None
    for path in args.bundle:
        bundle = read_bundle(path, target_fingerprint(target_dir))
        served = served_engine(bundle, target, max_len, graphed=False, speed_check=False)
        name = f"{bundle.kind} bundle ({bundle.served_budget(ServedBudget()).spec})"
        if served.engine.cfg.kv_scheme:  # its replies are plain decoding's over the same quantised KV, not ar's
            engines[reference.setdefault(name, f"ar, {served.engine.cfg.kv_scheme} KV")] = served.plain()
        engines[name] = served.engine
    if args.sibling:
        sibling = from_pretrained(resolve_target(args.sibling), dtype=dtype, max_seq_len=max_len)
        for b in lms:
            engines[f"sibling lm {b.spec}"] = Engine(target, LMDrafter(sibling, max_len), EngineConfig(
                max_seq_len=max_len, speed_check=False, **b.engine_fields()))
    for engine in engines.values():  # warm-up
        engine.generate(prompts[0][:8], 4)
    seconds: dict[str, float] = dict.fromkeys(engines, 0.0)
    tokens: dict[str, int] = dict.fromkeys(engines, 0)
    forwards: dict[str, int] = dict.fromkeys(engines, 0)
    replies: dict[tuple[str, int], list[int]] = {}
    for i, ids in enumerate(prompts):
        for name, engine in engines.items():
            quantspec.DRAFT_THREADS = threads.get(name, threads["ar"])
            start = time.perf_counter()
            out = engine.generate(ids, args.max_new_tokens, stop_ids=stops)
            took = time.perf_counter() - start
            seconds[name] += took
            tokens[name] += len(out.tokens)
            forwards[name] += out.metrics.target_forwards
            replies[name, i] = out.tokens
            print(f"prompt {i + 1} {name}: {len(out.tokens)} tokens, {len(out.tokens) / took:.2f} tok/s", flush=True)
    ar = tokens["ar"] / seconds["ar"]
    print(f"\n{args.target}: {len(prompts)} prompts, up to {args.max_new_tokens} new tokens, greedy; "
          f"ar {ar:.2f} tok/s ({1000 * seconds['ar'] / forwards['ar']:.0f} ms per forward)")
    for name in list(engines)[1:]:
        rate = tokens[name] / seconds[name]
        tau = tokens_per_forward(tokens[name], len(prompts), forwards[name])
        ref = reference.get(name, "ar")
        same = all(replies[name, i] == replies[ref, i] for i in range(len(prompts)))
        print(f"{name}: {rate:.2f} tok/s, {rate / ar:.2f}x AR, tau {tau:.2f}, "
              f"{1000 * seconds[name] / forwards[name]:.0f} ms per step, greedy = {ref}: {same}")


if __name__ == "__main__":
    main()
