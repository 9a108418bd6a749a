"""A bounded load against a scoring server on 127.0.0.1: `concurrency` clients, each sending one single-row request
at a time until `requests` have been sent, and what came back (throughput, latency percentiles, answers, errors);
and starting, awaiting and stopping such a server."""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 90.0) -> None:
    """Poll `url` until it answers 200; fail early with the server's log if the process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered:\n"
                               f"{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f}s:\n{log.read_text()[-3000:]}")


def start_server(argv: list[str], env: dict[str, str], log: Path, timeout_s: float = 600.0) -> subprocess.Popen:
    """Start a scoring server (`pipeline serve`'s command, serving.serve_invocation) in its own session, its output
    to `log`, and wait until its /ping answers."""
    port = argv[argv.index("--port") + 1]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/ping", proc, log, timeout_s)
    except BaseException:
        stop(proc)
        raise
    return proc


def stop(proc: subprocess.Popen) -> None:
    """Stop a server started in its own session, workers included."""
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def post(url: str, rows: list[dict], timeout_s: float) -> tuple[int, object]:
    """POST rows to the server's /invocations: (HTTP status, its predictions or its error text)."""
    body = json.dumps({"dataframe_records": rows}).encode()
    request = urllib.request.Request(f"{url}/invocations", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())["predictions"]
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of `values`; NaN for none."""
    if not values:
        return math.nan
    ranked = sorted(values)
    return ranked[max(0, math.ceil(q / 100 * len(ranked)) - 1)]


def run_load(url: str, prompts: list[str], concurrency: int, requests: int, max_new_tokens: int,
             count_tokens: Callable[[str], int], timeout_s: float = 600.0) -> dict:
    """Request i asks prompts[i % len(prompts)] greedily for `max_new_tokens`; `count_tokens` counts an answer's
    tokens (the server returns text). Returns throughput (answered tokens / wall time), p50/p99 latency, how many
    were answered, the errors by status and every answer by request index."""
    if concurrency < 1 or requests < 1:
        raise ValueError(f"run_load: concurrency={concurrency} and requests={requests} must both be >= 1")
    lock, next_index = threading.Lock(), iter(range(requests))
    answers: dict[int, str] = {}
    latencies: list[float] = []
    errors: list[dict] = []

    def client() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            start = time.perf_counter()
            try:
                status, out = post(url, [{"prompt": prompts[i % len(prompts)], "max_new_tokens": max_new_tokens}],
                                   timeout_s)
            except OSError as e:  # the connection itself failed: an error, not a lost request
                status, out = None, f"{type(e).__name__}: {e}"
            elapsed = time.perf_counter() - start
            with lock:
                if status == 200:
                    answers[i] = out[0]
                    latencies.append(elapsed)
                else:
                    errors.append({"request": i, "status": status, "error": str(out)[:300]})

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(min(concurrency, requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    tokens = sum(count_tokens(a) for a in answers.values())
    return {"concurrency": concurrency, "requests": requests, "answered": len(answers), "errors": errors,
            "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "p50_s": percentile(latencies, 50), "p99_s": percentile(latencies, 99),
            "answers": {i: answers[i] for i in sorted(answers)}}


def same_as_reference(result: dict, prompts: list[str], reference: dict[str, str]) -> bool:
    """Whether every answer equals the reference answer to its prompt (greedy answers do not depend on the load)."""
    return all(reference[prompts[i % len(prompts)]] == a for i, a in result["answers"].items())
