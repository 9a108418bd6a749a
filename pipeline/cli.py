"""`pipeline`: run stages, show a run's state, benchmark the runtime."""
from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pipeline.bench.random_weights import add_arguments as add_bench_arguments, default_device
from pipeline.errors import DraftsmithError
from pipeline.flags import Parser, bounded
from runtime.bundle_reader import BundleError
from runtime.host_memory import keep_freed_memory, release_freed_memory

console = Console(stderr=True)
EXIT_GATE_FAILED = 3  # validate ran and its gate said no (the DAG branches on it); 1 = a stage failed, 2 = bad input


def _run_store(cfg, run_id: str | None, create: bool):
    from pipeline.runstore import RunStore, latest_run_id, new_run_id

    root = Path(cfg.run.dir)
    run_id = run_id or (None if create else latest_run_id(root)) or new_run_id()
    return RunStore(root, run_id)


def cmd_run(args) -> int:
    from pipeline.config import dump_config, load_config
    from pipeline.home import write_json_atomic
    from pipeline.stages import STAGES, check_ready, get_stage, inputs_digest
    from pipeline.stages.context import StageContext
    from pipeline.tracking import stage_run

    cfg = load_config(args.config, args.overrides)
    # A full run starts a new run id; a single stage continues the newest run unless told which.
    store = _run_store(cfg, args.run_id, create=args.stage is None)
    stages = [get_stage(args.stage)] if args.stage else list(STAGES)
    check_ready(stages[0], store)  # before the run directory exists: a typo'd --run-id leaves nothing behind
    store.dir.mkdir(parents=True, exist_ok=True)
    (store.dir / "config.yaml").write_text(dump_config(cfg))
    console.print(f"run [bold]{store.run_id}[/] in {store.dir}")
    if cfg.expected_minutes and args.stage is None:
        console.print(f"expected: about {cfg.expected_minutes} minutes for every stage, as measured for this "
                      f"config (docs/)")
    for stage in stages:
        check_ready(stage, store)
        digest = inputs_digest(stage, cfg, store)
        if store.is_current(stage.name, digest) and not args.force:
            rec = store.record(stage.name)
            console.print(f"[dim]{stage.name}: up to date ({rec['status']}), skipped; --force reruns it[/]")
        else:
            console.rule(stage.name)
            try:
                with stage_run(cfg, store, stage.name, stage.sections):
                    rec = store.run_stage(stage.name, digest,
                                          lambda out: stage.run(StageContext(cfg, store, out, digest)))
            except (DraftsmithError, BundleError):
                raise  # bad input: main() prints it and exits 2
            except Exception as e:  # one line here; the traceback is kept for whoever debugs it
                console.print(f"[red]{stage.name}: failed:[/] {type(e).__name__}: {escape(str(e))} (traceback in "
                              f"{store.error_path(stage.name)})", highlight=False, soft_wrap=True)
                return 1
            console.print(f"{stage.name}: {rec['status']} in {rec['seconds']:.1f}s  {escape(rec['message'])}")
            release_freed_memory()  # the stage's target, freed into the heap, is not the next stage's to add to
        if rec["status"] != "completed":
            console.print(f"[red]{stage.name}: {rec['status']}: {escape(rec['message'])}[/]")
            return EXIT_GATE_FAILED if rec["status"] == "gate_failed" else 1
    write_json_atomic(store.dir / "last_run.json", {"stages": [s.name for s in stages]})
    return 0


def cmd_status(args) -> int:
    from pipeline.config import load_config
    from pipeline.stages import STAGES

    cfg = load_config(None, [f"run.dir={args.runs_dir}"] if args.runs_dir else [])
    store = _run_store(cfg, args.run_id, create=False)
    if not store.dir.exists():
        raise DraftsmithError(f"run {store.run_id}: no such run under {store.root}")
    table = Table(title=f"run {store.run_id}")
    for col in ("stage", "state", "seconds", "metrics / message"):
        table.add_column(col)
    for s in STAGES:
        rec, err = store.record(s.name), store.last_error(s.name)
        if rec:
            metrics = ", ".join(f"{k}={v}" for k, v in list(rec["metrics"].items())[:4])
            table.add_row(s.name, rec["status"], f"{rec['seconds']:.1f}", metrics or rec["message"])
        elif err:
            table.add_row(s.name, "[red]failed[/]", "", err["error"][:100])
        else:
            table.add_row(s.name, "pending", "", "")
    Console().print(table)
    return 0


