"""`pipeline bench`: HF transformers `generate`, our autoregressive decoding and our speculative decoding, measured
in one process on the same prompts, plus how close our decode step comes to the weight-streaming floor.

The floor: a decode step must read every weight once, so it takes at least (weight bytes) / (memory bandwidth).
Bandwidth is measured as a large tensor copy (bytes copied per second, best of several), the tied embedding
is counted once (as the lm_head; the input embedding reads one row).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import torch
from tqdm import tqdm

from pipeline.errors import DraftsmithError
from pipeline.tokens import encode, stop_ids
from runtime.device import cpu_model, synchronizer
from runtime.host_memory import release_freed_memory
from runtime.serving.budget_tuner import describe
from runtime.serving.served_engine import ServedEngine, static_verify_config
from runtime.speculation.decode_stats import tokens_per_forward
from runtime.speculation.drafter import Drafter
from runtime.speculation.engine import Engine, EngineConfig, Generation
from runtime.speculation.sampling import SamplingParams
from runtime.target.attention import pick_backend
from runtime.target.loading import from_pretrained
from runtime.target.model import Transformer
from runtime.target.model_config import ModelConfig, context_error

Method = Callable[[list[int], torch.Generator], tuple[list[int], "Generation | None"]]
T = TypeVar("T")


def default_bench_prompts() -> list[str]:
    """Short user turns; run_bench wraps each in the target's chat template."""
    return ["Write a short poem about the sea.",
            "Explain in three sentences why the sky is blue.",
            "Give me a Python function that reverses a string, with a docstring.",
            "What are the main differences between a list and a tuple in Python?",
            "Summarise the plot of Romeo and Juliet in a paragraph."]


