"""The OpenAI-compatible server on a real target, without a registry: an n-gram drafter bundle for it, loaded by the
path serving uses, served on 127.0.0.1 in this process and driven by the `openai` client. Reports, per prompt, the
streamed text against the whole reply's at temperature 0 (they must be equal) and the time to the first streamed
token against a whole request of one token (a prefill and its first token), one request at a time.

    python -m pipeline.bench.openai_stream [--target smollm2-135m-instruct] [--max-tokens 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import sys
import json
import statistics
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from export.bundle_writer import write_bundle
from pipeline.bench.harness import default_bench_prompts
from pipeline.bench.load import free_port
from pipeline.serving.api_server import build_app
from pipeline.serving.served_model import ServedModel, load_served
from pipeline.serving.settings import BatchSettings
from pipeline.sources import resolve_target, target_fingerprint

CHAIN = {"depth": 3, "width": 1, "nodes": 3, "adaptive": False, "lookup": 0, "max_tree": 0}


def served_ngram(tmp: Path, target_dir: Path, max_batch: int = 2, max_queue: int = 2, timeout_s: float = 120.0,
                 max_new_tokens: int = 12, policy: str = "fixed", budget: dict = CHAIN,
                 learn_tokens: int = 0) -> ServedModel:
    """An n-gram drafter bundle for `target_dir` (kept in `tmp`), loaded as `pipeline serve` loads a registered
    one; `learn_tokens` as DRAFTSMITH_LEARN_TOKENS, off by default so that a row's drafts depend on its own tokens
    only."""
    if not (tmp / "bundle").exists():
        write_bundle(tmp / "bundle", {"kind": "ngram", "max_ngram": 4}, None,
                     target_fingerprint=target_fingerprint(target_dir), data_digest="d", config={},
                     code_version="test")
    config = {"target": str(target_dir), "max_new_tokens": max_new_tokens, "budget": budget, "precision": "fp32"}
    return load_served(config, str(tmp / "bundle"), BatchSettings(max_batch, max_queue, timeout_s, policy, learn_tokens))


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timings: the median of this many requests each")
    args = p.parse_args()
    import openai

    served = served_ngram(Path(tempfile.mkdtemp()), resolve_target(args.target), max_batch=4, max_queue=4)
    rows = []
    with running(build_app(served, "drafter")) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        for prompt in default_bench_prompts():
            messages = [{"role": "user", "content": prompt}]
            whole = c.chat.completions.create(model="drafter", messages=messages, max_tokens=args.max_tokens,
                                              temperature=0).choices[0].message.content
            pieces, ttft, one = [], [], []
            for _ in range(args.repeats):
                start, got = time.perf_counter(), []
                for chunk in c.chat.completions.create(model="drafter", messages=messages, temperature=0,
                                                       max_tokens=args.max_tokens, stream=True):
                    if chunk.choices and chunk.choices[0].delta.content:
                        if not got:
                            ttft.append(time.perf_counter() - start)
                        got.append(chunk.choices[0].delta.content)
                pieces = got
                start = time.perf_counter()
                c.chat.completions.create(model="drafter", messages=messages, max_tokens=1, temperature=0)
                one.append(time.perf_counter() - start)
            rows.append({"prompt": prompt, "equal": "".join(pieces) == whole, "pieces": len(pieces),
                         "ttft_s": statistics.median(ttft), "one_token_request_s": statistics.median(one)})
    print(json.dumps(rows, indent=1))
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
