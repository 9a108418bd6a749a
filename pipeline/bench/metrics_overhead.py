"""What scraping `/metrics` costs the OpenAI-compatible server: throughput at `--clients` concurrent clients with a
scraper reading /metrics every `--scrape-s` seconds against the same server unscraped, in alternating rounds (off,
on, off, on, ...) so that a host's drifting load falls on both alike. An n-gram drafter bundle on a real target,
served in this process as openai_stream serves it; every request greedy, `--max-tokens` long.

    python -m pipeline.bench.metrics_overhead [--target smollm2-135m-instruct] [--rounds 4] [--requests 16]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from pipeline.bench.openai_stream import running, served_ngram
from pipeline.code_requests import code_prompts
from pipeline.serving.api_server import build_app
from pipeline.sources import resolve_target


def scraping(url: str, every_s: float, stop: threading.Event, count: list[int]) -> None:
    """GET /metrics every `every_s` until `stop`, as Prometheus would (counting the scrapes)."""
    while not stop.wait(every_s):
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
            r.read()
        count[0] += 1


def one_round(client, url: str, prompts: list[str], clients: int, max_tokens: int, scrape_s: float | None) -> dict:
    """Throughput (completion tokens / wall time) of `prompts` sent by `clients` threads, scraped or not."""
    stop, scrapes = threading.Event(), [0]
    scraper = threading.Thread(target=scraping, args=(url, scrape_s, stop, scrapes)) if scrape_s else None

    def ask(prompt: str) -> int:
        return client.chat.completions.create(model="drafter", temperature=0, max_tokens=max_tokens, messages=[
            {"role": "user", "content": prompt}]).usage.completion_tokens

    start = time.perf_counter()
    if scraper:
        scraper.start()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(ask, prompts))
    seconds = time.perf_counter() - start
    stop.set()
    if scraper:
        scraper.join()
    return {"scraped": bool(scrape_s), "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 2), "scrapes": scrapes[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4, help="rounds of each kind, alternating")
    p.add_argument("--requests", type=int, default=16, help="requests a round")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--scrape-s", type=float, default=1.0, help="seconds between scrapes (Prometheus' default: 15)")
    args = p.parse_args()
    import openai

    served = served_ngram(Path(tempfile.mkdtemp()), resolve_target(args.target), max_batch=args.clients,
                          max_queue=args.clients, timeout_s=600, max_new_tokens=args.max_tokens)
    prompts = code_prompts(args.requests, seed=3)
    rows = []
    with running(build_app(served, "drafter")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        one_round(client, url, prompts[:args.clients], args.clients, args.max_tokens, None)  # warm-up
        for i in tqdm(range(2 * args.rounds), desc="rounds (unscraped, scraped, ...)"):
            rows.append(one_round(client, url, prompts, args.clients, args.max_tokens, args.scrape_s if i % 2 else None))
    off = [r["tokens_per_s"] for r in rows if not r["scraped"]]
    on = [r["tokens_per_s"] for r in rows if r["scraped"]]
    summary = {"clients": args.clients, "scrape_every_s": args.scrape_s, "unscraped_tokens_per_s": off,
               "scraped_tokens_per_s": on, "median_ratio": round(statistics.median(on) / statistics.median(off), 4),
               "same_tokens": len({r["tokens"] for r in rows}) == 1}
    print(json.dumps({"rounds": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
