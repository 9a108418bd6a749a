"""Which part of a drift candidate moves its tau: its trained drafter or its lookup corpus. Two registered versions of
the drift run (scripts/drift_run.py), each drafter measured with each version's corpus, greedy, its own served budget,
on the fresh code prompts and the old champion's validate prompts, as `drift_run.py --compare` measures them.

    python scripts/drift_corpus_swap.py --workdir DIR OLD NEW
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import drift_run  # noqa: E402


def main() -> int:
    import torch

    from pipeline.bench.code_prompts import code_prompts
    from pipeline.registry import fetch_bundle
    from pipeline.sources import resolve_target, target_fingerprint
    from pipeline.stages.context import configured_budget
    from pipeline.stages.validate import greedy_tau
    from pipeline.tokens import generation_stop_ids
    from runtime.bundle_reader import read_bundle
    from runtime.serving.served_engine import served_engine
    from runtime.target.loading import from_pretrained
    from runtime.target.precision import float_dtype

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True, type=Path)
    p.add_argument("versions", nargs=2, type=int, metavar="VERSION")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    runs = args.workdir.resolve() / "runs"
    cfg, _ = drift_run.champion(runs)
    served = code_prompts(160, seed=1)  # as drift_run.py's defaults draw them
    old = drift_run.registered(cfg, args.versions[0])
    sets = drift_run.prompt_sets(cfg, runs, old, code_prompts(16, seed=2, avoid=set(served)))
    target_dir, configured = resolve_target(cfg.target), configured_budget(cfg)
    longest = max(len(p) for ids in sets.values() for p in ids)
    max_seq_len = longest + args.max_tokens + configured.tree.max_nodes + configured.lookup + 1
    target = from_pretrained(target_dir, max_seq_len=max_seq_len,
                             dtype=float_dtype(cfg.validate.precision, torch.device("cpu")))
    stops = generation_stop_ids(target_dir)
    bundles = {v: read_bundle(fetch_bundle(drift_run.registered(cfg, v)), target_fingerprint(target_dir))
               for v in args.versions}
    corpora = {v: b.lookup_corpus for v, b in bundles.items()}
    rows = []
    for drafter_v in args.versions:
        for corpus_v in args.versions:
            bundle = bundles[drafter_v]
            object.__setattr__(bundle, "lookup_corpus", corpora[corpus_v])  # the frozen bundle, one method swapped
            engine = served_engine(bundle, target, max_seq_len, fallback=configured, speed_check=False).engine
            rows.append({"drafter": drafter_v, "corpus": corpus_v, **{
                name: round(greedy_tau(engine, ids, args.max_tokens, stops, cfg.run.seed,
                                       f"drafter v{drafter_v}, corpus v{corpus_v}, {name}"), 3)
                for name, ids in sets.items()}})
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