def copy_bandwidth(n_bytes: int = 256 << 20, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes per second of a large tensor copy on `device`, best of `repeats` (into a preallocated tensor: no page
    faults; on CUDA the copy is synchronised on both sides, since it runs asynchronously)."""
    src = torch.ones(n_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sync = synchronizer(src.device)
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - start)
    return n_bytes / best


def weight_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights a decode step streams: every unique parameter except an untied input embedding."""
    unique = {id(p): p for p in model.parameters()}
    if model.output.weight is not model.tok_embeddings.weight:
        unique.pop(id(model.tok_embeddings.weight))
    return sum(p.numel() * p.element_size() for p in unique.values())


@dataclass(frozen=True)
class Speculation:
    """What the speculative rows run: `build(target, max_seq_len, probe_prompt)` gives the served engine (a bundle's
    through runtime.serving.served_engine.served_engine, which may time the device's budgets on the probe prompt)."""
    label: str  # the report's "drafter"
    longest: int  # most draft nodes a verify may hold, lookup branch included: the cache's room for them
    build: Callable[[Transformer, int, list[int]], ServedEngine]


def run_bench(target_dir: str | Path, prompts: list[str | list[int]], speculation: Speculation | None = None,
              max_new_tokens: int = 128, temperature: float = 0.0, *, dtype: torch.dtype = torch.float32,
              device: str = "cpu", graphs: bool = True, chat_template: bool = True, seed: int = 0,
              print_table: bool = True, compiled: bool = False, lean: bool = False) -> dict:
    """Time HF generate, our autoregressive engine and (given `speculation`) our speculative engine on `prompts`.
    A prompt is a user turn (wrapped in the chat template) or token ids, used as they are. On a CUDA device with
    `graphs`, also the CUDA-graph rows (graph_methods; `compiled`: also fused by torch.compile).

    Memory: HF's model is loaded only for its own phase, first, and freed before ours loads; ours has a KV cache of
    the longest prompt + max_new_tokens + the draft room, and with `lean` (on a CPU) one copy of each weight
    (from_pretrained's lean: a `speculation` that builds its drafter from the target's blocks needs them plain)."""
    from transformers import AutoTokenizer

    if not prompts:
        raise ValueError("run_bench: prompts is empty")
    params = SamplingParams(temperature=temperature)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompt_ids = [p if isinstance(p, list) else encode(tokenizer, p, chat_template) for p in prompts]
    stops = stop_ids(tokenizer)
    limit = fitting_context(target_dir, prompt_ids, max_new_tokens)
    max_seq_len = min(limit, max(map(len, prompt_ids)) + max_new_tokens + (speculation.longest if speculation else 0)
                      + 1)  # near the limit, draft trees shrink to the room left
    outputs: dict[str, list[list[int]]] = {}
    # the bandwidth twice, best of two (a busy moment must not lower the bar), while no model is loaded: its
    # buffers then add nothing to the peak
    bandwidth = copy_bandwidth(device=device)
    with tqdm(total=1 + len(prompt_ids), desc="bench", unit="run") as bar:
        results = hf_phase(target_dir, dtype, device, prompt_ids, max_new_tokens, params, stops, seed, outputs, bar)
        bandwidth = max(bandwidth, copy_bandwidth(device=device))
        # CUDA graphs and compiled steps read the plain weights: only the eager CPU rows run lean
        target = from_pretrained(target_dir, dtype=dtype, max_seq_len=max_seq_len, device=device,
                                 lean=lean and torch.device(device).type == "cpu")
        release_freed_memory()  # the load's buffers and the plain weights lean packing let go
        with_graphs = graphs and target.device.type == "cuda"
        served = speculation.build(target, max_seq_len, prompt_ids[0]) if speculation else None
        cfg = served.eager_config if served else EngineConfig(max_seq_len=max_seq_len)
        methods: dict[str, Method] = {
            "ours_ar": engine_method(Engine(target, None, replace(cfg, sparse=None)), max_new_tokens, params, stops)}
        if served is not None:
            methods["ours_spec"] = engine_method(Engine(target, served.new_drafter(), cfg), max_new_tokens, params,
                                                 stops)
        drafter = served.new_drafter if served else None
        notes = graph_methods(methods, target, cfg, drafter, max_new_tokens, params, stops, compiled) \
            if with_graphs else ["compiled rows left out: they are CUDA-graph rows (a CUDA device, graphs on)"] \
            if compiled else []
        notes.append("hf_generate timed in its own phase before ours (its model is loaded only then), not "
                     "interleaved with our rows")
        bar.total += len(methods) * (1 + len(prompt_ids))
        results |= time_methods(methods, prompt_ids, seed, outputs, bar)
    results = compare(results, outputs, compare_tokens=params.greedy)
    floor_ms = 1e3 * weight_bytes_per_token(target) / bandwidth
    report = {
        "target": str(target_dir), "drafter": speculation.label if speculation else None,
        "dtype": str(dtype).removeprefix("torch."), "prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "temperature": temperature, "device": device_name(), "torch_threads": torch.get_num_threads(),
        "copy_bandwidth_gb_s": bandwidth / 1e9, "weight_bytes_per_token": weight_bytes_per_token(target),
        "floor_ms_per_token": floor_ms, "ours_ar_fraction_of_floor": fraction_of_floor(floor_ms, results["ours_ar"]),
        "methods": results, "notes": notes, "attention_backend": pick_backend(target.device).name,
        "budget": served.budget.spec if served else None,
        "specattn": None if cfg.sparse is None else asdict(cfg.sparse),
        "device_budget": served.device_report if served else None, "max_seq_len": max_seq_len}
    if print_table:
        print_report(report)
    return report


def hf_phase(target_dir: str | Path, dtype: torch.dtype, device: str, prompt_ids: list[list[int]],
             max_new_tokens: int, params: SamplingParams, stops: tuple[int, ...], seed: int,
             outputs: dict[str, list[list[int]]], bar: tqdm) -> dict:
    """HF generate's row (time_methods), its model loaded only for this phase (with_hf)."""
    return with_hf(target_dir, dtype, device, lambda hf: time_methods(
        {"hf_generate": partial(hf_row, hf, max_new_tokens, params, stops)}, prompt_ids, seed, outputs, bar))


def with_hf(target_dir: str | Path, dtype: torch.dtype, device: str, timed: Callable[[Any], T]) -> T:
    """`timed(hf)` with HF's model loaded for it alone and freed before this returns, so that HF's weights and ours
    are never resident together (`timed` must keep no reference to the model in what it returns)."""
    from transformers import AutoModelForCausalLM

    release_freed_memory()  # what ran before freed into the heap: HF's mapped weights are not to add to it
    result = timed(AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval())
    release_freed_memory()  # the model was referenced only by timed's frame: its weights go now
    return result


def hf_row(hf, max_new_tokens: int, params: SamplingParams, stops: tuple[int, ...], ids: list[int],
           gen: torch.Generator) -> tuple[list[int], None]:
    return hf_generate(hf, ids, max_new_tokens, params, stops, gen), None


def fraction_of_floor(floor_ms: float, ar: dict) -> float | None:
    """The floor over our AR decode's ms per forward; None where it made no decode forward (every generation
    stopped at its first token, the prefill's)."""
    return floor_ms / ar["decode_ms_per_forward"] if "decode_ms_per_forward" in ar else None
def fitting_context(target_dir: str | Path, prompt_ids: list[list[int]], max_new_tokens: int) -> int:
    """The model's context (max_position_embeddings); a one-line error for the first prompt that, with
    max_new_tokens after it, does not fit."""
    limit = ModelConfig.from_dir(target_dir).max_position_embeddings
    for i, ids in enumerate(prompt_ids):
        overflow = context_error(len(ids), max_new_tokens, limit, "the model's context of max_position_embeddings")
        if overflow:
            raise DraftsmithError(f"prompt {i + 1} of {len(prompt_ids)}: {overflow}")
    return limit


def engine_method(engine: Engine, max_new_tokens: int, params: SamplingParams, stops: tuple[int, ...]) -> Method:
    def run(ids: list[int], gen: torch.Generator) -> tuple[list[int], Generation | None]:
        out = engine.generate(ids, max_new_tokens, params, gen, stops)
        return out.tokens, out
    return run


def graph_methods(methods: dict[str, Method], target: Transformer, cfg: EngineConfig,
                  drafter: Callable[[], Drafter] | None, max_new_tokens: int, params: SamplingParams,
                  stops: tuple[int, ...], compiled: bool = False) -> list[str]:
    """Add the CUDA-graph rows to `methods`: `ours_ar_graph` (greedy decode, the one-token step one graph replay;
    runtime.speculation.cuda_graphs) and, given a drafter, `ours_spec_graph` (the same speculative engine with every
    verify size a graph: EngineConfig.static_verify). With `compiled`, both again as `..._compiled`, each step fused by
    torch.compile before capture (EngineConfig.compile_static); they compile during measure's warm-up. Returns
    notes on the rows: why one was left out or differs."""
    from pipeline.bench.graphed_decoder import GraphedGreedyDecoder

    static, why = static_verify_config(cfg)
    notes = [why] if why and drafter is not None else []
    if not params.greedy:
        notes.append("ours_ar_graph left out: the graphed decoder is greedy only")
    for suffix in ("", "_compiled") if compiled else ("",):
        if params.greedy:
            decoder = GraphedGreedyDecoder(target, cfg.max_seq_len, compile=bool(suffix))
            methods["ours_ar_graph" + suffix] = \
                lambda ids, gen, decoder=decoder: (decoder.generate(ids, max_new_tokens, stops), None)
        if drafter is not None:
            engine = Engine(target, drafter(), replace(static, compile_static=bool(suffix)))
            methods["ours_spec_graph" + suffix] = engine_method(engine, max_new_tokens, params, stops)
    return notes


def interleaved(methods: dict[str, Callable], prompts: list, seed: int, repeats: int = 1,
                progress: tqdm | None = None) -> Iterator[tuple[str, float, list[int], Any]]:
    """Run every method on each prompt, the methods back to back, yielding (name, seconds, tokens, what else it
    returned): a machine that slows down for a while (a shared 2-core host does) slows all methods alike instead of
    whichever ran then. A method is called as run(prompt, generator); each has its own, seeded with `seed`.

    With repeats > 1 the methods take turns on each prompt that many times, every repeat from the same generator
    state (so the same tokens, sampled or not), and the fastest repeat of each is yielded: other work on the host
    can only slow a run down, so the fastest is the one it disturbed least. `progress`, a bar, counts every run and
    shows which method runs on which prompt."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: expected at least 1")
    gens = {name: torch.Generator().manual_seed(seed) for name in methods}
    for i, ids in enumerate(prompts, start=1):
        states = {name: gen.get_state() for name, gen in gens.items()}
        fastest: dict[str, tuple[float, list[int], Any]] = {}
        for _ in range(repeats):
            for name, run in methods.items():
                if progress is not None:
                    progress.set_postfix_str(f"{name}, prompt {i}/{len(prompts)}")
                gens[name].set_state(states[name])
                start = time.perf_counter()
                tokens, extra = run(ids, gens[name])
                elapsed = time.perf_counter() - start
                if progress is not None:
                    progress.update()
                if name not in fastest or elapsed < fastest[name][0]:
                    fastest[name] = (elapsed, tokens, extra)
        for name in methods:
            yield name, *fastest[name]


def measure(methods: dict[str, Method], prompt_ids: list[list[int]], seed: int, compare_tokens: bool,
            outputs: dict[str, list[list[int]]] | None = None) -> dict:
    """Wall time and tokens of every method over all prompts, after one warm-up generation each, with a progress
    bar on stderr, compared with `hf_generate` and `ours_ar` (compare). `outputs`, if given, receives every
    method's generated tokens per prompt."""
    outputs = {} if outputs is None else outputs
    with tqdm(total=len(methods) * (1 + len(prompt_ids)), desc="bench", unit="run") as bar:
        results = time_methods(methods, prompt_ids, seed, outputs, bar)
    return compare(results, outputs, compare_tokens)


def time_methods(methods: dict[str, Method], prompt_ids: list[list[int]], seed: int,
                 outputs: dict[str, list[list[int]]], bar: tqdm) -> dict:
    """measure's timing, without the comparisons: each method's row, its tokens per prompt into `outputs`."""
    for name, run in methods.items():  # warm-up: allocator, kernels, caches
        bar.set_postfix_str(f"{name}, warm-up")
        run(prompt_ids[0][:8], torch.Generator().manual_seed(seed))
        bar.update()
    runs = list(interleaved(methods, prompt_ids, seed, progress=bar))
    totals = {name: {"new_tokens": 0, "seconds": 0.0, "decode_s": 0.0, "forwards": 0, "draft_s": 0.0, "verify_s": 0.0,
                     "rollback_s": 0.0, "kv_saved": []} for name in methods}
    outputs.update({name: [] for name in methods})
    for name, seconds, tokens, out in runs:
        t = totals[name]
        t["seconds"] += seconds
        t["new_tokens"] += len(tokens)
        outputs[name].append(tokens)
        if out is not None:
            t["decode_s"] += out.metrics.total_s - out.metrics.prefill_s
            t["forwards"] += out.metrics.target_forwards
            for phase in ("draft_s", "verify_s", "rollback_s"):
                t[phase] += getattr(out.metrics, phase)
            t["kv_saved"].append(out.metrics.kv_saved)

    results = {}
    for name, t in totals.items():
        r = results[name] = {"new_tokens": t["new_tokens"], "seconds": t["seconds"],
                             "tokens_per_s": t["new_tokens"] / t["seconds"]}
        if t["forwards"]:  # our engine rows (HF generate reports no forwards) that made a decode or verify forward
            r["tau"] = tokens_per_forward(t["new_tokens"], len(prompt_ids), t["forwards"])
            r["decode_ms_per_forward"] = 1e3 * t["decode_s"] / t["forwards"]
            for phase in ("draft", "verify", "rollback"):  # where a step's time goes (the rest: the engine's own)
                r[f"{phase}_ms_per_forward"] = 1e3 * t[f"{phase}_s"] / t["forwards"]
            if any(t["kv_saved"]):  # SpecAttn: the share of KV reads sparse verification skipped, mean over prompts
                r["kv_saved"] = sum(t["kv_saved"]) / len(t["kv_saved"])
    return results


def compare(results: dict, outputs: dict[str, list[list[int]]], compare_tokens: bool) -> dict:
    """Every row's speed against `hf_generate` and `ours_ar`, and (greedy) whether its tokens are theirs."""
    for name, r in results.items():
        r["speedup_vs_hf"] = r["tokens_per_s"] / results["hf_generate"]["tokens_per_s"]
        r["speedup_vs_ours_ar"] = r["tokens_per_s"] / results["ours_ar"]["tokens_per_s"]
        # greedy output must not depend on the method; sampled output differs by construction
        r["same_tokens_as_ours_ar"] = outputs[name] == outputs["ours_ar"] if compare_tokens else None
    # the graph rows' own pairs: speculation against the graphed decode it runs beside, compiled against not
    pairs = [("ours_spec_graph", "ours_ar_graph"), ("ours_spec_graph_compiled", "ours_ar_graph_compiled"),
             ("ours_ar_graph_compiled", "ours_ar_graph")]
    for row, reference in pairs if compare_tokens else ():
        if {row, reference} <= results.keys():
            results[row][f"same_tokens_as_{reference}"] = outputs[row] == outputs[reference]
    return results


def hf_generate(hf, ids: list[int], max_new_tokens: int, params: SamplingParams, stop_ids: tuple[int, ...],
                gen: torch.Generator, assistant=None, prompt_lookup: int = 0, streamer=None) -> list[int]:
    """HF `generate`; with `assistant` (an HF causal LM sharing the tokenizer), HF assisted generation; with
    `prompt_lookup` > 0, HF prompt lookup decoding proposing that many tokens; `streamer` gets generate's own
    put() calls."""
    torch.manual_seed(int(torch.randint(2**31, (), generator=gen)))  # HF samples from the global generator
    sampling = {"do_sample": False} if params.greedy else {"do_sample": True, "temperature": params.temperature,
                                                            "top_k": params.top_k, "top_p": params.top_p}
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids], device=hf.device), max_new_tokens=max_new_tokens,
                          eos_token_id=list(stop_ids) or None, pad_token_id=stop_ids[0] if stop_ids else None,
                          assistant_model=assistant, streamer=streamer, **sampling,
                          **({"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}))
    return out[0, len(ids):].tolist()


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu: {cpu_model()}"


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{Path(report['target']).name}: {report['dtype']}, {report['prompts']} prompts, "
                        f"{report['max_new_tokens']} new tokens, temperature {report['temperature']}")
    for col in ("method", "tokens", "s", "tok/s", "vs HF", "vs AR", "tau", "ms/fwd", "draft", "=AR"):
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=True)
    for name, r in report["methods"].items():
        ms = [f"{r[k]:.1f}" if k in r else "-" for k in ("decode_ms_per_forward", "draft_ms_per_forward")]
        table.add_row(name, str(r["new_tokens"]), f"{r['seconds']:.1f}", f"{r['tokens_per_s']:.1f}",
                      f"{r['speedup_vs_hf']:.2f}x", f"{r['speedup_vs_ours_ar']:.2f}x", f"{r.get('tau', 1.0):.2f}",
                      *ms, {True: "yes", False: "NO", None: "-"}[r["same_tokens_as_ours_ar"]])
    console = Console(width=max(Console().width, 110))  # the whole table also in a log
    fraction = report["ours_ar_fraction_of_floor"]
    console.print(table)
    console.print(f"drafter {report['drafter']}; {report['device']}, {report['torch_threads']} torch threads; "
                  f"copy bandwidth {report['copy_bandwidth_gb_s']:.1f} GB/s; floor "
                  f"{report['floor_ms_per_token']:.1f} ms/token ({report['weight_bytes_per_token'] / 1e6:.0f} MB); "
                  + (f"our AR decode at {100 * fraction:.0f}% of the floor" if fraction is not None
                     else "our AR decode made no decode forward (every generation stopped at its first token)"))
    if report.get("specattn"):
        saved = {name: f"{100 * r['kv_saved']:.0f}%" for name, r in report["methods"].items() if "kv_saved" in r}
        console.print(f"SpecAttn sparse verification at draft top-p {report['specattn']['top_p']:g} (lossy by "
                      f"design), attention backend {report['attention_backend']}; KV reads skipped: {saved}")
    if report.get("device_budget"):
        console.print(describe(report["device_budget"]))
    for note in report.get("notes", []):
        console.print(f"note: {note}")
