"""Run a `pipeline` command with the peak resident memory of each phase of its stage (calibrate or distill) printed
as it ends: the kernel's own high-water mark (VmHWM), reset as each phase starts, so a short spike is not missed as
sampling would miss it. scripts/memory_timeline.py says when a peak falls; this says in which function. The stage's
peak is printed last, over every reset: `/usr/bin/time -v` around this reads the high-water mark it resets, so it
reports less.

    python scripts/phase_memory.py run --config configs/qwen-coder-sibling-lora.yaml --run-id sib --stage calibrate

`--stop-after NAME` first ends the process once the phase NAME (weight_quant, say) returns, to measure one phase
again and again.
"""
from __future__ import annotations

import functools
import importlib
import sys
import time

PHASES = {"calibrate": [  # (module, owner class or None, function)
    ("pipeline.stages.context", "StageContext", "load_target"),
    ("export.calibrate.stage", None, "read_tensors"),
    ("export.calibrate.stage", None, "served_drafter"),
    ("export.calibrate.stage", None, "weight_quant"),
    ("export.calibrate.weights", None, "quantize_state_dict"),
    ("export.calibrate.weights", None, "relative_errors"),
    ("export.calibrate.weights", None, "dequantize_state_dict"),
    ("export.calibrate.weights", None, "served_drafter"),
    ("export.calibrate.stage", None, "calibrate_kv"),
    ("export.calibrate.stage", None, "calibrate_budget"),
    ("export.calibrate.stage", None, "calibrate_specattn"),
    ("export.calibrate.specattn_sweep", None, "calibration_row"),
    ("export.calibrate.specattn_sweep", None, "sparse_nll"),
    ("export.calibrate.specattn_sweep", None, "measure_ceiling"),
    ("runtime.speculation.tau_probe", "TauProbe", "measure"),
], "distill": [
    ("pipeline.stages.context", "StageContext", "load_target"),
    ("pipeline.stages.distill", None, "build"),
    ("train.recipes.lm", None, "build_lm_lora"),
    ("train.trainer", None, "train"),
    ("train.recipes.lm", None, "merge_lora"),
    ("runtime.drafters", None, "drafter_tensors"),
    ("runtime.drafters", None, "drafter_module"),
    ("runtime.drafters", None, "served_drafter"),
    ("runtime.speculation.tau_probe", "TauProbe", "measure"),
]}


def status_gb(field: str) -> float:
    line = next(line for line in open("/proc/self/status") if line.startswith(field + ":"))
    return int(line.split()[1]) / 2**20


highest = 0.0  # the process's peak over every reset


def reset_peak() -> None:
    global highest
    highest = max(highest, status_gb("VmHWM"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size (proc(5))


open_phases: list[float] = []  # per open phase, the highest peak of those it called
start = time.time()


def measured(name: str, fn, stop: bool = False):
    @functools.wraps(fn)
    def phase(*args, **kwargs):
        before = status_gb("VmRSS")
        if open_phases:
            open_phases[-1] = max(open_phases[-1], status_gb("VmHWM"))
        reset_peak()
        open_phases.append(0.0)
        try:
            result = fn(*args, **kwargs)
        finally:
            peak = max(open_phases.pop(), status_gb("VmHWM"))
            if open_phases:
                open_phases[-1] = max(open_phases[-1], peak)
            reset_peak()
            print(f"[memory {time.time() - start:6.0f} s] {'  ' * len(open_phases)}{name}: {before:.2f} GB before, "
                  f"peak {peak:.2f}, after {status_gb('VmRSS'):.2f}", file=sys.stderr, flush=True)
        if stop:
            raise SystemExit(0)
        return result
    return phase


def main() -> int:
    args, stop_after = sys.argv[1:], None
    if args[:1] == ["--stop-after"] and len(args) > 1:
        stop_after, args = args[1], args[2:]
    stage = args[args.index("--stage") + 1] if "--stage" in args[:-1] else "calibrate"
    phases = PHASES.get(stage, [])
    if stop_after is not None and stop_after not in {name for _, _, name in phases}:
        sys.exit(f"phase_memory: --stop-after {stop_after!r} is not a phase of {stage}: expected one of "
                 f"{sorted({name for _, _, name in phases})}")
    for module, owner, name in phases:
        holder = importlib.import_module(module)
        holder = getattr(holder, owner) if owner else holder
        setattr(holder, name, measured(f"{owner + '.' if owner else ''}{name}", getattr(holder, name),
                                       stop=name == stop_after))
    from pipeline.cli import main as pipeline

    try:
        return pipeline(args)
    finally:
        reset_peak()
        print(f"[memory {time.time() - start:6.0f} s] the process's peak: {highest:.2f} GB", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
