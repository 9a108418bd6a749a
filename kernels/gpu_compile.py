"""Compile every Triton kernel for a CUDA GPU on a machine without one: `python -m kernels.gpu_compile`.

Triton's CPU interpreter (the tests' way of running the kernels) checks what a kernel computes, not that it
compiles: lowering to a GPU, the layouts of `tl.dot`, shared memory and ptxas are never reached. Here each wrapper
runs on CPU tensors under a stand-in driver that reports a CUDA target, so Triton compiles the kernel it would
launch -- the same specialisation, down to a cubin with the ptxas Triton ships -- and returns without launching.
The outputs are left unwritten. What a GPU session would otherwise find first is found here: a kernel that does not
compile, one whose shared memory does not fit, or one that spills registers to local memory (read from the cubin
with the cuobjdump Triton ships).
"""
from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import torch

HOPPER = 90  # H100 / H200: sm_90
HOPPER_SHARED_BYTES = 227 * 1024  # the most shared memory one block may use on sm_90


@contextlib.contextmanager
def compile_only(arch: int = HOPPER) -> Iterator[list[dict]]:
    """Within: Triton kernels launched from any wrapper compile for CUDA sm_`arch` instead of running. Yields the
    list that receives, per compiled kernel, its name, constexprs and shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    class StandIn:  # what JITFunction.run asks of the driver before it compiles
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

    compiled: list[dict] = []
    run = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)  # warmup: compile, do not launch
        constants = {k: v for k, v in kwargs.items() if k.isupper()}
        compiled.append({"kernel": self.fn.__name__, "constexprs": constants, "num_warps": kernel.metadata.num_warps,
                         "shared_bytes": kernel.metadata.shared, **resource_usage(kernel.asm["cubin"])})
        return kernel

    previous = driver._active  # reset_active() would create the default driver, which needs a GPU
    driver.set_active(StandIn())
    JITFunction.run = compile_instead
    try:
        yield compiled
    finally:
        JITFunction.run = run
        driver._active = previous


def resource_usage(cubin: bytes) -> dict:
    """Registers per thread and stack bytes (register spills) of a cubin's kernel, as the cuobjdump that ships with
    Triton reads them."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                             check=True).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return {"registers": int(usage[1]), "stack_bytes": int(usage[2])}


def compile_all(arch: int = HOPPER) -> list[dict]:
    """Every wrapper in kernels/, in fp32 and bf16 and each specialisation the runtime launches."""
    from kernels import kv_quant as kq
    from kernels import sparse_attention as sa
    from kernels import topp

    with compile_only(arch) as compiled:
        for dtype in (torch.float32, torch.bfloat16):
            topp.topp_mask_triton(torch.rand(48, 512).to(dtype), 0.9)
            for D in (64, 128):
                x = torch.randn(2, 8, 64, D).to(dtype)
                kq.quantize_int8_triton(x)
                for group in (32, D):
                    packed, scale = kq.quantize_int4_triton(x, group)
                    kq.dequantize_int4_triton(packed, scale)
                upper, lower, scale = kq.quantize_hierarchical_triton(x)
                kq.dequant_upper_triton(upper, scale)
                kq.dequant_full_triton(upper, lower, scale)
                # SpecAttn: a tree verify (mask, one kept set) in one split and shared; a per-query kept set, no mask
                H, Hkv, T, S = (9, 3, 16, 512) if D == 64 else (32, 8, 16, 4096)
                q, keys = torch.randn(1, H, T, D).to(dtype), torch.randn(1, Hkv, S, D).to(dtype)
                mask = torch.ones(1, 1, T, S, dtype=torch.bool)
                for splits in (1, sa.default_splits(S)):
                    sa.sparse_attention_triton(q, keys, keys, mask, torch.ones(1, Hkv, 1, S, dtype=torch.bool),
                                               splits=splits)
                sa.sparse_attention_triton(q, keys, keys, None, torch.ones(1, Hkv, T, S, dtype=torch.bool))
    return compiled


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=HOPPER, help="CUDA compute capability x 10 (default: 90, Hopper)")
    args = ap.parse_args(argv)
    compiled = compile_all(args.arch)
    for c in compiled:
        print(f"{c['kernel']:<28}{c['shared_bytes']:>7} B shared {c['registers']:>4} regs {c['stack_bytes']:>5} B stack"
              f"  {c['num_warps']} warps  {c['constexprs']}")
    bad = [c for c in compiled if c["shared_bytes"] > HOPPER_SHARED_BYTES or c["stack_bytes"]]
    print(f"{len(compiled)} kernels compiled for sm_{args.arch}; {len(bad)} over {HOPPER_SHARED_BYTES} B of shared "
          "memory or spilling registers to the stack")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
