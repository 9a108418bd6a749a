"""keep_freed_memory: after it, a large freed tensor's memory is reused rather than unmapped and faulted in again;
release_freed_memory hands it back (what `pipeline run` does between stages)."""
import subprocess
import sys

import pytest

PROBE = """
import ctypes, sys, torch
from runtime.host_memory import keep_freed_memory

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
print(before, kept, mapped_during_alloc())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_large_tensors_stay_in_the_heap_after_keep_freed_memory():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True", "False"]  # mmapped before; from the heap after


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


def test_own_copies_lets_a_loaded_files_mapping_go(tmp_path):
    """A module built on load_file's tensors (mapped from the file) holds copies of its own after own_copies: equal
    values, a tied weight still tied, and nothing left on the mapping, whose pages then stop counting as resident."""
    import torch
    from safetensors.torch import load_file, save_file
    from torch import nn

    from runtime.host_memory import own_copies

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(64, 16), nn.Linear(16, 64, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("scale", torch.ones(16))

    save_file({"embed.weight": torch.randn(64, 16), "scale": torch.full((16,), 2.0)}, tmp_path / "w.safetensors")
    mapped = load_file(tmp_path / "w.safetensors")
    module = Tied()
    module.load_state_dict({**mapped, "head.weight": mapped["embed.weight"]}, assign=True)
    module.head.weight = module.embed.weight
    on_file = {t.untyped_storage().data_ptr() for t in mapped.values()}
    assert module.embed.weight.untyped_storage().data_ptr() in on_file
    assert own_copies(module, mapped) == (64 * 16 + 16) * 4
    held = [*module.parameters(), *module.buffers()]
    assert not any(t.untyped_storage().data_ptr() in on_file for t in held)
    assert module.head.weight is module.embed.weight and isinstance(module.embed.weight, nn.Parameter)
    assert torch.equal(module.embed.weight, mapped["embed.weight"]) and torch.equal(module.scale, mapped["scale"])
