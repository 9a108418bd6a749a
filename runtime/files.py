"""File hashing shared by the bundle reader (here) and the layers above (export, pipeline), and reading a
.safetensors file tensor by tensor."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import Tensor

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


CAST_CHUNK = 64 << 20  # bytes of a tensor read at a time where it is cast as read: a transient of this size only


class SafetensorsReader:
    """The tensors of .safetensors files, each read from disk when asked for, into memory of its own.
    safetensors' loaders map the file: a tensor then keeps its pages, or the whole file's, resident while it lives,
    and a model that fuses or repacks what it loads would keep the originals too."""

    def __init__(self, files: list[Path]):
        self.where: dict[str, tuple[Path, int, dict]] = {}
        for path in files:
            header, start = _header(path)
            self.where |= {name: (path, start, info) for name, info in header.items()}

    def names(self) -> list[str]:
        return list(self.where)

    def read(self, name: str, dtype: torch.dtype | None = None) -> Tensor:
        """Tensor `name`, in `dtype` where given: cast a chunk at a time as it is read, so that a bf16 load never
        holds the file's fp32 tensor whole beside its cast."""
        path, start, info = self.where[name]
        begin, end = info["data_offsets"]
        stored = SAFETENSORS_DTYPES[info["dtype"]]
        tensor = torch.empty(info["shape"], dtype=dtype or stored)
        if tensor.numel() * stored.itemsize != end - begin:
            raise ValueError(f"{path}: tensor {name!r} holds {end - begin} bytes, not {info['shape']} of "
                             f"{info['dtype']}")
        flat, step = tensor.view(-1), max(1, CAST_CHUNK // stored.itemsize)
        with open(path, "rb") as f:
            f.seek(start + begin)
            if tensor.dtype == stored:
                _read_into(f, flat, path, name)
                return tensor
            for i in range(0, flat.numel(), step):
                part = _read_into(f, torch.empty(min(step, flat.numel() - i), dtype=stored), path, name)
                flat[i:i + part.numel()] = part
        return tensor


def _read_into(f, tensor: Tensor, path: Path, name: str) -> Tensor:
    if f.readinto(memoryview(tensor.view(torch.uint8).numpy())) != tensor.nbytes:
        raise ValueError(f"{path}: tensor {name!r} is truncated (the file ends inside it)")
    return tensor


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header without its metadata, and where its data starts; one-line errors for a file
    that is not one, or holds a dtype torch has not."""
    with open(path, "rb") as f:
        size, total = int.from_bytes(f.read(8), "little"), os.fstat(f.fileno()).st_size
        try:
            header = json.loads(f.read(size)) if 8 + size <= total else None
        except ValueError:  # JSON's errors and undecodable bytes
            header = None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (no JSON header of {size} bytes in {total})")
    header.pop("__metadata__", None)
    for name, info in header.items():
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, expected one of "
                             f"{sorted(SAFETENSORS_DTYPES)}")
    return header, 8 + size


def read_tensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of one safetensors file, in memory of its own instead of mapped from the file (load_file maps
    it: every page read through the mapping stays resident until the last tensor on it is gone, so a module built
    from it and packed holds the file beside its packed copy). Each tensor can then be freed alone."""
    reader = SafetensorsReader([Path(path)])
    return {name: reader.read(name) for name in reader.names()}
