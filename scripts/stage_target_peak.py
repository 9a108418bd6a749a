"""Memory of the target as a stage holds it: loaded through StageContext.load_target (lean, in a precision, some
blocks plain as distill keeps them), then a short greedy decode on it. Prints the resident set after the load and
after the decode; run it under `/usr/bin/time -v` for the process's peak. `--plain` loads it as the stages did
before (plain weights and their packed copies) for comparison.

    nice -n 19 /usr/bin/time -v python scripts/stage_target_peak.py --target qwen2.5-coder-1.5b-instruct
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def resident_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def main() -> None:
    from pipeline.config import Config
    from pipeline.runstore import RunStore
    from pipeline.stages.context import StageContext
    from runtime.speculation.engine import Engine, EngineConfig
    from runtime.speculation.sampling import SamplingParams
    from runtime.target.loading import from_pretrained
    from runtime.target.precision import PRECISIONS, float_dtype

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m-instruct", help="a preset, hub id or HF directory")
    p.add_argument("--precision", default="auto", choices=PRECISIONS)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--plain-blocks", type=int, nargs="*", default=[],
                   help="blocks kept plain (distill's eagle: the last)")
    p.add_argument("--plain", action="store_true", help="load without lean, as the stages did before")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens decoded after a 64-token prompt")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ctx = StageContext(Config.model_validate({"target": args.target}), RunStore(Path(tmp), "peak"), Path(tmp))
        start, before = time.perf_counter(), resident_gb()
        if args.plain:
            target = from_pretrained(ctx.target_dir, max_seq_len=args.max_seq_len,
                                     dtype=float_dtype(args.precision, torch.device("cpu")))
        else:
            target = ctx.load_target(args.max_seq_len, args.precision, tuple(args.plain_blocks))
        loaded = time.perf_counter() - start
        print(f"{ctx.target_dir.name}: {target.config.n_layers} layers, {str(target.dtype).removeprefix('torch.')}, "
              f"{'plain' if args.plain else 'lean'}; resident {before:.2f} GB before, {resident_gb():.2f} GB after "
              f"the load ({loaded:.0f} s)")
        prompt = torch.randint(0, target.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
        start = time.perf_counter()
        out = Engine(target, None, EngineConfig(max_seq_len=args.max_seq_len)).generate(
            prompt.tolist(), args.tokens, SamplingParams())
        print(f"decoded {len(out.tokens)} tokens in {time.perf_counter() - start:.1f} s; "
              f"resident {resident_gb():.2f} GB")


if __name__ == "__main__":
    main()
