"""keep_freed_memory: after it, a large freed tensor's memory is reused rather than unmapped and faulted in again;
release_freed_memory hands it back (what `pipeline run` does between stages)."""
import subprocess
import sys

import pytest

PROBE = """
import ctypes, sys, torch
from runtime.host_memory import keep_freed_memory, returning_large_blocks

class MallInfo2(ctypes.Structure):  # glibc >= 2.33
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks "
                                                "fordblks keepcost").split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
def mapped_during_alloc():
    x = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MiB: above glibc's largest mmap threshold
    return libc.mallinfo2().hblkhd >= 64 << 20
before = mapped_during_alloc()
kept = keep_freed_memory()
after = mapped_during_alloc()
with returning_large_blocks():
    inside = mapped_during_alloc()
print(before, kept, after, inside, mapped_during_alloc())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_large_tensors_stay_in_the_heap_after_keep_freed_memory_but_inside_returning_large_blocks():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True", "False", "True", "False"]  # mmapped before; from the heap after, but inside


RELEASE_PROBE = """
import torch
from runtime.host_memory import keep_freed_memory, release_freed_memory

def resident_mib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) // 1024
keep_freed_memory()
class Stage:  # a stage's objects in a reference cycle, as a model's modules are: freed only by the collector
    pass
stage = Stage()
stage.self, stage.weights = stage, torch.ones(256 << 20, dtype=torch.uint8)  # 256 MiB, every page touched
del stage
held = resident_mib()
release_freed_memory()
print(held - resident_mib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_release_freed_memory_hands_a_freed_stages_memory_back():
    out = subprocess.run([sys.executable, "-c", RELEASE_PROBE], capture_output=True, text=True, check=True).stdout
    assert int(out) >= 200  # MiB of the 256 given back

