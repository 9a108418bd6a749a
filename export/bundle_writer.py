"""Write a drafter bundle: weights (safetensors), config, extra reports, and a manifest of sha256s."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.bundle_reader import CONFIG, FORMAT, MANIFEST, WEIGHTS
from runtime.files import sha256_file


def write_bundle(out: Path, drafter_config: dict, tensors: dict[str, torch.Tensor] | None, *,
                 target_fingerprint: str, data_digest: str, config: dict, code_version: str,
                 extra_files: dict[str, Path] | None = None, extra_manifest: dict | None = None) -> dict:
    """Fill `out` (a fresh directory inside a stage's atomic temp dir) and return the manifest written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(drafter_config, indent=2, sort_keys=True) + "\n")
    if tensors:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / WEIGHTS))
    for name, src in (extra_files or {}).items():
        shutil.copyfile(src, out / name)
    files = {p.name: sha256_file(p) for p in sorted(out.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {"format": FORMAT, "files": files, "target_fingerprint": target_fingerprint,
                "data_digest": data_digest, "config": config, "code_version": code_version,
                **(extra_manifest or {})}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest
