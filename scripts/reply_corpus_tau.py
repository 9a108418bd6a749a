"""tau on a stream of requests that repeat a few templates, with the lookup corpus learning served replies and
without: the stream's second half against its first.

An n-gram drafter bundle for the target is loaded by the path serving uses, and the stream (code-ish requests, four
templates with their blanks filled differently each time, in a fixed shuffled order) is served one request at a time
at temperature 0 through the batched scheduler. tau is tokens per target forward over a half's requests.

    python scripts/reply_corpus_tau.py [--target smollm2-135m-instruct] [--requests 24] [--max-tokens 96]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from pipeline.bench.openai_stream import served_ngram
from pipeline.sources import resolve_target
from runtime.serving.batch_engine import BatchRequest
from runtime.speculation.decode_stats import tokens_per_forward
from runtime.speculation.draft_budget import ServedBudget

TEMPLATES = [
    "Write a Python function `get_{a}(record: dict) -> str` that returns record['{a}'] and raises KeyError with a "
    "clear message when it is missing. Include a docstring.",
    "Write a SQL query that selects id, {a} and {b} from the table `{t}` where {a} is not null, ordered by {b}.",
    "Write a Python dataclass `{T}` with the fields {a}: str, {b}: int and created_at: datetime, and a method "
    "`to_dict` that returns them as a dict.",
    "Write a pytest test `test_{a}_{b}` that calls `{a}({b}=3)` and asserts that the result equals 9.",
]
WORDS = ["name", "email", "price", "city", "owner", "status", "title", "count", "score", "color", "size", "label"]
TABLES = ["users", "orders", "items", "events", "cities", "accounts"]


def stream(n: int, seed: int = 0) -> list[str]:
    """`n` requests, the templates taken in turn with fresh words, then shuffled."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.sample(WORDS, 2)
        out.append(TEMPLATES[i % len(TEMPLATES)].format(a=a, b=b, t=rng.choice(TABLES), T=a.title() + b.title()))
    rng.shuffle(out)
    return out


def run(target_dir: Path, prompts: list[str], learn_tokens: int, max_tokens: int, budget: ServedBudget) -> dict:
    served = served_ngram(Path(tempfile.mkdtemp()), target_dir, max_batch=1, max_queue=1, timeout_s=600,
                          budget=budget.to_dict(), learn_tokens=learn_tokens)
    rows, start = [], time.perf_counter()
    for prompt in prompts:
        ids = served.chat_ids(prompt)
        [g] = served.scheduler.generate([BatchRequest(0, ids, max_tokens, stop_ids=served.stop_ids)])
        rows.append((len(g.tokens), g.metrics.target_forwards))
    seconds = time.perf_counter() - start
    half = len(rows) // 2

    def tau(part):
        return tokens_per_forward(sum(t for t, _ in part), len(part), sum(f for _, f in part))

    return {"learn_tokens": learn_tokens, "tau_first_half": round(tau(rows[:half]), 3),
            "tau_second_half": round(tau(rows[half:]), 3), "gain": round(tau(rows[half:]) - tau(rows[:half]), 3),
            "tokens": sum(t for t, _ in rows), "seconds": round(seconds, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--budget", default="6x1/6", help="the n-gram drafter's draft budget")
    p.add_argument("--learn-tokens", type=int, default=16384)
    args = p.parse_args()
    target_dir, prompts = resolve_target(args.target), stream(args.requests)
    for learn in (0, args.learn_tokens):
        print(json.dumps(run(target_dir, prompts, learn, args.max_tokens, ServedBudget.parse(args.budget))),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
