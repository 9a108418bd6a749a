"""`pipeline bench --random-weights CONFIG`: the benchmark on a GPU with random weights of a named shape.

No checkpoint is needed, so it runs where no weights can be carried (the lent GPU machine has no network): our
Transformer is built from a named config with random weights, the HF LlamaForCausalLM from the same config gets
the same weights (runtime.target.loading.hf_state_dict), and the same pipeline.bench.harness.measure times, on the same
random prompts:
  hf_generate     HF transformers `generate`, greedy (DynamicCache, sdpa attention)
  ours_ar         our Engine without a drafter (eager PyTorch)
  ours_ar_graph   our greedy decode with the one-token step captured in a CUDA graph (runtime.speculation.cuda_graphs)
  ours_spec       our Engine with `ReplayDrafter`: a chain drafter replaying a configured acceptance pattern
  ours_spec_graph the same with each verify size captured in a CUDA graph (EngineConfig.static_verify)
  ..._compiled    with --compile: the two graph rows again, each step fused by torch.compile before capture
Random weights make the speed numbers valid (the arithmetic and bytes moved do not depend on the values) but
say nothing about real acceptance: ReplayDrafter knows the target's greedy continuation (from a prior run of
ours_ar) and proposes, per chain position, the right token with probability `accept_rate` until the first wrong
one. Its drafting costs nothing (a list lookup), so ours_spec is the verify-side ceiling for that acceptance, not
a drafter's real speedup. Stop tokens are disabled: every method generates exactly max_new_tokens.
"""
from __future__ import annotations

import random
import time

import torch
from tqdm import tqdm

from pipeline.flags import Parser, bounded
from runtime.speculation import cuda_graphs
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.drafter import Drafter
from runtime.speculation.tree import DraftTree
from runtime.target.loading import hf_causal_lm
from runtime.target.model import Transformer, rope_tables
from runtime.target.model_config import ModelConfig