def cmd_config(args) -> int:
    from pipeline.config import dump_config, load_config

    print(dump_config(load_config(args.config, args.overrides)), end="")
    return 0


def cmd_promote(args) -> int:
    from pipeline.config import load_config
    from pipeline.registry import promote_to

    console.print(promote_to(load_config(args.config, args.overrides), args.to))
    return 0


def cmd_serve(args) -> int:
    from pipeline.config import load_config
    from pipeline.serving.server import serve, serve_openai

    cfg = load_config(args.config, args.overrides)
    if args.openai:
        return serve_openai(cfg, args.port, args.host, args.alias, args.api_key, args.capture, args.airflow_url,
                            args.airflow_conf)
    if args.api_key or args.capture or args.airflow_url or args.airflow_conf:
        raise DraftsmithError("--api-key, --capture, --airflow-url and --airflow-conf are the OpenAI-compatible "
                              "server's: pass --openai too")
    return serve(cfg, args.port, args.host, args.alias)


def _bench_prompts(path: Path) -> list[str | list[int]]:
    """--prompts: one prompt per line, or JSONL lines with a string 'prompt' field or token 'ids' (used as they are:
    e.g. validate's held-out conversations, already in the chat template)."""
    import json

    expected = "one prompt per line, or JSONL with a string 'prompt' or a list of token 'ids'"
    if not path.is_file():
        raise DraftsmithError(f"--prompts {path}: no such file ({expected})")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            line = row.get("prompt", row.get("ids")) if isinstance(row, dict) else None
            ids = isinstance(line, list) and line and all(type(t) is int and t >= 0 for t in line)
            if not (isinstance(line, str) or ids):
                raise DraftsmithError(f"--prompts {path}:{n}: a JSON line without a string 'prompt' or a non-empty "
                                      f"list of token 'ids' ({expected})")
        prompts.append(line)
    if not prompts:
        raise DraftsmithError(f"--prompts {path}: no prompts ({expected})")
    return prompts


DEVICE_BUDGET = "device"  # --budget: chosen by timing the bundle's device candidates (runtime.serving.budget_tuner)


def _budget(text: str | None):
    """--budget DEPTHxWIDTH[/NODES][+LOOKUP][@MAX_TREE] -> a ServedBudget; None for none or `device`."""
    from runtime.speculation.draft_budget import ServedBudget

    if text is None or text == DEVICE_BUDGET:
        return None
    try:
        return ServedBudget.parse(text)
    except ValueError as e:
        raise DraftsmithError(f"--budget {e}") from None


def _speculation(args):
    """What `pipeline bench --drafter` names: a weightless kind, or a bundle (hashes and target checked first)."""
    from pipeline.bench.harness import Speculation
    from pipeline.sources import resolve_target, target_fingerprint
    from runtime.bundle_reader import read_bundle
    from runtime.drafters import get_kind, kind_names
    from runtime.serving.budget_tuner import ENGINE_NEW_TOKENS
    from runtime.serving.served_engine import ServedEngine, served_engine
    from runtime.speculation.draft_budget import ServedBudget
    from runtime.speculation.engine import Engine, EngineConfig

    budget, on_device = _budget(args.budget), args.budget == DEVICE_BUDGET
    weightless = [k for k in kind_names() if not get_kind(k).weighted]
    if args.drafter in weightless:
        _needs_bundle(args)
        budget = budget or ServedBudget()
        kind, config = get_kind(args.drafter), {"kind": args.drafter}

        def build(target, max_seq_len, _prompt):
            new_drafter = lambda: kind.drafter(None, config, target, max_seq_len, None)  # noqa: E731
            cfg = EngineConfig(max_seq_len=max_seq_len, **budget.engine_fields())
            return ServedEngine(Engine(target, new_drafter(), cfg), budget, cfg, new_drafter)

        return Speculation(args.drafter, budget.tree.max_nodes + budget.lookup, build)
    if not Path(args.drafter).is_dir():  # before the target loads
        raise DraftsmithError(f"--drafter {args.drafter}: expected {', '.join(map(repr, weightless))} or a bundle "
                              "directory")
    bundle = read_bundle(args.drafter, target_fingerprint(resolve_target(args.target)))
    candidates = [b for b, _ in bundle.device_candidates()] if on_device else []
    if on_device and not candidates:
        raise DraftsmithError(f"--budget device: bundle {args.drafter} lists no device candidates (calibrated "
                              "before they were measured: rerun calibrate and export)")
    served = [budget or bundle.served_budget(ServedBudget())] + candidates
    longest = max(b.tree.max_nodes + b.lookup for b in served)
    return Speculation(args.drafter, longest, lambda target, max_seq_len, prompt: served_engine(
        bundle, target, max_seq_len, budget=budget, device_prompt=prompt if on_device else None,
        specattn_top_p=args.specattn_top_p, graphed=False, new_tokens=min(ENGINE_NEW_TOKENS, args.max_new_tokens)))


