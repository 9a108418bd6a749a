"""One-row bf16 decode on a CPU with AMX: can our own product beat oneDNN's prepacked one and stay batch-invariant?

Compares, on the shapes of Qwen2.5-Coder-1.5B's 28 layers (q/k/v fused, o, gate/up fused, down; random weights,
3.1 GB, so nothing stays in cache): oneDNN's prepacked bf16 product (what the runtime runs), an AVX-512 kernel
(vdpbf16ps) and an AMX kernel (tdpbf16ps), both of our own in scripts/bf16_products.cpp, at 1..16 rows and at a
prefill's 256 and 1,024 rows. Then whether the two kernels of our own give the same bits: a tree verify must equal
one-row decoding bit for bit, so a fast one-row kernel helps only if the verify's kernel agrees with it.
Best of 5 passes. Run it alone on the host: it measures memory bandwidth.

    python scripts/bf16_products.py
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import track

from kernels.cpu_gemm import build, cpu_flags

SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]  # one layer's products, q/k/v and gate/up fused
LAYERS = 28
NEEDS = {"avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"}


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> panels [ceil(N / 16), K / 2, 16, 2] with panels[p, j, c, i] = w[16p + c, 2j + i]."""
    n, k = w.shape
    return F.pad(w, (0, 0, 0, -n % 16)).reshape(-1, 16, k // 2, 2).transpose(1, 2).contiguous()


def ours(kernel: int):
    """0: AVX-512, 1: AMX, 2: AMX with a prefill's 32 x 32 blocks."""
    return lambda x, panels, n: torch.ops.draftsmith_bf16_study.linear(x, panels, n, None, kernel)


def onednn(x, packed, n):
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def best_ms(step, passes: int = 5) -> float:
    step()
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def model_pass(rows: int, weights: list, product) -> float:
    xs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in SHAPES}}
    return best_ms(lambda: [product(xs[k], w, n) for w, n, k in weights])


def disagreement(n: int = 17920, k: int = 1536, rows: int = 16) -> tuple[int, int, bool]:
    """(outputs where AMX and AVX-512 differ, outputs, each kernel's rows equal to its one-row results)."""
    w, x = torch.randn(n, k).bfloat16(), torch.randn(rows, k).bfloat16()
    panels = pack(w)
    amx, avx = ours(1)(x, panels, n), ours(0)(x, panels, n)
    invariant = all(torch.equal(f(x[m:m + 1], panels, n), full[m:m + 1])
                    for f, full in ((ours(1), amx), (ours(0), avx)) for m in range(rows))
    return int((amx != avx).sum()), amx.numel(), invariant


def avx512_rate(n: int = 256, k: int = 1536, calls: int = 2000) -> dict[int, float]:
    """Per row count, G vdpbf16ps a second per core over a weight that stays in L2: the AVX-512 kernel's arithmetic
    alone."""
    panels, rates = pack(torch.randn(n, k).bfloat16()), {}
    for rows in (1, 4, 8, 16):
        x = torch.randn(rows, k).bfloat16()
        ms = best_ms(lambda: [ours(0)(x, panels, n) for _ in range(calls)])
        rates[rows] = rows * n * k / 32 * calls / (ms / 1e3) / torch.get_num_threads() / 1e9
    return rates


def main() -> None:
    if not NEEDS <= cpu_flags():
        sys.exit(f"bf16_products: this CPU lacks {sorted(NEEDS - cpu_flags())}")
    flags = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]
    if not build(Path(__file__).with_name("bf16_products.cpp"), flags):
        sys.exit("bf16_products: scripts/bf16_products.cpp did not build")
    torch.manual_seed(0)
    plain = [torch.randn(n, k).bfloat16() * 0.02 for _ in range(LAYERS) for n, k in SHAPES]
    gb = sum(w.numel() for w in plain) * 2 / 1e9
    packed = [(torch.ops.mkldnn._reorder_linear_weight(w, 16), w.shape[0], w.shape[1]) for w in plain]
    panels = [(pack(w), w.shape[0], w.shape[1]) for w in plain]
    del plain
    decode = {"oneDNN": (packed, onednn), "AVX-512 (ours)": (panels, ours(0)), "AMX (ours)": (panels, ours(1))}
    # a prefill's rows: AVX-512 is compute-bound past a few rows (minutes a pass); AMX also in 32 x 32 blocks
    prefill = {"oneDNN": (packed, onednn), "AMX (ours)": (panels, ours(1)), "AMX 32x32 (ours)": (panels, ours(2))}
    print(f"{LAYERS} layers of {SHAPES}, {gb:.2f} GB of bf16 weights; ms per pass (GB/s)")
    for rows in track([1, 2, 4, 8, 16, 256, 1024], description="rows"):
        cells = []
        for name, (weights, product) in (decode if rows <= 16 else prefill).items():
            ms = model_pass(rows, weights, product)
            cells.append(f"{name} {ms:.1f} ({gb / ms * 1e3:.1f})")
        print(f"rows {rows:4d}: " + "   ".join(cells), flush=True)
    print("AVX-512 (ours) over weights in L2, G vdpbf16ps/s a core: "
          + ", ".join(f"{rows} rows {rate:.2f}" for rows, rate in avx512_rate().items()))
    differ, total, invariant = disagreement()
    print(f"AMX against AVX-512, the same order of sums: {differ} of {total} outputs differ; "
          f"each kernel's rows equal its one-row results: {invariant}")


if __name__ == "__main__":
    main()