RANDOM_CONFIGS: dict[str, dict] = {
    "smollm2-135m": {  # HuggingFaceTB/SmolLM2-135M(-Instruct) shape
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
        "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "hidden_act": "silu"},
    "llama3-8b": {  # Meta-Llama-3-8B shape
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
        "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "hidden_act": "silu"},
}


class ReplayDrafter(Drafter):
    """Chain drafter replaying an acceptance pattern over known greedy continuations (see module docstring).
    `references` maps a prompt (tuple of ids) to prompt + its greedy continuation; unknown prompts (warm-up) get
    wrong tokens only."""

    def __init__(self, vocab_size: int, references: dict[tuple[int, ...], list[int]], accept_rate: float,
                 seed: int = 0):
        self.vocab_size, self.references, self.accept_rate = vocab_size, references, accept_rate
        self.rng = random.Random(seed)
        self.tokens: list[int] = []
        self.device = torch.device("cpu")
        self.reference: list[int] = []

    def reset(self, tokens, features):
        self.tokens, self.device = tokens.tolist(), tokens.device
        prompt = tuple(self.tokens[:-1])
        self.reference = self.references.get(prompt, [])

    def commit(self, tokens, features):
        self.tokens += tokens.tolist()

    def propose(self, budget, params, generator=None):
        out, on_track = [], True
        for depth in range(budget.depth):
            pos = len(self.tokens) + depth
            right = self.reference[pos] if pos < len(self.reference) else 0
            on_track = on_track and pos < len(self.reference) and self.rng.random() < self.accept_rate
            out.append(right if on_track else (right + 1) % self.vocab_size)
        return DraftTree.chain(torch.tensor(out, dtype=torch.long, device=self.device))


def random_models(name: str, dtype: torch.dtype, device: str, max_seq_len: int, seed: int = 0,
                  with_hf: bool = True):
    """(ours, hf or None) with identical random weights, for RANDOM_CONFIGS[name]."""
    if name not in RANDOM_CONFIGS:
        raise ValueError(f"random-weights config {name!r}: expected one of {sorted(RANDOM_CONFIGS)}")
    cfg = ModelConfig.from_hf(RANDOM_CONFIGS[name])
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the target dtype: an 8B model never exists in fp32
    try:
        with torch.device(device):
            ours = Transformer(cfg, max_seq_len)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():  # embedding N(0, 0.02) (HF's init), matrices N(0, 1/fan_in): varied greedy continuations
        for pname, w in ours.named_parameters():  # (the default init's N(0, 1) tied embedding repeats one token)
            if w.dim() == 2:
                w.normal_(0.0, 0.02 if "embeddings" in pname else w.shape[1] ** -0.5)
    ours.rope_cos, ours.rope_sin = (t.to(device=device, dtype=dtype) for t in rope_tables(cfg, max_seq_len))
    ours = ours.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if not with_hf:
        return ours, None
    hf = hf_causal_lm(ours, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return ours, hf


def random_prompts(vocab: int, n: int, seed: int, lengths: tuple[int, int] = (16, 64)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_random_bench(name: str, n_prompts: int = 5, max_new_tokens: int = 128, *, dtype: torch.dtype = torch.bfloat16,
                     device: str = "cuda", budget: DraftBudget = DraftBudget(5), accept_rate: float = 0.8,
                     graphs: bool = True, compiled: bool = False, seed: int = 0, print_table: bool = True) -> dict:
    from pipeline.bench.harness import (copy_bandwidth, device_name, engine_method, fraction_of_floor, graph_methods,
                                        hf_generate, measure, print_report, weight_bytes_per_token)
    from runtime.speculation.engine import Engine, EngineConfig
    from runtime.speculation.sampling import SamplingParams

    vocab = RANDOM_CONFIGS[name]["vocab_size"]
    prompts = random_prompts(vocab, n_prompts, seed)
    max_seq_len = max(map(len, prompts)) + max_new_tokens + budget.max_nodes + 8
    t0 = time.perf_counter()
    ours, hf = random_models(name, dtype, device, max_seq_len, seed)
    build_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0)
    cfg = EngineConfig(max_seq_len=max_seq_len, budget=budget, adaptive=False)

    # references for the replay drafter: our own greedy continuation, long enough for the last draft
    ar_engine = Engine(ours, None, cfg)
    references = {tuple(p): p + ar_engine.generate(p, max_new_tokens + budget.depth + 1, params).tokens
                  for p in tqdm(prompts, desc="bench: the replay drafter's references", unit="prompt")}
    replay = lambda: ReplayDrafter(vocab, references, accept_rate, seed)  # noqa: E731

    methods = {"hf_generate": lambda ids, gen: (hf_generate(hf, ids, max_new_tokens, params, (), gen), None),
               "ours_ar": engine_method(ar_engine, max_new_tokens, params, ()),
               "ours_spec": engine_method(Engine(ours, replay(), cfg), max_new_tokens, params, ())}
    capture_s = None
    on_gpu = torch.device(device).type == "cuda"
    if graphs and on_gpu:  # the decode graph is captured here, the verify graphs on first use (the warm-up)
        t0 = time.perf_counter()
        graph_methods(methods, ours, cfg, replay, max_new_tokens, params, (), compiled)
        capture_s = time.perf_counter() - t0

    outputs: dict[str, list[list[int]]] = {}
    bandwidth = copy_bandwidth(1 << 30, 10, device) if on_gpu else copy_bandwidth()
    results = measure(methods, prompts, seed, compare_tokens=True, outputs=outputs)
    for method, r in results.items():  # greedy agreement with our AR, token by token
        prefixes = [common_prefix(a, b) for a, b in zip(outputs[method], outputs["ours_ar"])]
        r["matching_prefix_min"] = min(prefixes)
        r["matching_prefix_mean"] = sum(prefixes) / len(prefixes)
        r["ms_per_token"] = 1e3 * r["seconds"] / r["new_tokens"]
    wbytes = weight_bytes_per_token(ours)
    floor_ms = 1e3 * wbytes / bandwidth
    report = {
        "target": f"random:{name}", "random_weights": True, "drafter": f"replay(accept_rate={accept_rate}, "
        f"depth={budget.depth}, zero-cost)", "dtype": str(dtype).removeprefix("torch."), "prompts": len(prompts),
        "prompt_lengths": [len(p) for p in prompts], "max_new_tokens": max_new_tokens, "temperature": 0.0,
        "device": device_name(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "copy_bandwidth_gb_s": bandwidth / 1e9, "weight_bytes_per_token": wbytes, "floor_ms_per_token": floor_ms,
        "ours_ar_fraction_of_floor": fraction_of_floor(floor_ms, results["ours_ar"]),
        "build_s": build_s, "graph_capture_s": capture_s, "methods": results}
    if print_table:
        print_report(report)
        for m, r in results.items():
            print(f"  {m:<14} {r['ms_per_token']:.2f} ms/token; matching prefix vs ours_ar min "
                  f"{r['matching_prefix_min']} mean {r['matching_prefix_mean']:.1f} of {max_new_tokens}")
    return report


def add_arguments(ap, out: str | None) -> None:
    """The benchmark's flags, one definition for `pipeline bench` and `python -m pipeline.bench.random_weights`;
    `out`: --out's default (None: no report file)."""
    ap.add_argument("--random-weights", metavar="CONFIG", choices=sorted(RANDOM_CONFIGS),
                    help="benchmark random weights of this shape instead of --target (no checkpoint needed)")
    ap.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                    help="default: bfloat16 with --random-weights, else validate's default (validate.precision=auto: "
                         "bfloat16 where the CPU has AMX, else float32)")
    ap.add_argument("--max-new-tokens", type=bounded(int, 1), default=128)
    ap.add_argument("--n-prompts", type=bounded(int, 1), default=5,
                    help="--random-weights: random prompts (16..64 tokens)")
    ap.add_argument("--depth", type=bounded(int, 1), default=5,
                    help="--random-weights: the replay drafter's chain depth")
    ap.add_argument("--accept-rate", type=bounded(float, 0, 1), default=0.8,
                    help="--random-weights: probability each chain position of the replay drafter proposes the "
                         "right token")
    ap.add_argument("--no-graphs", action="store_true", help="leave out the CUDA-graph rows")
    ap.add_argument("--compile", action="store_true",
                    help="also the CUDA-graph rows with each step fused by torch.compile before capture "
                         "(ours_ar_graph_compiled, ours_spec_graph_compiled; EngineConfig.compile_static)")
    ap.add_argument("--out", default=out, help="write the report as JSON here")


def step_tool_parser(description: str):
    """The flags the per-step device tools share (pipeline.bench.step_costs, pipeline.bench.step_profile)."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--random-weights", required=True, choices=sorted(RANDOM_CONFIGS))
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--device", help="default: cuda when available")
    ap.add_argument("--context", type=int, default=256, help="tokens of context before the timed steps")
    ap.add_argument("--cache-len", type=int, default=0,
                    help="the KV caches' length (default: what the steps need; serving allocates the target's "
                         "whole context: 4096 tokens for SmolLM2)")
    ap.add_argument("--min-span", type=int, help="the static steps' smallest key span (runtime.speculation.cuda_graphs.MIN_SPAN); "
                    "the cache's length attends over the whole cache, as static steps did before key spans")
    ap.add_argument("--out", help="write the result as JSON here")
    return ap


def run_step_tool(ap, argv: list[str] | None, measure, show) -> int:
    """Parse a step tool's flags (step_tool_parser), run `measure(args, dtype, device)`, a one-line usage error on a
    ValueError, `show` the result and write it to --out."""
    args = ap.parse_args(argv)
    if args.min_span is not None:
        if args.min_span < 1:
            ap.error(f"--min-span {args.min_span}: expected a number of keys >= 1")
        cuda_graphs.MIN_SPAN = args.min_span
    try:
        result = measure(args, getattr(torch, args.dtype), default_device(args.device))
    except ValueError as e:
        ap.error(str(e))
    result["min_span"] = cuda_graphs.MIN_SPAN
    show(result)
    write_report(args.out, result)
    return 0


def default_device(device: str | None) -> str:
    """`device`, else cuda where torch sees a GPU, else cpu."""
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def bench_from_args(args) -> dict:
    return run_random_bench(args.random_weights, args.n_prompts, args.max_new_tokens,
                            dtype=getattr(torch, args.dtype or "bfloat16"), device=default_device(args.device),
                            budget=DraftBudget(depth=args.depth, width=1), accept_rate=args.accept_rate,
                            graphs=not args.no_graphs, compiled=args.compile)


def main(argv: list[str] | None = None) -> int:
    ap = Parser(description="random-weights benchmark (the same as pipeline bench --random-weights)")
    add_arguments(ap, out=None)
    args = ap.parse_args(argv)
    if args.random_weights is None:
        ap.error("--random-weights CONFIG is required")
    write_report(args.out, bench_from_args(args))
    return 0


def write_report(path: str | None, report: dict) -> None:
    """The report as JSON at `path`, if one is given (the device tools' --out)."""
    import json

    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
