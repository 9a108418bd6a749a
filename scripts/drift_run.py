"""The drift run, start to end. A champion trained on the default chat data serves a stream of code requests through
the OpenAI API with traffic capture on; the drift alert fires and triggers the retraining DAG through Airflow's REST
API; the DAG retrains on the captured traffic (warm start from the champion, the base set beside it) and moves
`champion` only to a winner; then the old and the new champion are measured side by side, greedy, on fresh code
prompts and on the champion's own validate prompts.

    python scripts/drift_run.py --workdir DIR [--serve 160] [--fresh 16] [--max-tokens 128] [--clients 4]
    python scripts/drift_run.py --workdir DIR --compare OLD NEW   # only the measurement, of two registered versions

DIR/runs is the run store and its registry; without a champion there the default pipeline runs first to make one.
The DAG's scheduler starts once the stream has been served (a 2-core host cannot serve and train at once), so the
triggered run reads the whole captured stream. Writes DIR/drift_run.json and prints it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from pipeline.bench.airflow_local import airflow_api_server
from pipeline.code_requests import code_prompts
from pipeline.bench.load import free_port, stop, wait_healthy
from pipeline.config import load_config
from pipeline.registry import CHAMPION, RegisteredBundle, alias_ref, aliased

REPO = Path(__file__).resolve().parents[1]
DAG = "draft_retraining"
PIPELINE = str(Path(sys.executable).parent / "pipeline")


def champion(runs: Path) -> tuple[object, RegisteredBundle]:
    """The configuration reading `runs`, and its champion: the default pipeline run first when there is none."""
    cfg = load_config(overrides=[f"run.dir={runs}"])
    ref = aliased(**alias_ref(cfg, CHAMPION))
    if ref is None:
        print(f"no champion in {runs}: running the default pipeline to train one", file=sys.stderr)
        subprocess.run([PIPELINE, "run", f"run.dir={runs}"], check=True)
        ref = aliased(**alias_ref(cfg, CHAMPION))
    return cfg, ref


def prompt_sets(cfg, runs: Path, old: RegisteredBundle, fresh_prompts: list[str]) -> dict[str, list[list[int]]]:
    """The fresh code requests in the chat template, and the old champion's own validate prompts."""
    from transformers import AutoTokenizer

    from pipeline.sources import resolve_target
    from pipeline.tokens import encode

    tokenizer = AutoTokenizer.from_pretrained(resolve_target(cfg.target))
    base_file = runs / version_tag(cfg, old, "run_id") / "validate" / "prompts.jsonl"
    return {"fresh_code": [encode(tokenizer, t) for t in fresh_prompts],
            "base": [json.loads(line)["ids"] for line in base_file.read_text().splitlines()]}


def registered(cfg, version: int) -> RegisteredBundle:
    from pipeline.registry import registered_bundle, registry_client

    name = cfg.register.model_name
    return registered_bundle(registry_client(cfg).get_model_version(name, str(version)),
                             alias_ref(cfg, CHAMPION)["registry_uri"], f"models:/{name}/{version}")


def version_tag(cfg, ref: RegisteredBundle, tag: str) -> str:
    from pipeline.registry import registry_client

    return registry_client(cfg).get_model_version(ref.name, ref.version).tags[tag]


def stage_records(runs: Path) -> dict:
    """The DAG's pipeline run: each stage's seconds and status, and what its validate measured against the champion."""
    [run_dir] = sorted(runs.glob("dag-*"))[-1:]
    records = {p.parent.name: json.loads(p.read_text()) for p in run_dir.glob("*/stage.json")}
    return {"pipeline_run": run_dir.name,
            "stages": {k: {"seconds": round(r.get("seconds", 0)), "status": r["status"]} for k, r in records.items()},
            "validate": {k: v for k, v in records.get("validate", {}).get("metrics", {}).items()
                         if "tau" in k or k == "compared_with_version"}}


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of the server's /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def serve_stream(cfg, workdir: Path, airflow, conf: dict, prompts: list[str], clients: int, max_tokens: int) -> dict:
    """`pipeline serve --openai` over the champion with capture and the drift alert wired to Airflow; the prompts
    sent through the real `openai` client by `clients` threads. When the alert triggered a run, and what was served."""
    import openai

    port, log = free_port(), workdir / "serve.log"
    env = {**os.environ, "DRAFTSMITH_BATCH_POLICY": "fixed",  # the calibrated budget at every batch size: no timing

           "DRAFTSMITH_AIRFLOW_USERNAME": airflow.username, "DRAFTSMITH_AIRFLOW_PASSWORD": airflow.password}
    argv = [PIPELINE, "serve", "--openai", "--port", str(port), "--capture", conf["traffic"], "--airflow-url",
            airflow.url, "--airflow-conf", json.dumps(conf), f"run.dir={cfg.run.dir}"]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{url}/health", proc, log, 1800)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
        start, alert_at, tokens = time.perf_counter(), None, 0

        def ask(prompt: str) -> int:
            reply = client.chat.completions.create(model=cfg.register.model_name, temperature=0,
                                                   max_tokens=max_tokens, messages=[{"role": "user", "content": prompt}])
            return reply.usage.completion_tokens

        with ThreadPoolExecutor(clients) as pool:
            for i, n in enumerate(tqdm(pool.map(ask, prompts), total=len(prompts), desc="serving code requests")):
                tokens += n
                if alert_at is None and metric(url, "draftsmith_retrain_triggers_total", outcome="triggered") >= 1:
                    alert_at = {"request": i + 1, "seconds": round(time.perf_counter() - start, 1)}
        return {"requests": len(prompts), "tokens": tokens, "seconds": round(time.perf_counter() - start, 1),
                "alert": alert_at, "rolling_tau": metric(url, "draftsmith_spec_decode_rolling_tau"),
                "validated_tau": metric(url, "draftsmith_spec_decode_validated_tau")}
    finally:
        stop(proc)


