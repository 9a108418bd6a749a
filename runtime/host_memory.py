"""Keep freed host memory for reuse instead of handing large blocks back to the OS.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh mmap and unmaps it at free,
so each new tensor that large page-faults all its pages in again, and distill makes several such logits tensors per
step (docs/logs/cpu-2026-11.md, "Measurements moved out of docstrings (2026-11-28)"
has what that cost). With mmap off and a high trim threshold, freed blocks stay in the heap and the next
tensor reuses them already faulted in.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
TRIM_THRESHOLD = 1 << 30  # free memory kept at the heap's top before it is returned to the OS


def keep_freed_memory() -> bool:
    """Tune glibc's malloc as above; False (and nothing changed) where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def release_freed_memory() -> bool:
    """Hand freed heap pages back to the OS (glibc's malloc_trim): with keep_freed_memory's settings a model's freed
    load buffers stay resident otherwise (a stage's whole target, into the next stage). Collects cyclic garbage
    first, so that what it held is freed too. False where the C library is not glibc."""
    gc.collect()
    try:
        return bool(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def own_copies(module, mapped: dict) -> int:
    """Copy each parameter and buffer of `module` still on the storage of one of `mapped`'s tensors (a safetensors
    file's mapping, load_file's): while one tensor is left on that mapping, every page read through it stays
    resident. Call it once the module has packed what it needs; returns the bytes copied."""
    import torch.nn as nn

    storages = {t.untyped_storage().data_ptr() for t in mapped.values()}
    copies: dict[int, object] = {}  # a tied parameter is copied once and stays tied
    for m in module.modules():
        for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            if t.is_meta or t.untyped_storage().data_ptr() not in storages:
                continue
            if id(t) not in copies:
                data = t.detach().clone()
                copies[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                    else data
            setattr(m, name, copies[id(t)])
    return sum(c.numel() * c.element_size() for c in copies.values())
