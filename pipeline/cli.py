"""`pipeline`: run stages, show a run's state, benchmark the runtime."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pipeline.errors import DraftsmithError

console = Console(stderr=True)


def _run_store(cfg, run_id: str | None, create: bool):
    from pipeline.runstore import RunStore, latest_run_id, new_run_id

    root = Path(cfg.run.dir)
    run_id = run_id or (None if create else latest_run_id(root)) or new_run_id()
    return RunStore(root, run_id)


def cmd_run(args) -> int:
    from pipeline.config import dump_config, load_config
    from pipeline.home import write_json_atomic
    from pipeline.stages import STAGES, StageContext, check_ready, get_stage, inputs_digest
    from pipeline.tracking import stage_run

    cfg = load_config(args.config, args.overrides)
    # A full run starts a new run id; a single stage continues the newest run unless told which.
    store = _run_store(cfg, args.run_id, create=args.stage is None)
    stages = [get_stage(args.stage)] if args.stage else list(STAGES)
    store.dir.mkdir(parents=True, exist_ok=True)
    (store.dir / "config.yaml").write_text(dump_config(cfg))
    console.print(f"run [bold]{store.run_id}[/] in {store.dir}")
    for stage in stages:
        check_ready(stage, store)
        digest = inputs_digest(stage, cfg, store)
        if store.is_current(stage.name, digest) and not args.force:
            rec = store.record(stage.name)
            console.print(f"[dim]{stage.name}: up to date ({rec['status']}), skipped; --force reruns it[/]")
        else:
            if stage.run is None:
                raise DraftsmithError(f"stage {stage.name} is not implemented yet (issue #{stage.issue}); "
                                      f"the stages before it are done in {store.dir}")
            console.rule(stage.name)
            with stage_run(cfg, store, stage.name, stage.sections):
                rec = store.run_stage(stage.name, digest, lambda out: stage.run(StageContext(cfg, store, out)))
            console.print(f"{stage.name}: {rec['status']} in {rec['seconds']:.1f}s  {rec['message']}")
        if rec["status"] != "completed":
            console.print(f"[red]{stage.name}: {rec['status']}: {rec['message']}[/]")
            return 1
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
            table.add_row(s.name, "pending" if s.run else "[dim]not implemented[/]", "", "")
    Console().print(table)
    return 0


def cmd_config(args) -> int:
    from pipeline.config import dump_config, load_config

    print(dump_config(load_config(args.config, args.overrides)), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from pipeline.stages import STAGE_NAMES

    p = argparse.ArgumentParser(prog="pipeline", description="Train, calibrate, validate and register drafters.")
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
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except DraftsmithError as e:
        console.print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]: finished stages are kept; rerun to continue")
        return 130


if __name__ == "__main__":
    sys.exit(main())