def _needs_bundle(args) -> None:
    """--budget device and --specattn-top-p read a bundle's calibration."""
    if args.budget == DEVICE_BUDGET:
        raise DraftsmithError("--budget device needs a bundle (--drafter DIR) with calibrated device candidates")
    if args.specattn_top_p is not None:
        raise DraftsmithError("--specattn-top-p needs a bundle (--drafter DIR) with a SpecAttn layer map")


def cmd_bench(args) -> int:
    import torch

    from pipeline.bench.harness import default_bench_prompts, run_bench
    from pipeline.home import write_json_atomic
    from pipeline.sources import resolve_target
    from runtime.target.precision import float_dtype

    if args.random_weights:  # random weights of a named shape, e.g. on a GPU without a checkpoint
        from pipeline.bench.random_weights import bench_from_args

        write_json_atomic(Path(args.out), bench_from_args(args))
        console.print(f"wrote {args.out}")
        return 0
    _budget(args.budget)  # a malformed spec is an error whatever else is given
    if args.drafter is None:
        _needs_bundle(args)
    if args.context is not None and (args.prompts or args.temperature != 0.0):
        raise DraftsmithError("--context makes its own prompts and decodes greedily: leave out --prompts and "
                              "--temperature")
    prompts = _bench_prompts(Path(args.prompts)) if args.prompts else default_bench_prompts()
    speculation = _speculation(args) if args.drafter is not None else None
    target_dir = resolve_target(args.target)
    device = torch.device(default_device(args.device))
    dtype = getattr(torch, args.dtype) if args.dtype else float_dtype("auto", device)
    # lean everywhere: the drafters a bundle or a weightless kind serves read only the target's embedding and head
    if args.context is not None:
        from pipeline.bench.long_context import run_context_bench

        report = run_context_bench(target_dir, args.context, speculation, args.max_new_tokens, dtype=dtype,
                                   device=str(device), repeats=args.repeats, lean=True)
    elif args.batch > 1:
        from pipeline.bench.batch import run_batch_bench

        if args.temperature != 0.0:
            raise DraftsmithError(f"--batch {args.batch} --temperature {args.temperature}: the batched bench is "
                                  "greedy (it checks every row against its batch-1 decode)")
        report = run_batch_bench(target_dir, prompts, speculation, args.batch, args.max_new_tokens, dtype=dtype,
                                 device=str(device), policy=args.batch_policy, lean=True)
    else:
        report = run_bench(target_dir, prompts, speculation, args.max_new_tokens, args.temperature, dtype=dtype,
                           device=str(device), graphs=not args.no_graphs, compiled=args.compile, lean=True)
    write_json_atomic(Path(args.out), report)
    console.print(f"wrote {args.out}")
    return 0


