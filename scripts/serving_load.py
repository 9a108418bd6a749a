"""Serving under load: `pipeline serve`'s command on 127.0.0.1, three times (one request at a time; plain batched
decoding; batched speculation with the measured policy), each driven by 1, 2, 4, 8 concurrent clients.

Reports throughput (answered tokens / wall time, tokens counted by re-encoding the answers), p50/p99 latency and
requests answered, and checks every greedy answer against the one-at-a-time server's answer at one client (which is
batch-1 greedy decoding). The model served is the registry's `--alias` of the configured model name (register a
validated run first: `pipeline run --stage register`).

    python scripts/serving_load.py [--config FILE] [--alias candidate] [--levels 1,2,4,8] [--out FILE] [key=value ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pipeline.bench.harness import default_bench_prompts, device_name
from pipeline.bench.load import free_port, run_load, same_as_reference, start_server, stop
from pipeline.config import load_config
from pipeline.serving.server import serve_invocation
from pipeline.serving.settings import MAX_BATCH_ENV, MAX_QUEUE_ENV, POLICY_ENV
from pipeline.sources import resolve_target

console = Console(stderr=True)
MODES = {"one_at_a_time": {MAX_BATCH_ENV: "1", POLICY_ENV: "fixed"}, "batched_ar": {POLICY_ENV: "plain"},
         "batched_spec": {POLICY_ENV: "measured"}}


def serve(cfg, alias: str, env_overrides: dict[str, str], log: Path):
    port = free_port()
    argv, env = serve_invocation(cfg, port, alias=alias)
    return start_server(argv, env | env_overrides, log, timeout_s=1800), f"http://127.0.0.1:{port}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config")
    ap.add_argument("--alias", default="champion")
    ap.add_argument("--levels", default="1,2,4,8", help="concurrent clients, comma-separated")
    ap.add_argument("--requests", type=int, default=2, help="requests per client at each level")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--modes", default=",".join(MODES), help=f"servers to run, of {', '.join(MODES)}")
    ap.add_argument("--out", default="serving_load.json")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    cfg = load_config(args.config, args.overrides)
    levels = [int(x) for x in args.levels.split(",")]
    modes = args.modes.split(",")
    if unknown := set(modes) - MODES.keys():
        console.print(f"[red]error:[/] --modes {sorted(unknown)}: expected some of {', '.join(MODES)}")
        return 2
    tokenizer = AutoTokenizer.from_pretrained(resolve_target(cfg.target))
    count = lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    prompts = default_bench_prompts()
    report = {"device": device_name(), "alias": f"{cfg.register.model_name}@{args.alias}", "levels": levels,
              "requests_per_client": args.requests, "max_new_tokens": args.max_new_tokens, "modes": {}}
    reference = None
    logs = Path(tempfile.mkdtemp(prefix="serving-load-"))
    for mode in modes:
        env = {MAX_BATCH_ENV: str(max(levels)), MAX_QUEUE_ENV: str(4 * max(levels))} | MODES[mode]
        console.rule(f"{mode} ({', '.join(f'{k}={v}' for k, v in env.items())})")
        proc, url = serve(cfg, args.alias, env, logs / f"{mode}.log")
        try:
            rows = []
            if reference is None and mode == "one_at_a_time":  # every prompt once, one at a time: batch 1
                r = run_load(url, prompts, 1, len(prompts), args.max_new_tokens, count)
                reference = {prompts[i]: a for i, a in r["answers"].items()}
            for level in levels:
                r = run_load(url, prompts, level, level * args.requests, args.max_new_tokens, count)
                r["same_as_batch1"] = None if reference is None else same_as_reference(r, prompts, reference)
                console.print(f"{mode} x{level}: {r['tokens_per_s']:.1f} tok/s, p50 {r['p50_s']:.2f} s, p99 "
                              f"{r['p99_s']:.2f} s, {r['answered']}/{r['requests']} answered, same as batch 1: "
                              f"{r['same_as_batch1']}")
                rows.append({k: v for k, v in r.items() if k != "answers"})
            policy = [line for line in (logs / f"{mode}.log").read_text().splitlines() if "serving " in line]
            report["modes"][mode] = {"env": env, "server": policy[-1] if policy else None, "levels": rows}
        finally:
            stop(proc)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    console.print(f"wrote {args.out} (server logs in {logs})")
    return 0


def print_table(report: dict) -> None:
    table = Table(title=f"serving {report['alias']}: {report['max_new_tokens']} new tokens a request, greedy")
    for col in ("server", "clients", "tok/s", "p50 s", "p99 s", "answered", "= batch 1"):
        table.add_column(col, justify="left" if col == "server" else "right")
    for mode, m in report["modes"].items():
        for r in m["levels"]:
            table.add_row(mode, str(r["concurrency"]), f"{r['tokens_per_s']:.1f}", f"{r['p50_s']:.2f}",
                          f"{r['p99_s']:.2f}", f"{r['answered']}/{r['requests']}",
                          {True: "yes", False: "NO", None: "-"}[r["same_as_batch1"]])
    Console(width=120).print(table)


if __name__ == "__main__":
    sys.exit(main())
