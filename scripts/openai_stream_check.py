"""The OpenAI-compatible server on a real target, without a registry: an n-gram drafter bundle for it, loaded by the
path serving uses, served on 127.0.0.1 in this process and driven by the `openai` client. Reports, per prompt, the
streamed text against the whole reply's at temperature 0 (they must be equal) and the time to the first streamed
token against a whole request of one token (a prefill and its first token), one request at a time.

    python scripts/openai_stream_check.py [--target smollm2-135m-instruct] [--max-tokens 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test fixtures' served model and runner

from openai_server import running, served_ngram  # noqa: E402

from pipeline.bench.harness import default_bench_prompts  # noqa: E402
from pipeline.serving.api_server import build_app  # noqa: E402
from pipeline.sources import resolve_target  # noqa: E402


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
