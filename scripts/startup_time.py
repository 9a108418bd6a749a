"""How long `pipeline serve --openai` takes from its start to its first answered request, on a first start (the
batch policy is measured) and on later ones (it is kept from the first), on this host.

It registers an n-gram drafter bundle for the target in a fresh registry (SQLite, in a temporary directory), promotes
it, and starts the real command with a fresh project home (sharing only the prepared targets), `--starts` times in a
row; each time it sends one chat request (temperature 0, 16 tokens) with the `openai` client until it is answered,
and stops the server.

    python scripts/startup_time.py [--target smollm2-135m-instruct] [--starts 2] [--budget 6x4/24] [--max-batch 8]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from export.bundle_writer import write_bundle
from pipeline.bench.load import free_port
from pipeline.config import load_config
from pipeline.home import home, write_json_atomic
from pipeline.registry import promote_to, register_bundle
from pipeline.runstore import RunStore, StageResult
from pipeline.sources import resolve_target, target_fingerprint
from pipeline.tracking import stage_run
from runtime.speculation.draft_budget import ServedBudget


def registered_champion(root: Path, target: str, budget: ServedBudget) -> list[str]:
    """An n-gram bundle for `target`, validated as serving `budget`, registered and promoted in a registry under
    `root`; the config overrides that point `pipeline serve` at it."""
    overrides = [f"run.dir={root / 'runs'}", f"target={target}", f"register.tracking_uri=sqlite:///{root / 'mlflow.db'}"]
    cfg = load_config(None, overrides)
    store = RunStore(cfg.run.dir, "startup")
    fingerprint = target_fingerprint(resolve_target(target))

    def export(out):
        write_bundle(out / "bundle", {"kind": "ngram", "max_ngram": 4}, None, target_fingerprint=fingerprint,
                     data_digest="startup", config={"drafter": {"kind": "ngram"}}, code_version="startup")
        return StageResult(outputs={"bundle": "bundle"})

    def validate(out):
        write_json_atomic(out / "report.json", {
            "metrics": {"tau": 2.0, "speedup": 1.2, "lossless": True}, "gate": {"passed": True, "reasons": []},
            "budget": {**budget.to_dict(), "lookup_corpus": False}, "validation_digest": "startup"})
        return StageResult(metrics={"speedup": 1.2})

    store.run_stage("export", "export", export)
    store.run_stage("validate", "validate", validate)
    with stage_run(cfg, store, "register", ("register",)):
        version = register_bundle(cfg, store).version
    promote_to(cfg, version)
    return overrides


def first_answer_s(overrides: list[str], env: dict, log: Path) -> float:
    """Seconds from starting `pipeline serve --openai` to its first answered chat request."""
    import openai

    port = free_port()
    argv = [sys.executable, "-m", "pipeline.cli", "serve", "--openai", "--port", str(port), *overrides]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"pipeline serve exited with {proc.returncode}: see {log}")
            try:
                client.chat.completions.create(model="draftsmith-drafter", max_tokens=16, temperature=0,
                                               messages=[{"role": "user", "content": "List three primes."}])
                return time.perf_counter() - start
            except openai.APIConnectionError:
                time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--starts", type=int, default=2)
    p.add_argument("--budget", default="6x4/24", help="the served draft budget (the batch policy also times 3 "
                   "smaller ones and plain decoding at each batch size)")
    p.add_argument("--max-batch", type=int, default=8)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="startup-"))
    overrides = registered_champion(root, args.target, ServedBudget.parse(args.budget))
    (root / "home").mkdir()
    if (home() / "targets").is_dir():  # the targets already prepared here: a first start does not prepare them again
        (root / "home" / "targets").symlink_to(home() / "targets")
    env = {**os.environ, "DRAFTSMITH_HOME": str(root / "home"), "DRAFTSMITH_BATCH_POLICY": "measured",
           "DRAFTSMITH_MAX_BATCH": str(args.max_batch)}
    rows = []
    for i in range(args.starts):
        log = root / f"serve-{i + 1}.log"
        seconds = first_answer_s(overrides, env, log)
        kept = "kept from an earlier start" in log.read_text()
        rows.append({"start": i + 1, "first_answer_s": round(seconds, 1), "batch_policy": "kept" if kept else
                     "measured"})
        print(json.dumps(rows[-1]), flush=True)
    print(f"logs and registry: {root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
