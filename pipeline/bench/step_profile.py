"""Where a speculative step's time goes outside the captured graphs (what a GPU showed:
docs/logs/gpu-2026-11.md, "2026-11-26, later: graph-captured EAGLE drafting measured"). This
profiles the engine as serving runs it (static verify, graphed EAGLE trees; random weights) and says,
per step: the wall time of each phase, the operators dispatched outside the graphs (each a kernel launch on a GPU),
and on a GPU the graph replays, kernel launches, device-busy time and every place the host waits for the device
(torch.cuda's sync debug mode), by file and line. On the CPU, where nothing is captured, the counts include the
static steps run eagerly; apart from them it counts what runs outside the static steps (StepCounter): the
operators, host reads of a tensor and tensors made from host data that a GPU step has to launch or wait for (the
lookup branch's among them, which stay on the host there).

    python -m pipeline.bench.step_profile --random-weights smollm2-135m --dtype bfloat16 [--budget 2x3/6] [--out p.json]
"""
from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.bench.harness import device_name
from pipeline.bench.random_weights import random_models, random_prompts, run_step_tool, step_tool_parser
from runtime.drafters.eagle import EagleModel
from runtime.drafters.shared.draft_head import DraftHead
from runtime.drafters.shared.eagle_drafting import EagleDrafter
from runtime.speculation.draft_budget import ServedBudget
from runtime.speculation.engine import Engine, EngineConfig

VIEWS = {"view", "_unsafe_view", "transpose", "split", "split_with_sizes", "slice", "select", "unsqueeze", "expand",
         "t", "as_strided", "detach", "alias", "permute", "squeeze", "unbind", "chunk", "reshape", "_reshape_alias"}
RUNTIME_CALLS = {"graph_replays": ("cudaGraphLaunch",), "kernel_launches": ("cudaLaunchKernel", "cudaLaunchKernelExC",
                                                                            "cuLaunchKernel", "cuLaunchKernelEx"),
                 "device_syncs": ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize"),
                 "copies": ("cudaMemcpyAsync", "cudaMemcpy")}


