"""The CPU products a self-speculative draft could read its weights through, at one and four rows, on the shapes of
Qwen2.5-Coder-1.5B's layers (random weights): our fp32 kernel (what the target runs), oneDNN's prepacked bf16,
torch's packed int4 (`_weight_int4pack_mm_for_cpu`, group 32 and 128), our int4 (kernels/int4_gemm.py, group 32
and 128: what quantspec uses where it runs), torch's int8 (`_weight_int8pack_mm`) and fbgemm's dynamic int8
(kernels/dynamic_int8.py, quantspec's elsewhere). Best of 5 rounds, the methods alternating.

    python scripts/draft_products.py
"""
from __future__ import annotations

import time

import torch

from kernels import cpu_gemm, dynamic_int8, int4_gemm
from runtime.target.cpu_packing import onednn_packs

SHAPES = {"gate+up 17920x1536": (17920, 1536), "down 1536x8960": (1536, 8960), "head 151936x1536": (151936, 1536)}
ROUNDS, CALLS = 5, 3


def int4_packed(w: torch.Tensor, group: int):
    """torch's int4 layout: codes 0..15 per group with scale and zero ([K / group, N, 2]), (q - 8) * scale + zero."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (hi - lo).clamp_min(1e-6) / 15
    q = ((g - lo) / scale).round().clamp(0, 15).to(torch.int32).view(n, k)
    zeros = torch.stack([scale.squeeze(-1).t(), (lo + 8 * scale).squeeze(-1).t()], -1).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), zeros


def products(w: torch.Tensor) -> dict:
    n = w.shape[0]
    out = {}
    if cpu_gemm.available():
        panels = cpu_gemm.pack(w)
        out["fp32 (ours)"] = lambda x: cpu_gemm.small_linear(x, panels, n)
    if onednn_packs(torch.bfloat16):  # not on AVX2 CPUs
        bf16 = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 16)
        out["bf16 (oneDNN)"] = lambda x: torch.ops.mkldnn._linear_pointwise(x.bfloat16(), bf16, None, "none", [], "")
    for group in (32, 128):
        packed, zeros = int4_packed(w, group)
        out[f"int4-g{group} (aten)"] = (lambda p, z, g: lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, p, g, z))(packed, zeros, group)
    if int4_gemm.available():
        for group in (32, 128):
            ours = int4_gemm.pack(*int4_gemm.quantize(w, group))
            out[f"int4-g{group} (ours)"] = (lambda p, g: lambda x: int4_gemm.linear(x, p, n, g))(ours, group)
    codes, scales = dynamic_int8.quantize(w)
    out["int8 (aten)"] = lambda x: torch.ops.aten._weight_int8pack_mm(x, codes, scales)
    fbgemm = dynamic_int8.pack(codes, scales)
    out["int8 dynamic (fbgemm)"] = lambda x: dynamic_int8.linear(x, fbgemm)
    return out


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per product, best of {ROUNDS}")
    for name, (n, k) in SHAPES.items():
        methods = products(torch.randn(n, k) * 0.02)
        for rows in (1, 4):
            x = torch.randn(rows, k)
            best = dict.fromkeys(methods, float("inf"))
            for _ in range(ROUNDS):
                for label, run in methods.items():
                    start = time.perf_counter()
                    for _ in range(CALLS):
                        run(x)
                    best[label] = min(best[label], (time.perf_counter() - start) / CALLS)
            cells = ", ".join(f"{label} {1e3 * s:.2f}" for label, s in best.items())
            print(f"{name}, {rows} row(s): {cells}", flush=True)


if __name__ == "__main__":
    main()
