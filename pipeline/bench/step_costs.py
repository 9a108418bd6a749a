"""What each static step costs on a device: the graphed decode, the graphed verify at every bucket size and the
EAGLE drafter's graphed tree at each budget. The cost model for choosing a draft budget there.

A speculative step with budget B costs about draft(B) + verify(bucket of 1 + B's verify nodes) + rollback, and
commits tau(B) tokens, so speculation runs tau(B) x decode / step times the graphed decode. tau(B) does not depend
on the device (fp32 greedy): calibrate's device_candidates, or `pipeline bench --budget B`, measure it on the CPU.
Serving does not use this model: it times whole steps of the candidates on its device (runtime.serving.budget_tuner).
On the CPU, where nothing is captured, this times the same steps run eagerly.

    python -m pipeline.bench.step_costs --random-weights smollm2-135m --dtype bfloat16 [--compile] [--out costs.json]
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable

import torch

from pipeline.bench.graphed_decoder import GraphedGreedyDecoder
from pipeline.bench.harness import device_name
from pipeline.bench.random_weights import random_models, random_prompts, run_step_tool, step_tool_parser
from runtime.device import synchronizer
from runtime.drafters.eagle import EagleModel
from runtime.drafters.shared.draft_head import DraftHead
from runtime.drafters.shared.eagle_static import StaticEagleTree
from runtime.speculation.cuda_graphs import BUCKETS, StaticVerifier
from runtime.speculation.draft_budget import ServedBudget

BUDGETS = ("1x3/3", "2x1", "2x3/6", "3x3/9", "4x4/16", "6x4/24")
PENDING = 3  # pairs a propose commits to the drafter cache first: the last step's accepted path and bonus token


def ms_per_call(call: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    """Median of `repeats` timed calls, after one untimed call (which captures a graph or compiles)."""
    call()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


@contextmanager
def reserved_mb(device: torch.device, into: dict, kind: str):
    """On CUDA, into[kind] = the device memory (MB) the block reserved; on the CPU nothing."""
    before = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    yield
    if device.type == "cuda":
        into[kind] = (torch.cuda.memory_reserved(device) - before) / 2**20


@torch.inference_mode()
def step_costs(name: str, dtype: torch.dtype = torch.bfloat16, device: str = "cuda", compiled: bool = False,
               context: int = 256, budgets: tuple[str, ...] = BUDGETS, buckets: tuple[int, ...] = BUCKETS,
               repeats: int = 50, cache_len: int = 0) -> dict:
    """ms per graphed decode token, per verify bucket and per draft budget (draft only: lookup nodes cost nothing
    to draft), with `context` committed tokens, random weights of RANDOM_CONFIGS[name], KV caches of `cache_len`
    slots or what the steps need if more."""
    max_len = max(cache_len, context + max(repeats + 2, max(buckets)) + 1)
    model = random_models(name, dtype, device, max_len, with_hf=False)[0]
    dev, use_graph = model.device, model.device.type == "cuda"
    sync = synchronizer(dev)
    prompt = random_prompts(model.config.vocab_size, 1, seed=0, lengths=(context, context))[0]

    capture_mb = {}  # CUDA: the device memory each kind of step reserved on first use (warm-up and capture)

    decoder = GraphedGreedyDecoder(model, max_len, use_graph=use_graph, compile=compiled)
    decoder.generate(prompt, 1)  # the prefill; each timed step then decodes one more token
    with reserved_mb(dev, capture_mb, "decode"):
        decode_ms = ms_per_call(decoder.decode_step, sync, repeats)

    cache = model.new_cache(1, max_len)
    model(torch.tensor([prompt], device=dev), cache, torch.arange(context, device=dev)[None])
    cache.advance(context)
    verifier = StaticVerifier(model, cache, buckets, use_graph=use_graph, compile=compiled)
    verify_ms = {}
    with reserved_mb(dev, capture_mb, "verify"):
        for size in buckets:  # a causal block of `size` tokens: the same shapes and cost as a tree of that size
            tokens = torch.randint(model.config.vocab_size, (1, size), device=dev)
            positions = context + torch.arange(size, device=dev)[None]
            verify_ms[size] = ms_per_call(lambda: verifier(tokens, positions, None), sync, repeats)

    eagle = EagleModel.from_target(model, DraftHead(model.output)).to(dev).eval()
    draft_cache = eagle.new_cache(1, max_len)
    draft_cache.lengths.fill_(context)  # pairs as if committed: the tree reads them (zeros cost the same)
    tree = StaticEagleTree(eagle, draft_cache, buckets, use_graph=use_graph, compile=compiled)
    pending = torch.randint(model.config.vocab_size, (PENDING,), device=dev)
    features = torch.randn(PENDING, model.config.dim, dtype=dtype, device=dev)
    draft_ms = {}
    with reserved_mb(dev, capture_mb, "draft"):
        for spec in budgets:
            budget = ServedBudget.parse(spec).tree
            if not tree.fits(PENDING, budget, context):
                raise ValueError(f"budget {spec}: its tree does not fit a cache of {max_len} after {context} tokens")
            draft_ms[spec] = ms_per_call(lambda: tree(pending, features, budget, context), sync, repeats)
    return {"target": f"random:{name}", "dtype": str(dtype).removeprefix("torch."), "device": device_name(),
            "torch": torch.__version__, "graphs": use_graph, "compiled": compiled, "context": context,
            "cache_len": max_len, "pending_pairs": PENDING, "decode_ms": decode_ms, "verify_ms": verify_ms,
            "draft_ms": draft_ms} | ({"capture_mb": capture_mb} if use_graph else {})


def print_costs(costs: dict) -> None:
    print(f"{costs['target']}, {costs['dtype']}, {costs['device']}, graphs {costs['graphs']}, compiled "
          f"{costs['compiled']}, {costs['context']} tokens of context, a cache of {costs['cache_len']}, "
          f"key spans from {costs['min_span']}")
    print(f"  decode {costs['decode_ms']:.3f} ms/token")
    for size, ms in costs["verify_ms"].items():
        print(f"  verify {size:>3} tokens {ms:.3f} ms ({ms / costs['decode_ms']:.2f}x a decode token)")
    for spec, ms in costs["draft_ms"].items():
        print(f"  draft {spec:<7} {ms:.3f} ms")
    if "capture_mb" in costs:  # each key span captures these again
        mb = costs["capture_mb"]
        print(f"  device memory reserved on first use: decode {mb['decode']:.1f} MB, verify {mb['verify']:.1f} MB "
              f"({len(costs['verify_ms'])} buckets), draft {mb['draft']:.1f} MB ({len(costs['draft_ms'])} budgets)")


def main(argv: list[str] | None = None) -> int:
    ap = step_tool_parser("per-step costs of the static steps (see runtime/step_costs.py)")
    ap.add_argument("--compile", action="store_true", help="each step fused by torch.compile before capture")
    ap.add_argument("--budgets", default=",".join(BUDGETS), help="comma-separated DEPTHxWIDTH[/NODES] draft budgets")
    ap.add_argument("--repeats", type=int, default=50)
    return run_step_tool(ap, argv, lambda args, dtype, device: step_costs(
        args.random_weights, dtype, device, args.compile, args.context, tuple(b for b in args.budgets.split(",") if b),
        repeats=args.repeats, cache_len=args.cache_len), print_costs)


if __name__ == "__main__":
    raise SystemExit(main())
