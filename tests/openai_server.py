"""OpenAI-compatible server fixtures: a drafter bundle for the tiny chat target loaded by the one loading path serving
uses (no registry), and the app run by uvicorn on 127.0.0.1 in a thread of the test process."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from export.bundle import write_bundle
from pipeline.bench.load import free_port
from pipeline.serving.served_model import ServedModel, load_served
from pipeline.serving.settings import BatchSettings
from pipeline.sources import target_fingerprint

CHAIN = {"depth": 3, "width": 1, "nodes": 3, "adaptive": False, "lookup": 0, "max_tree": 0}


def served_ngram(tmp: Path, target_dir: Path, max_batch: int = 2, max_queue: int = 2, timeout_s: float = 120.0,
                 max_new_tokens: int = 12) -> ServedModel:
    """An n-gram drafter bundle for `target_dir`, loaded as `pipeline serve` loads a registered one."""
    write_bundle(tmp / "bundle", {"kind": "ngram", "max_ngram": 4}, None,
                 target_fingerprint=target_fingerprint(target_dir), data_digest="d", config={}, code_version="test")
    config = {"target": str(target_dir), "max_new_tokens": max_new_tokens, "budget": CHAIN, "precision": "fp32"}
    return load_served(config, str(tmp / "bundle"), BatchSettings(max_batch, max_queue, timeout_s, "fixed"))


@contextmanager
def running(app) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 until the block ends; yields its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