def build_parser() -> Parser:
    from pipeline.stages import STAGE_NAMES

    p = Parser(prog="pipeline", description="Train, calibrate, validate and register drafters.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the stages (all, or one with --stage)")
    r.add_argument("--config", help="YAML config (default: the embedded default)")
    r.add_argument("--stage", choices=STAGE_NAMES, help="run only this stage, against an existing run")
    r.add_argument("--run-id", help="run directory name (default: new for a full run, newest for --stage)")
    r.add_argument("--force", action="store_true", help="rerun stages even if their inputs are unchanged")
    r.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. distill.steps=200")
    r.set_defaults(fn=cmd_run)
    s = sub.add_parser("status", help="show every stage's state for a run")
    s.add_argument("--run-id")
    s.add_argument("--runs-dir", help="run store root (default: runs)")
    s.set_defaults(fn=cmd_status)
    c = sub.add_parser("config", help="print the resolved config (defaults <- file <- overrides) as YAML")
    c.add_argument("--config")
    c.add_argument("overrides", nargs="*", metavar="key=value")
    c.set_defaults(fn=cmd_config)
    pr = sub.add_parser("promote", help="point alias champion at a registered version (rollback)")
    pr.add_argument("--to", required=True, type=int, metavar="VERSION")
    pr.add_argument("--config")
    pr.add_argument("overrides", nargs="*", metavar="key=value")
    pr.set_defaults(fn=cmd_promote)
    sv = sub.add_parser("serve", help="serve models:/NAME@champion over REST on 127.0.0.1")
    sv.add_argument("--port", type=int, default=5000)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--alias", default="champion")
    sv.add_argument("--openai", action="store_true", help="serve the OpenAI-compatible API (/v1/completions, "
                    "/v1/chat/completions, streaming, /metrics) instead of MLflow's /invocations")
    sv.add_argument("--api-key", help="with --openai: /v1/ requests must send it as a bearer token (default "
                    "$DRAFTSMITH_API_KEY)")
    sv.add_argument("--capture", metavar="DB_URL", help="with --openai: record each answered request's prompt and "
                    "reply in this database (SQLAlchemy URL, e.g. sqlite:///traffic.db; default "
                    "$DRAFTSMITH_CAPTURE_URL; off when neither is set)")
    sv.add_argument("--airflow-url", metavar="URL", help="with --openai: when the drift alert goes up, trigger the "
                    "retraining DAG through the Airflow API server at URL (default $DRAFTSMITH_AIRFLOW_URL; off when "
                    "neither is set)")
    sv.add_argument("--airflow-conf", metavar="JSON", help="with --airflow-url: the triggered run's conf, a JSON "
                    "object of DAG params (default $DRAFTSMITH_AIRFLOW_CONF, else {})")
    sv.add_argument("--config")
    sv.add_argument("overrides", nargs="*", metavar="key=value")
    sv.set_defaults(fn=cmd_serve)
    b = sub.add_parser("bench", help="HF generate vs our autoregressive vs our speculative, same prompts")
    b.add_argument("--target", default="smollm2-135m-instruct")
    b.add_argument("--drafter", help="a bundle directory, or a drafter kind without weights (ngram); omit: no "
                   "speculative row")
    b.add_argument("--prompts", help="file: one prompt per line, or JSONL with a string 'prompt' or token 'ids' "
                   "(validate writes its prompts so: runs/<id>/validate/prompts.jsonl)")
    b.add_argument("--temperature", type=bounded(float, 0), default=0.0)
    b.add_argument("--budget", metavar="DxW[/N][+L][@T]|device",
                   help="draft budget instead of the bundle's calibrated one (default for ngram and uncalibrated "
                        "bundles: a depth-5 chain): depth x width, at most N nodes, L lookup nodes, a verify of at "
                        "most T nodes; e.g. 2x3/6+8@5. 'device': the bundle's device candidate that runs fastest "
                        "on this device, timed first (as serving on a GPU chooses)")
    b.add_argument("--specattn-top-p", type=bounded(float, 0, 1, above=True), metavar="P",
                   help="verify sparsely (SpecAttn) with the bundle's layer map at this draft top-p instead of the "
                        "calibrated one (1.0: dense); lossy by design")
    b.add_argument("--context", metavar="N[,N...]",
                   help="prefill time and decode speed at these prompt lengths (tokens, or 'max': the model's "
                        "context), each a document + question prompt of held-out text, e.g. 1024,2048,4096,max")
    b.add_argument("--repeats", type=bounded(int, 1), default=1, help="--context: the fastest of this many runs of each")
    b.add_argument("--batch", type=bounded(int, 1), default=1, metavar="N",
                   help="N > 1: batched speculation, our batched AR decode and HF generate (padded) over the prompts "
                        "in batches of N")
    b.add_argument("--batch-policy", choices=("fixed", "measured"), default="fixed",
                   help="with --batch: the draft budget at each batch size, the served one (fixed) or measured "
                        "first among smaller ones and plain decoding, as serving chooses (measured)")
    add_bench_arguments(b, out="bench.json")
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    keep_freed_memory()
    try:
        return args.fn(args)
    except (DraftsmithError, BundleError) as e:
        console.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]: finished stages are kept; rerun to continue")
        return 130


if __name__ == "__main__":
    sys.exit(main())
