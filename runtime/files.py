"""File hashing shared by the bundle reader (here) and the layers above (export, pipeline), and reading a
.safetensors file tensor by tensor."""
from __future__ import annotations

import hashlib
import json
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


class SafetensorsReader:
    """The tensors of .safetensors files, each read from disk when asked for, into memory of its own.
    safetensors' loaders map the file: a tensor then keeps its pages, or the whole file's, resident while it lives,
    and a model that fuses or repacks what it loads would keep the originals too."""

    def __init__(self, files: list[Path]):
        self.where: dict[str, tuple[Path, int, dict]] = {}
        for path in files:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            header.pop("__metadata__", None)
            self.where |= {name: (path, 8 + size, info) for name, info in header.items()}

    def names(self) -> list[str]:
        return list(self.where)

    def read(self, name: str) -> Tensor:
        path, start, info = self.where[name]
        begin, end = info["data_offsets"]
        tensor = torch.empty(info["shape"], dtype=SAFETENSORS_DTYPES[info["dtype"]])
        with open(path, "rb") as f:
            f.seek(start + begin)
            if f.readinto(memoryview(tensor.view(-1).view(torch.uint8).numpy())) != end - begin:
                raise ValueError(f"{path}: {name} is cut short (a truncated file)")
        return tensor