class OpCounter(TorchDispatchMode):
    """Counts the operators dispatched (views, and conversions to what a tensor already is, left out: they launch
    nothing)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if name not in VIEWS and not (name == "to" and out is args[0]):  # under inference_mode `to` comes whole
            self.count(name)
        return out

    def count(self, name: str) -> None:
        self.ops[name] += 1


HOST_READS = {"item", "_local_scalar_dense", "is_nonzero"}  # a tensor's value read by the host (and .tolist())


class StepCounter(OpCounter):
    """OpCounter, and apart from it what runs outside the static steps (`eager`): on a GPU each operator there is a
    launch of its own, each host read of a tensor's value (`host_reads`) a wait for the device, and each tensor made
    from host data (`host_copies`) a copy the host waits for. On the CPU these say what a GPU step would do."""

    def __init__(self, engine: Engine):
        super().__init__()
        self.eager: Counter[str] = Counter()
        self.depth = 0  # > 0: inside a static step
        self.steps = [(engine.static, "_step"), (engine.static, "dense_step")] if engine.static else []
        if getattr(engine.drafter, "static", None) is not None:
            self.steps.append((engine.drafter.static, "run_step"))

    def count(self, name: str) -> None:
        super().count(name)
        if not self.depth:
            self.eager["ops"] += 1
            self.eager["host_reads"] += name in HOST_READS
            self.eager["host_copies"] += name == "lift_fresh"

    def __enter__(self):
        def marked(step):
            def run(*args, **kwargs):
                self.depth += 1
                try:
                    return step(*args, **kwargs)
                finally:
                    self.depth -= 1
            return run

        def tolist(tensor):
            self.eager["host_reads"] += not self.depth
            return self.tolist_of(tensor)

        self.saved = [(obj, name, obj.__dict__.get(name)) for obj, name in self.steps]
        for obj, name in self.steps:
            setattr(obj, name, marked(getattr(obj, name)))
        self.tolist_of, torch.Tensor.tolist = torch.Tensor.tolist, tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self.tolist_of
        for obj, name, own in self.saved:  # an instance attribute back as it was, a method's shadow removed
            setattr(obj, name, own) if own is not None else delattr(obj, name)
        return super().__exit__(*exc)


@contextlib.contextmanager
def sync_sites(on_cuda: bool):
    """Collects where the host waits for the device: a Counter of 'file:line' (CUDA only; empty elsewhere)."""
    sites: Counter[str] = Counter()
    if not on_cuda:
        yield sites
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    sites.update(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))


def counted(engine: Engine, prompt: list[int], new_tokens: int) -> dict[str, Counter]:
    """What one generation dispatches and, on a GPU, calls and waits for: Counters of operators, CUDA runtime
    calls, host-wait sites, and the device-busy microseconds (under 'busy_us')."""
    on_cuda = engine.target.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * on_cuda
    with sync_sites(on_cuda) as sites, StepCounter(engine) as ops, profile(activities=activities) as prof:
        engine.generate(prompt, new_tokens)
    events = prof.key_averages()
    busy_us = sum(getattr(e, "self_device_time_total", 0) for e in events
                  if str(getattr(e, "device_type", "")).endswith("CUDA"))
    return {"ops": ops.ops, "eager": ops.eager, "calls": Counter({e.key: e.count for e in events}), "sites": sites,
            "busy_us": Counter(busy=busy_us)}


def profile_engine(engine: Engine, prompt: list[int], new_tokens: int) -> dict:
    """Per-step profile of `engine` generating greedily: phases from an unprofiled run (after a warm-up, which
    captures the graphs), counts from a profiled one less those of the prefill alone (a one-token generation)."""
    engine.generate(prompt, new_tokens)
    m = engine.generate(prompt, new_tokens).metrics
    steps = max(1, m.target_forwards)
    whole, prefill = counted(engine, prompt, new_tokens), counted(engine, prompt, 1)
    ops, eager, calls, sites, busy = (whole[k] - prefill[k] for k in ("ops", "eager", "calls", "sites", "busy_us"))
    report = {"steps": steps, "tau": m.tau, "ms_a_step": m.ms_per_forward,
              **{f"{phase}_ms": 1e3 * getattr(m, f"{phase}_s") / steps for phase in ("draft", "verify", "rollback")},
              "ops_a_step": sum(ops.values()) / steps, "top_ops": {k: v / steps for k, v in ops.most_common(12)},
              **{f"eager_{k}_a_step": eager[k] / steps for k in ("ops", "host_reads", "host_copies")}}
    report["other_ms"] = report["ms_a_step"] - sum(report[f"{p}_ms"] for p in ("draft", "verify", "rollback"))
    if engine.target.device.type == "cuda":
        report |= {name: sum(calls[c] for c in names) / steps for name, names in RUNTIME_CALLS.items()}
        report |= {"device_busy_ms": busy["busy"] / 1e3 / steps,
                   "host_waits": {k: v / steps for k, v in sites.most_common()}}
    return report


@torch.inference_mode()
def step_profile(name: str, dtype: torch.dtype = torch.bfloat16, device: str = "cuda", budget: str = "2x3/6",
                 context: int = 256, new_tokens: int = 64, cache_len: int = 0) -> dict:
    """Profile the static speculative engine on random weights of RANDOM_CONFIGS[name] with a random EAGLE drafter
    (few of its nodes are accepted: the phases' costs, not tau, are the point), after `context` prompt tokens, with
    KV caches of `cache_len` slots or what the generation needs if more."""
    served = ServedBudget.parse(budget)
    max_len = max(cache_len, context + new_tokens + served.tree.max_nodes + served.lookup + 2)
    model = random_models(name, dtype, device, max_len, with_hf=False)[0]
    eagle = EagleModel.from_target(model, DraftHead(model.output)).to(model.device).eval()
    engine = Engine(model, EagleDrafter(eagle, max_len), EngineConfig(max_seq_len=max_len, static_verify=True,
                                                                        **served.engine_fields()))
    prompt = random_prompts(model.config.vocab_size, 1, seed=0, lengths=(context, context))[0]
    return {"target": f"random:{name}", "dtype": str(dtype).removeprefix("torch."), "device": device_name(),
            "torch": torch.__version__, "budget": budget, "context": context, "cache_len": max_len,
            "new_tokens": new_tokens, **profile_engine(engine, prompt, new_tokens)}


def print_profile(p: dict) -> None:
    print(f"{p['target']}, {p['dtype']}, {p['device']}, budget {p['budget']}, {p['context']} tokens of context, "
          f"a cache of {p['cache_len']}, key spans from {p['min_span']}: {p['steps']} steps, tau {p['tau']:.2f}")
    print(f"  a step {p['ms_a_step']:.3f} ms: draft {p['draft_ms']:.3f}, verify {p['verify_ms']:.3f}, rollback "
          f"{p['rollback_ms']:.3f}, the rest {p['other_ms']:.3f}")
    print(f"  operators dispatched a step {p['ops_a_step']:.1f}: " +
          ", ".join(f"{k} {v:.1f}" for k, v in p["top_ops"].items()))
    print(f"  outside the static steps, a step: {p['eager_ops_a_step']:.1f} operators, "
          f"{p['eager_host_reads_a_step']:.1f} host reads of a tensor, {p['eager_host_copies_a_step']:.1f} tensors "
          "made from host data")
    if "graph_replays" in p:
        print(f"  a step: {p['graph_replays']:.1f} graph replays, {p['kernel_launches']:.1f} kernel launches, "
              f"{p['device_syncs']:.1f} synchronize calls, {p['copies']:.1f} copies, device busy "
              f"{p['device_busy_ms']:.3f} ms")
        for site, n in p["host_waits"].items():
            print(f"  host waits at {site}: {n:.2f} a step")


def main(argv: list[str] | None = None) -> int:
    ap = step_tool_parser("where a speculative step's time goes (see runtime/step_profile.py)")
    ap.add_argument("--budget", default="2x3/6", help="DEPTHxWIDTH[/NODES][+LOOKUP][@MAX_TREE]")
    ap.add_argument("--new-tokens", type=int, default=64)
    return run_step_tool(ap, argv, lambda args, dtype, device: step_profile(
        args.random_weights, dtype, device, args.budget, args.context, args.new_tokens, args.cache_len), print_profile)


if __name__ == "__main__":
    raise SystemExit(main())
