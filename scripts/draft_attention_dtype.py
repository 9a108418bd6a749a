"""A quantspec draft forward (the target's int4 copy, one token) after a prompt of each --contexts length, with its
attention in fp64 (exact_dtype's, which a verify needs) and in the inputs' bf16 (draft_attention_dtype, what a propose
uses), alternating, best of the rounds.

    python scripts/draft_attention_dtype.py [--target qwen2.5-coder-1.5b-instruct] [--contexts 1024,4096]
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch

from pipeline.sources import resolve_target
from runtime.drafters.quantspec import shared_copy
from runtime.target.attention import draft_attention_dtype
from runtime.target.loading import from_pretrained
from runtime.target.quantized_copy import default_scheme

CALLS = 3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    target = from_pretrained(resolve_target(args.target), dtype=torch.bfloat16, max_seq_len=max(contexts) + 16,
                             lean=True)
    copy = shared_copy(target, default_scheme())
    modes = {"fp64": contextlib.nullcontext, "bf16": draft_attention_dtype}
    with torch.inference_mode():
        for n in contexts:
            cache = target.new_cache(1, n + 16)
            target.prefill(torch.randint(0, 5000, (1, n), generator=torch.Generator().manual_seed(0)), cache)
            best = dict.fromkeys(modes, float("inf"))
            for _ in range(args.rounds):
                for name, mode in modes.items():
                    with mode():
                        start = time.perf_counter()
                        for _ in range(CALLS):  # the same slot each call: the cache does not advance
                            copy(torch.tensor([[5]]), cache, cache.lengths[:, None].clone())
                        best[name] = min(best[name], (time.perf_counter() - start) / CALLS)
            print(f"{n} tokens of context: a draft forward with attention in "
                  + ", ".join(f"{name} {1e3 * s:.1f} ms" for name, s in best.items()))


if __name__ == "__main__":
    main()
