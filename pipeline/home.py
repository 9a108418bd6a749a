"""Where draftsmith keeps things between runs, and how it writes them so a kill never leaves half a file."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from runtime.files import sha256_file  # noqa: F401  (re-exported for pipeline modules)


def home() -> Path:
    return Path(os.environ.get("DRAFTSMITH_HOME") or Path.home() / ".cache" / "draftsmith")


def digest_json(obj) -> str:
    """Stable digest of a JSON-able object (sorted keys), used for inputs and config digests."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temp dir beside `final`; rename it into place only if the block finishes.

    The temp dir lives in the same parent so the rename is atomic; a crash leaves only a `.tmp-*` dir,
    which no reader ever looks at and the next attempt removes.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".tmp-{final.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            # Move the old one aside first: rename over a non-empty dir is not allowed.
            old = final.parent / f".old-{final.name}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json_atomic(path: Path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
    os.replace(tmp, path)
