"""GPU check of the Triton kernels against their torch references: `python -m kernels.gpu_check`.

Runs every kernel in kernels/topp.py, kernels/kv_quant.py and kernels/sparse_attention.py natively on CUDA next
to its torch reference (the reference also runs on CUDA), on fresh random inputs, in fp32 and bf16 inputs, and
prints one table: exactness (bit-exact output, or the max abs error and the share of differing elements) and the
median time of each (triton.testing.do_bench). Outputs are poisoned before each kernel run so an unwritten element
shows as a mismatch. Needs a CUDA GPU; exits 2 without one.

The top-p threshold may legitimately differ from the reference where a candidate mass lies within fp32 rounding
of p (the kernel and torch sum in different orders); the table counts such rows instead of hiding them.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def _bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"exact": False, "max_abs_err": float("nan"), "mismatch_share": 1.0,
                "note": f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"}
    if a.dtype == torch.bool or not a.is_floating_point():
        diff = a != b
        err = float((a.long() - b.long()).abs().max()) if a.numel() else 0.0
    else:
        diff = (a != b) & ~(a.isnan() & b.isnan())
        err = float((a.float() - b.float()).abs().nan_to_num(float("inf")).max()) if a.numel() else 0.0
    return {"exact": not bool(diff.any()), "max_abs_err": err, "mismatch_share": float(diff.float().mean())}


def _poisoned_call(kernel, args, outs_like):
    """Run `kernel` after filling the caching allocator's recent blocks with a poison pattern, so a kernel
    that leaves elements unwritten returns garbage instead of a lucky zero."""
    junk = [torch.full_like(t, 0x5A if not t.is_floating_point() else float("nan")) for t in outs_like]
    del junk  # freed blocks are handed back to the next allocation of the same size
    return kernel(*args)


def check_all(device: str = "cuda", seed: int = 0) -> list[dict]:
    from kernels import kv_quant as kq
    from kernels import sparse_attention as sa
    from kernels import topp

    g = torch.Generator(device=device).manual_seed(seed)
    rows: list[dict] = []

    def add(name, dtype, shape, ref_fn, tri_fn, args, compare_idx=None):
        ref = ref_fn(*args)
        ref = ref if isinstance(ref, tuple) else (ref,)
        tri = _poisoned_call(tri_fn, args, ref)
        tri = tri if isinstance(tri, tuple) else (tri,)
        torch.cuda.synchronize()
        parts = [_compare(t, r) for t, r in zip(tri, ref)]
        row = {"kernel": name, "dtype": str(dtype).removeprefix("torch."), "shape": "x".join(map(str, shape)),
               "exact": all(p["exact"] for p in parts), "max_abs_err": max(p["max_abs_err"] for p in parts),
               "mismatch_share": max(p["mismatch_share"] for p in parts),
               "mismatches": [int(round(p["mismatch_share"] * t.numel())) for p, t in zip(parts, tri)],
               "part_max_abs_err": [p["max_abs_err"] for p in parts],
               "torch_ms": _bench(lambda: ref_fn(*args)), "triton_ms": _bench(lambda: tri_fn(*args))}
        row["speedup"] = row["torch_ms"] / row["triton_ms"]
        rows.append(row)
        return tri, ref

    # KV rows: [layers=2, heads=8, tokens=4096, head_dim] -- 64K rows of a KV cache
    for dtype in (torch.float32, torch.bfloat16):
        for D in (64, 128):
            shape = (2, 8, 4096, D)
            x = (torch.randn(shape, generator=g, device=device) * 3).to(dtype)
            add("quantize_int8", dtype, shape, kq.quantize_int8_torch, kq.quantize_int8_triton, (x,))
            for G in (32, D):
                (packed, scale), _ = add(f"quantize_int4 g{G}", dtype, shape, lambda t: kq.quantize_int4_torch(t, G),
                                         lambda t: kq.quantize_int4_triton(t, G), (x,))
                add(f"dequantize_int4 g{G}", dtype, shape, kq.dequantize_int4_torch, kq.dequantize_int4_triton,
                    (packed, scale))
            (upper, lower, scale), _ = add("quantize_hierarchical", dtype, shape, kq.quantize_hierarchical_torch,
                                           kq.quantize_hierarchical_triton, (x,))
            add("dequant_upper", dtype, shape, kq.dequant_upper_torch, kq.dequant_upper_triton, (upper, scale))
            add("dequant_full", dtype, shape, kq.dequant_full_torch, kq.dequant_full_triton, (upper, lower, scale))
            # the property the hierarchical format promises: full dequant == int8 dequant, bit for bit, on GPU
            q8, s8 = kq.quantize_int8_triton(x)
            full = kq.dequant_full_triton(upper, lower, scale)
            rows.append({"kernel": "hier full == int8 (triton)", "dtype": str(dtype).removeprefix("torch."),
                         "shape": "x".join(map(str, shape)),
                         **_compare(full, kq.dequantize_int8(q8, s8)),
                         "torch_ms": float("nan"), "triton_ms": float("nan"), "speedup": float("nan")})

    # top-p over attention rows: [heads*rows, keys], softmax-normalised, several p
    for dtype in (torch.float32, torch.bfloat16):
        for S in (512, 4096):
            shape = (3 * 16, S)
            w = (torch.randn(shape, generator=g, device=device) * 2).softmax(-1).to(dtype)
            for p in (0.5, 0.9, 0.99):
                add(f"topp_mask p={p}", dtype, shape, lambda t: topp.topp_mask_torch(t, p),
                    lambda t: topp.topp_mask_triton(t, p), (w,))
    # SpecAttn sparse verification: a 16-token verify over S keys, each kv head keeping `share` of the prefix, its
    # kept list split between default_splits(S) programs (the name's /N) and in one.
    # Not bit-exact (another summation order): max|err| is the measure. The torch column is SDPA over the same
    # allowed keys, masked, which is what the sdpa backend runs (and reads every key for).
    for dtype in (torch.float32, torch.bfloat16):
        for H, Hkv, D in ((9, 3, 64), (32, 8, 128)):
            for S, share in ((512, 0.3), (4096, 0.1), (4096, 0.3)):
                T = 16
                q = torch.randn(1, H, T, D, generator=g, device=device).to(dtype)
                keys, values = (torch.randn(1, Hkv, S, D, generator=g, device=device).to(dtype) for _ in range(2))
                mask = torch.ones(1, 1, T, S, dtype=torch.bool, device=device)
                mask[..., S - T:] = torch.ones(T, T, dtype=torch.bool, device=device).tril()
                keep = torch.rand(1, Hkv, 1, S, generator=g, device=device) < share
                keep[..., S - T:] = True  # the tokens being verified
                for splits in dict.fromkeys((sa.default_splits(S), 1)):  # the kept list shared, and not
                    add(f"sparse_attn H{H}/{Hkv} keep {share} /{splits}", dtype, (H, T, D, S), _efficient_sdpa,
                        lambda *a, n=splits: sa.sparse_attention_triton(*a, splits=n), (q, keys, values, mask, keep))
    return rows


def _efficient_sdpa(*args):
    """The sparse reference under the SDPA kernels the runtime uses on CUDA (cuDNN plans every new shape)."""
    from kernels import sparse_attention as sa
    from kernels.sdpa_kernels import sdpa_kernels

    with sdpa_kernels(args[0].device):
        return sa.sparse_attention_torch(*args)


def print_table(rows: list[dict]) -> None:
    head = f"{'kernel':<31}{'dtype':<10}{'shape':<16}{'exact':<7}{'max|err|':>10}{'mism%':>8}" \
           f"{'torch ms':>10}{'triton ms':>11}{'x':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['kernel']:<31}{r['dtype']:<10}{r['shape']:<16}{'yes' if r['exact'] else 'NO':<7}"
              f"{r['max_abs_err']:>10.3g}{100 * r['mismatch_share']:>8.3f}{r['torch_ms']:>10.4f}"
              f"{r['triton_ms']:>11.4f}{r['speedup']:>7.1f}  {r.get('mismatches', '')} {r.get('part_max_abs_err', '')}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels.gpu_check: no CUDA device", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = check_all(seed=args.seed)
    print_table(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
