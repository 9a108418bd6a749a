"""One int4 draft forward's products of Qwen2.5-Coder-1.5B streamed from DRAM: 28 layers of distinct random weights
plus the head (about 0.96 GB in our int4 layout, group 32), one after another at one row, best of 8 passes. Unlike
scripts/draft_products.py, which repeats each product on a weight the last-level cache may hold, this reads what a
draft step reads.

    python scripts/int4_stream.py
"""
from __future__ import annotations

import time

import torch

from kernels import int4_gemm

LAYER = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]  # qkv, o, gate+up, down
HEAD, LAYERS, GROUP, PASSES = (151936, 1536), 28, 32, 8


def main() -> None:
    if not int4_gemm.available():
        raise SystemExit("kernels/int4_gemm.cpp does not run here (it needs AVX-512 VNNI or AVX2)")
    torch.manual_seed(0)
    shapes = LAYER * LAYERS + [HEAD]
    packed = [(int4_gemm.pack(*int4_gemm.quantize(torch.randn(n, k) * 0.02, GROUP)), n, k) for n, k in shapes]
    gb = sum(p.numel() for p, _, _ in packed) / 1e9
    rows = {k: torch.randn(1, k) for k in {k for _, k in shapes}}
    best = float("inf")
    for _ in range(PASSES):
        start = time.perf_counter()
        for panels, n, k in packed:
            int4_gemm.linear(rows[k], panels, n, GROUP)
        best = min(best, time.perf_counter() - start)
    print(f"{gb:.2f} GB of int4 weights at one row: {1e3 * best:.1f} ms ({gb / best:.1f} GB/s)")


if __name__ == "__main__":
    main()
