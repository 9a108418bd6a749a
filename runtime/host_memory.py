"""Keep freed host memory for reuse instead of handing large blocks back to the OS.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh mmap and unmaps it at free,
so each new tensor that large page-faults all its pages in again, and distill makes several such logits tensors per
step (docs/logs/cpu-2026-11.md, "Measurements moved out of docstrings (2026-11-28)"
has what that cost). With mmap off and a high trim threshold, freed blocks stay in the heap and the next
tensor reuses them already faulted in. Work whose large blocks do not repeat (a long row's, sliced) runs under
returning_large_blocks instead, and a checkpoint is read into memory of its own (runtime.files.read_tensors), not
mapped.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc's mallopt parameters (malloc.h)
TRIM_THRESHOLD = 1 << 30  # free memory kept at the heap's top before it is returned to the OS
LARGE_BLOCK = 32 << 20  # glibc's largest mmap threshold
MMAP_MAX = 65536  # glibc's default count of mapped blocks
_keeping = False  # whether keep_freed_memory's settings are on


def _glibc(function: str):
    """glibc's `function` (mallopt, malloc_trim); None where the C library is another."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), function)
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Tune glibc's malloc as above; False (and nothing changed) where the C library is not glibc."""
    global _keeping
    mallopt = _glibc("mallopt")
    _keeping = mallopt is not None and bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _keeping


@contextlib.contextmanager
def returning_large_blocks():
    """Inside, blocks above LARGE_BLOCK are mapped apart and unmapped when freed, as glibc does by default: for
    work over a long row, whose large temporaries outgrow one another slice after slice (a 4k row's logits, draft
    attention and masks), which the heap would keep as holes nothing reuses. keep_freed_memory's settings come back
    after, where they were on."""
    mallopt, keeping = _glibc("mallopt"), _keeping
    if mallopt is None:
        yield
        return
    release_freed_memory()  # what is already freed, too
    mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK)
    mallopt(M_MMAP_MAX, MMAP_MAX)
    try:
        yield
    finally:
        if keeping:
            keep_freed_memory()


def release_freed_memory() -> bool:
    """Hand freed heap pages back to the OS (glibc's malloc_trim): with keep_freed_memory's settings a model's freed
    load buffers stay resident otherwise (a stage's whole target, into the next stage). Collects cyclic garbage
    first, so that what it held is freed too. False where the C library is not glibc."""
    gc.collect()
    malloc_trim = _glibc("malloc_trim")
    return malloc_trim is not None and bool(malloc_trim(0))

