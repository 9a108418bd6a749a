"""One-token decode forward of a target against its quantised copies (quantspec's draft) after a 60-token prefill,
each copy on torch's threads and on one, alternating, best of 5 rounds of 3: what a draft step costs beside a target
step.

    python scripts/quantspec_forward.py [--target qwen2.5-coder-1.5b-instruct] [--weights int8,int4-g32]
"""
from __future__ import annotations

import argparse
import time

import torch

from pipeline.sources import resolve_target
from runtime.drafters.quantspec import shared_copy, threads
from runtime.target.loading import from_pretrained

ROUNDS, CALLS, PROMPT = 5, 3, 60


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--weights", default="int8,int4-g32", help="the copies' weight schemes")
    args = p.parse_args()
    target = from_pretrained(resolve_target(args.target), max_seq_len=256, lean=True)
    n = torch.get_num_threads()
    runs = {f"target, {n} threads": (target, target.new_cache(1, 256), n)}
    for scheme in args.weights.split(","):
        copy = shared_copy(target, scheme)
        cache = copy.new_cache(1, 256)
        runs[f"{scheme} copy, {n} threads"] = (copy, cache, n)
        runs[f"{scheme} copy, 1 thread"] = (copy, cache, 1)
    ids = torch.randint(0, 1000, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    best = dict.fromkeys(runs, float("inf"))
    with torch.inference_mode():
        for model, cache, _ in dict.fromkeys(runs.values()):
            if int(cache.lengths[0]) == 0:
                model.prefill(ids, cache)
        for _ in range(ROUNDS):
            for name, (model, cache, count) in runs.items():
                with threads(count):
                    start = time.perf_counter()
                    for _ in range(CALLS):  # the same slot each call: the cache does not advance
                        model(torch.tensor([[5]]), cache, cache.lengths[:, None].clone())
                    best[name] = min(best[name], (time.perf_counter() - start) / CALLS)
    print(f"{args.target}: " + ", ".join(f"{name} {1e3 * s:.1f} ms" for name, s in best.items()))


if __name__ == "__main__":
    main()
