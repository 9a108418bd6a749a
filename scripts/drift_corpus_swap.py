"""Which part of a drift candidate moves its tau: its trained drafter or its lookup corpus. Two registered versions of
the drift run (scripts/drift_run.py), each drafter measured with each version's corpus, greedy, its own served budget,
on the fresh code prompts and the old champion's validate prompts, as `drift_run.py --compare` measures them.

    python scripts/drift_corpus_swap.py --workdir DIR OLD NEW
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import drift_run  # noqa: E402


def main() -> int:
    from pipeline.registry import fetch_bundle
    from pipeline.sources import resolve_target, target_fingerprint
    from runtime.bundle_reader import read_bundle

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True, type=Path)
    p.add_argument("versions", nargs=2, type=int, metavar="VERSION")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    runs = args.workdir.resolve() / "runs"
    cfg, _ = drift_run.champion(runs)
    _, fresh = drift_run.drawn_prompts(160, 16)  # drift_run.py's defaults
    sets = drift_run.prompt_sets(cfg, runs, drift_run.registered(cfg, args.versions[0]), fresh)
    fingerprint = target_fingerprint(resolve_target(cfg.target))
    read = {v: read_bundle(fetch_bundle(drift_run.registered(cfg, v)), fingerprint) for v in args.versions}
    swapped = {}
    for d in args.versions:
        for c in args.versions:
            bundle = dataclasses.replace(read[d])
            object.__setattr__(bundle, "lookup_corpus", read[c].lookup_corpus)  # the frozen bundle, one method swapped
            swapped[f"drafter v{d}, corpus v{c}"] = bundle
    print(json.dumps(drift_run.bundle_taus(cfg, swapped, sets, args.max_tokens), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
