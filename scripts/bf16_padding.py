"""What padding bf16 products to PACKED_MIN_ROWS costs (runtime/target/cpu_packing.py): our AR decode of a lean bf16
target with every product outside a prefill padded to each of --pads rows (1: unpadded), alternating, best of the
rounds, and whether the tokens stay the same.

    python scripts/bf16_padding.py [--target qwen2.5-coder-1.5b-instruct] [--pads 1,5,8,16]
"""
from __future__ import annotations

import argparse

import torch

from pipeline.sources import resolve_target
from runtime.speculation.engine import Engine, EngineConfig
from runtime.target import cpu_packing
from runtime.target.loading import from_pretrained

PROMPT = list(range(1000, 1060))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--pads", default="1,5,8,16")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    target = from_pretrained(resolve_target(args.target), dtype=torch.bfloat16, max_seq_len=512, lean=True)
    engine = Engine(target, None, EngineConfig(max_seq_len=512))
    pads = [int(x) for x in args.pads.split(",")]
    best, tokens = dict.fromkeys(pads, float("inf")), {}
    for _ in range(args.rounds):
        for pad in pads:
            cpu_packing.PACKED_MIN_ROWS = pad
            out = engine.generate(PROMPT, args.new_tokens)
            ms = 1e3 * (out.metrics.total_s - out.metrics.prefill_s) / (len(out.tokens) - 1)
            best[pad], tokens[pad] = min(best[pad], ms), out.tokens
    same = len({tuple(t) for t in tokens.values()}) == 1
    print(f"{args.target}: ms a token padded to " + ", ".join(f"{p} rows {best[p]:.1f}" for p in pads)
          + f"; the same tokens: {'yes' if same else 'no'}")


if __name__ == "__main__":
    main()
