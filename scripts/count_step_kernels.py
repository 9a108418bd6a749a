"""Kernels one static decode step of the SmolLM2-135M shape runs, eager against fused by torch.compile
(EngineConfig.compile_static), counted on the CPU: what the eager step dispatches (views left out), and the fused
kernels plus library calls in inductor's generated code. A CPU-side proxy for the launches a GPU step saves.

    python scripts/count_step_kernels.py
"""
from __future__ import annotations

import re
from collections import Counter

import torch
from torch._inductor.utils import run_and_get_code

from pipeline.bench.graphed_decoder import GraphedGreedyDecoder
from pipeline.bench.random_weights import random_models, random_prompts
from pipeline.bench.step_profile import OpCounter

def main() -> None:
    model = random_models("smollm2-135m", torch.float32, "cpu", max_seq_len=256, with_hf=False)[0]
    decoder = GraphedGreedyDecoder(model, 256, use_graph=False)
    decoder.generate(random_prompts(model.config.vocab_size, 1, seed=3)[0], 2)  # a prefix in the cache
    layers = model.config.n_layers
    with torch.inference_mode(), OpCounter() as counter:
        decoder._step(256)
    eager = sum(counter.ops.values())
    print(f"eager: {eager} ops, {eager / layers:.1f} a layer; {dict(counter.ops.most_common())}")
    with torch.inference_mode():
        _, codes = run_and_get_code(torch.compile(decoder._step, fullgraph=True), 256)
    call = codes[-1][codes[-1].index("def call("):]
    fused = Counter(re.sub(r"_\d+$", "", k) for k in re.findall(r"\n\s+(cpp_fused_\w+|triton_\w+)", call))
    library = Counter(re.findall(r"\n\s+(?:buf\d+ = )?(extern_kernels\.\w+|aten\.\w+|torch\.ops\.\w+\.\w+)", call))
    n = sum(fused.values()) + sum(library.values())
    print(f"compiled: {n} kernels, {n / layers:.1f} a layer; library {dict(library)}; fused {dict(fused)}")


if __name__ == "__main__":
    main()
