"""A lean target (one packed copy of each weight, runtime.target.loading.from_pretrained(lean=True)) against the plain
one, in one process, alternating, best of 3: prefill seconds for prompts of N random tokens, then ms per decode
forward over 16 new tokens, and whether both decode the same tokens.

    python scripts/lean_vs_plain.py [--target smollm2-135m-instruct] [--lengths 64,256,1024]
"""
from __future__ import annotations

import argparse

import torch

from pipeline.sources import resolve_target
from runtime.speculation.engine import Engine, EngineConfig
from runtime.target.loading import from_pretrained

NEW_TOKENS, REPEATS = 16, 3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--lengths", default="64,256,1024", help="prompt lengths in tokens, comma-separated")
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    target_dir = resolve_target(args.target)
    engines = {}
    for kind in ("plain", "lean"):
        model = from_pretrained(target_dir, max_seq_len=max(lengths) + NEW_TOKENS + 1, lean=kind == "lean")
        engines[kind] = Engine(model, None, EngineConfig(max_seq_len=model.max_seq_len))
    gen = torch.Generator().manual_seed(0)
    for engine in engines.values():  # warm-up: allocator, kernels
        engine.generate(torch.randint(100, 20000, (64,), generator=gen).tolist(), 4)
    for n in lengths:
        ids = torch.randint(100, 20000, (n,), generator=gen).tolist()
        prefill, decode, tokens = {}, {}, {}
        for _ in range(REPEATS):
            for kind, engine in engines.items():
                out = engine.generate(ids, NEW_TOKENS)
                m = out.metrics
                prefill[kind] = min(prefill.get(kind, float("inf")), m.prefill_s)
                decode[kind] = min(decode.get(kind, float("inf")),
                                   1e3 * (m.total_s - m.prefill_s) / max(1, m.target_forwards))
                tokens[kind] = out.tokens
        print(f"{n} tokens: prefill plain {prefill['plain']:.3f} s, lean {prefill['lean']:.3f} s "
              f"(lean/plain {prefill['lean'] / prefill['plain']:.2f}); decode plain {decode['plain']:.1f} ms, "
              f"lean {decode['lean']:.1f} ms per forward; same tokens: {tokens['plain'] == tokens['lean']}")


if __name__ == "__main__":
    main()