def drawn_prompts(serve: int, fresh: int) -> tuple[list[str], list[str]]:
    """The code requests served (the captured traffic), and the fresh ones the champions are measured on."""
    served = code_prompts(serve, seed=1)
    return served, code_prompts(fresh, seed=2, avoid=set(served))


def measure(cfg, versions: dict[str, RegisteredBundle], prompt_sets: dict[str, list[list[int]]],
            max_new_tokens: int) -> dict:
    """tau of each version's bundle on each prompt set: greedy, its own served budget, the speed check off, as
    validate measures the champion in the loop."""
    from pipeline.registry import fetch_bundle
    from pipeline.sources import resolve_target, target_fingerprint
    from runtime.bundle_reader import read_bundle

    fingerprint = target_fingerprint(resolve_target(cfg.target))
    taus = bundle_taus(cfg, {who: read_bundle(fetch_bundle(ref), fingerprint) for who, ref in versions.items()},
                       prompt_sets, max_new_tokens)
    return {who: {"version": int(ref.version), **taus[who]} for who, ref in versions.items()}


def bundle_taus(cfg, bundles: dict, prompt_sets: dict[str, list[list[int]]], max_new_tokens: int) -> dict:
    """{who: {prompt set: tau}} of each bundle, greedy with its own served budget and the speed check off, on one
    target."""
    import torch

    from pipeline.sources import resolve_target
    from pipeline.stages.context import configured_budget
    from pipeline.stages.validate import greedy_tau
    from pipeline.tokens import generation_stop_ids
    from runtime.serving.served_engine import served_engine
    from runtime.target.loading import from_pretrained
    from runtime.target.precision import float_dtype

    target_dir = resolve_target(cfg.target)
    configured = configured_budget(cfg)
    longest = max(len(p) for ids in prompt_sets.values() for p in ids)
    max_seq_len = longest + max_new_tokens + configured.tree.max_nodes + configured.lookup + 1
    target = from_pretrained(target_dir, max_seq_len=max_seq_len,
                             dtype=float_dtype(cfg.validate.precision, torch.device("cpu")))
    stops, out = generation_stop_ids(target_dir), {}
    for who, bundle in bundles.items():
        engine = served_engine(bundle, target, max_seq_len, fallback=configured, speed_check=False).engine
        out[who] = {name: round(greedy_tau(engine, ids, max_new_tokens, stops, cfg.run.seed, f"{who} on {name}"), 3)
                    for name, ids in prompt_sets.items()}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True, type=Path)
    p.add_argument("--serve", type=int, default=160, help="code requests served (the captured traffic)")
    p.add_argument("--fresh", type=int, default=16, help="fresh code prompts the champions are measured on")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--traffic-share", type=float, default=0.5)
    p.add_argument("--dag-timeout-h", type=float, default=3.0)
    p.add_argument("--compare", nargs=2, type=int, metavar=("OLD", "NEW"), help="measure these two versions only")
    args = p.parse_args()
    workdir = args.workdir.resolve()
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # the DAG's `pipeline`
    runs = workdir / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    cfg, old = champion(runs)
    served_prompts, fresh_prompts = drawn_prompts(args.serve, args.fresh)
    if args.compare:
        old, new = (registered(cfg, v) for v in args.compare)
        report = {"tau": measure(cfg, {"old": old, "new": new}, prompt_sets(cfg, runs, old, fresh_prompts),
                                 args.max_tokens)}
        (workdir / "drift_compare.json").write_text(json.dumps(report, indent=1))
        print(json.dumps(report, indent=1))
        return 0
    conf = {"traffic": f"sqlite:///{workdir / 'traffic.db'}", "traffic_share": args.traffic_share,
            "warm_start": True, "runs_dir": str(runs), "workdir": str(REPO)}
    report = {"old_champion": int(old.version), "conf": conf}
    with airflow_api_server(workdir / "airflow", execute=True, draftsmith_retraining_schedule="none") as airflow:
        report["serving"] = serve_stream(cfg, workdir, airflow, conf, served_prompts, args.clients, args.max_tokens)
        runs_seen = sorted(airflow.get(f"dags/{DAG}/dagRuns")["dag_runs"], key=lambda r: r["queued_at"])
        if not runs_seen:
            print(json.dumps(report, indent=1))
            print("the drift alert triggered no DAG run", file=sys.stderr)
            return 1
        start = time.perf_counter()
        with airflow.executing():
            run = airflow.wait_for_run(DAG, runs_seen[0]["dag_run_id"], args.dag_timeout_h * 3600)
        report["dag_run"] = {"id": run["dag_run_id"], "state": run["state"],
                             "seconds": round(time.perf_counter() - start, 1), **stage_records(runs)}
    new = aliased(**alias_ref(cfg, CHAMPION))
    report["new_champion"] = int(new.version)
    versions = {"old": old} | ({"new": new} if new.version != old.version else {})
    report["tau"] = measure(cfg, versions, prompt_sets(cfg, runs, old, fresh_prompts), args.max_tokens)
    (workdir / "drift_run.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
