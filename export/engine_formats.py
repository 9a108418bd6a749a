"""Write a drafter in the layouts serving engines load: each kind says which layouts can express it
(runtime.speculation.drafter.DrafterKind.engine_exports), and each is written here as config.json + model.safetensors +
its other files, refused when its tensor names differ from those the engine's loader maps."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file
from torch import nn

from runtime.drafters import get_kind
from runtime.speculation.drafter import EngineExport

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def write_engine_export(export: EngineExport | str, out: str | Path) -> dict:
    """`export` in directory `out`; a record for the manifest (launch flags relative to out's parent). A format
    that cannot express the drafter (its reason, a str) is refused here, before anything is written."""
    if isinstance(export, str):
        raise ValueError(f"{Path(out).name}: {export}")
    got, want = set(export.tensors), set(export.expected)
    if got != want:
        raise ValueError(f"{export.format}: the tensors differ from the names the engine's loader maps: missing "
                         f"{sorted(want - got)[:5]}, unexpected {sorted(got - want)[:5]}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(export.config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in export.tensors.items()}, str(out / WEIGHTS))
    for name, data in export.files.items():
        (out / name).write_bytes(data)
    return {"format": export.format, "dir": out.name, "files": sorted(p.name for p in out.iterdir()),
            "launch_flags": [flag.format(dir=out.name) for flag in export.launch_flags]}


def write_engine_exports(kind: str, module: nn.Module, verifier: dict, root: str | Path,
                         speculative_tokens: int = 5) -> dict[str, dict | str]:
    """Every layout of `kind`, each in root/<format> where it can express `module`: format -> its manifest record,
    or the reason it cannot."""
    exports = get_kind(kind).engine_exports(module, verifier, speculative_tokens)
    return {name: e if isinstance(e, str) else write_engine_export(e, Path(root) / name) for name, e in exports.items()}
