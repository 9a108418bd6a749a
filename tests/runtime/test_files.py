"""runtime.files: safetensors read into memory of its own, checked, and cast a chunk at a time as it is read."""
import pytest
import torch
from safetensors.torch import load_file, save_file

import runtime.files
from runtime.files import SafetensorsReader, read_tensors


def test_read_tensors_reads_a_file_into_memory_of_its_own(tmp_path):
    """read_tensors gives load_file's tensors, each dtype and shape, on storage of their own: none is on a mapping
    of the file, whose pages would stay resident while any tensor on it lives."""
    path = tmp_path / "w.safetensors"
    saved = {"embed.weight": torch.randn(64, 16), "scale": torch.full((16,), 2.0, dtype=torch.bfloat16),
             "ids": torch.arange(5), "flag": torch.tensor(True), "q": torch.randint(-8, 8, (3, 4), dtype=torch.int8)}
    save_file(saved, path, metadata={"scheme": "int8"})
    read = read_tensors(path)
    assert read.keys() == saved.keys()
    for name, t in saved.items():
        assert read[name].dtype == t.dtype and torch.equal(read[name], t)
    mapped = load_file(path)  # the check's own control: load_file's tensors are on the mapping
    regions = [tuple(int(a, 16) for a in line.split()[0].split("-")) for line in open("/proc/self/maps")
               if line.rstrip().endswith(str(path))]
    on_file = lambda t: any(a <= t.untyped_storage().data_ptr() < b for a, b in regions)
    assert regions and all(on_file(t) for t in mapped.values() if t.numel())
    assert not any(on_file(t) for t in read.values())


def test_read_tensors_names_a_truncated_or_foreign_file(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(32, 32)}, path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"w.safetensors: tensor 'w' is truncated"):
        read_tensors(path)
    path.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match=r"w.safetensors: not a safetensors file"):
        read_tensors(path)


def test_a_tensor_read_into_another_dtype_is_cast_a_chunk_at_a_time(tmp_path, monkeypatch):
    """A bf16 load of an fp32 file holds one chunk of fp32 at a time, never the whole tensor beside its cast, and
    every chunk lands where it belongs."""
    path = tmp_path / "w.safetensors"
    weight = torch.randn(3000)
    save_file({"w": weight, "b": torch.randn(7)}, path)
    monkeypatch.setattr(runtime.files, "CAST_CHUNK", 1000)  # bytes: 250 fp32 values
    reads = []
    real = runtime.files._read_into
    monkeypatch.setattr(runtime.files, "_read_into", lambda f, t, *a: reads.append(t.numel()) or real(f, t, *a))
    reader = SafetensorsReader([path])
    cast = reader.read("w", torch.bfloat16)
    assert cast.dtype == torch.bfloat16 and torch.equal(cast, weight.to(torch.bfloat16))
    assert max(reads) == 250 and sum(reads) == 3000
    assert torch.equal(reader.read("b"), load_file(path)["b"])  # no dtype: as stored, read whole
