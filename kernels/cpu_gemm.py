"""Small-batch fp32 products on AVX2 CPUs: our own C++ kernel (cpu_gemm.cpp), F.linear its torch reference.

Why our own: decode multiplies 1 row and a tree verify a few rows by each weight, and on AVX2 AMD CPUs the library
kernels grow fast with the rows (the tables: docs/logs/cpu-2026-11.md,
"Measurements moved out of docstrings (2026-11-28)"). It reads the weight packed in panels of 16 output
columns, k-major (`pack`, done once per Linear at load): a tile of up to 6 rows broadcasts each x[m, k] against the
panel's 64-byte line for that k, and while one panel's tiles compute, they prefetch the next panel. A verify's cost
therefore grows by the 6-row tile (EngineConfig.max_tree). From ~64 rows on the library's blocked kernel computes
faster (runtime.target.cpu_packing.OWN_MAX_ROWS).

It is also batch-invariant: every output is the same chain of FMAs over k whatever the number of rows, so a verify
row equals its one-row decode bit for bit (tests/kernels/test_cpu_gemm.py), which greedy losslessness needs.

Built at first use with torch's extension builder (cached on disk). Where the CPU lacks AVX2 or FMA,
or no compiler is present, `available()` is False and callers keep their library kernel.
"""
from __future__ import annotations

import functools
import hashlib
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

SOURCE = Path(__file__).with_name("cpu_gemm.cpp")
STALE_LOCK_S = 600.0  # a build takes a minute or two


@functools.cache
def cpu_info(field: str) -> str:
    """The value of `field` (flags, vendor_id, ...) for the first CPU in /proc/cpuinfo; "" where unknown."""
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith(field))
    except (OSError, StopIteration):
        return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags the first CPU reports (avx2, avx512_vnni, amx_bf16, ...); empty where unknown."""
    return frozenset(cpu_info("flags").split())


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> None:
    """Remove a build lock older than any build: a build killed midway leaves its lock, and torch would wait on it
    forever."""
    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime > max_age_s:
            warnings.warn(f"{lock}: removing a build lock {max_age_s / 60:.0f}+ minutes old (a killed build's)",
                          stacklevel=2)
            lock.unlink(missing_ok=True)
    except FileNotFoundError:
        pass


def build(source: Path, cflags: list[str]) -> bool:
    """Build (or load the cached build of) the C++ `source` as an operator library; False, with a warning, where it
    cannot be built here (no compiler, no ninja, a read-only cache)."""
    from torch.utils.cpp_extension import _get_build_directory, load

    # a changed source, or the same one built for another instruction set, never loads a stale build
    digest = hashlib.sha256(source.read_bytes() + " ".join(cflags).encode()).hexdigest()[:12]
    name = f"draftsmith_{source.stem}_{digest}"
    clear_stale_lock(Path(_get_build_directory(name, verbose=False)))
    try:
        load(name=name, sources=[str(source)], is_python_module=False, extra_cflags=["-O3", "-fopenmp", *cflags])
    except Exception as e:  # at::parallel_for is OpenMP in the header, hence -fopenmp
        warnings.warn(f"kernels/{source.name} did not build ({type(e).__name__}: {str(e)[:200]}); "
                      "its products keep the library kernel", stacklevel=3)
        return False
    return True


@functools.cache
def available() -> bool:
    """Build (or load the cached build of) the kernel once per process; False where it cannot run here."""
    if not {"avx2", "fma"} <= cpu_flags() or not build(SOURCE, ["-mavx2", "-mfma"]):
        return False
    # its output's shape without running it, so torch.compile can trace a forward through it (compile_static)
    torch.library.register_fake("draftsmith_cpu::small_linear")(
        lambda x, panels, n, bias: x.new_empty(x.shape[0], n))
    return True


PANEL = 16  # output columns per panel of the packed weight (NR in cpu_gemm.cpp)


def serves(weight: Tensor) -> bool:
    """Whether small_linear can multiply by `weight` [N, K]: fp32, 2-D, on a CPU, with the kernel built here."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2 and available()


def pack(weight: Tensor) -> Tensor:
    """weight [N, K] -> panels [ceil(N / 16), K, 16] with panels[p, k, c] = weight[16p + c, k] (zero past N): the
    layout small_linear reads, one 64-byte line per k and panel."""
    n, k = weight.shape
    # one copy where no padding is needed: a model's packing then needs no second transient of each weight
    padded = F.pad(weight.detach(), (0, 0, 0, -n % PANEL)) if n % PANEL else weight.detach()
    return padded.reshape(-1, PANEL, k).transpose(1, 2).contiguous()


def unpack(panels: Tensor, n: int, ids: Tensor | None = None) -> Tensor:
    """pack's inverse: the weight [n, K], or only its rows `ids` [R] -> [R, K] (read without the whole copy)."""
    if ids is None:
        return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n]
    return panels[ids // PANEL, :, ids % PANEL]


def small_linear(x: Tensor, panels: Tensor, n: int, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight.T + bias, where panels = pack(weight) and n = weight.shape[0]; meant for a few rows (see
    the table above)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.draftsmith_cpu.small_linear(rows, panels, n, None if bias is None else bias.contiguous())
    return y.view(*x.shape[:-1], n)


def reference(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The same product through torch (equal up to fp32 rounding, not bit for bit: other summation order)."""
    return F.linear(x, weight, bias)
