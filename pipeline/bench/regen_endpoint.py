"""What regenerating through an OpenAI-compatible endpoint costs in token ids, with this project's own server as the
endpoint: the real target behind `build_app` on 127.0.0.1 (traffic capture on, so the ids it generated are known),
prepare's endpoint pass over ShareGPT conversations, then the local pass (train.regenerate) over the same ones.

Reports how many replies' re-tokenised text equals the ids the server generated, how many rows equal the local
pass's rows, and both passes' wall times.

    python -m pipeline.bench.regen_endpoint [--target smollm2-135m-instruct] [--conversations 32] [--max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from difflib import SequenceMatcher
from pathlib import Path


def _captured(db: Path) -> list[dict]:
    import sqlite3

    with sqlite3.connect(db) as con:
        con.row_factory = sqlite3.Row
        return [dict(r) for r in con.execute("SELECT prompt, prompt_ids, reply, reply_ids, finish_reason "
                                             "FROM served_requests ORDER BY id")]


def _rows_by_key(work: Path) -> dict[int, list[int]]:
    from safetensors.torch import load_file

    rows = {}
    for shard in sorted(work.glob("shard-*.safetensors")):
        t = load_file(str(shard))
        for i, key in enumerate(t["keys"].tolist()):
            rows[key] = t["input_ids"][int(t["offsets"][i]):int(t["offsets"][i + 1])].tolist()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-length", type=int, default=384)
    p.add_argument("--concurrency", type=int, default=4)
    args = p.parse_args()
    from transformers import AutoTokenizer

    from pipeline.bench.openai_stream import running, served_ngram
    from pipeline.serving.api_server import build_app
    from pipeline.serving.capture import CaptureSettings, TrafficCapture
    from pipeline.sources import load_conversations, resolve_target
    from pipeline.tokens import stop_ids
    from runtime.speculation.sampling import SamplingParams
    from runtime.target.loading import from_pretrained
    from train.data import tokenize_prompt
    from train.regenerate import RegenSettings, regenerate
    from train.regenerate_endpoint import Endpoint, answer_ids, regenerate_via_endpoint

    target_dir = resolve_target(args.target)
    tok = AutoTokenizer.from_pretrained(target_dir)
    convs = load_conversations("sharegpt", limit=args.conversations).items
    settings = RegenSettings(max_length=args.max_length, max_new_tokens=args.max_new_tokens, min_assistant_tokens=8,
                             batch_size=8, params=SamplingParams(), keep_hidden=False)
    eos = stop_ids(tok)
    tmp = Path(tempfile.mkdtemp())
    capture = TrafficCapture(CaptureSettings(f"sqlite:///{tmp / 'traffic.db'}"))
    served = served_ngram(tmp, target_dir, max_batch=args.concurrency, max_queue=args.concurrency,
                          timeout_s=3600)
    with running(build_app(served, "teacher", capture=capture)) as url:
        start = time.perf_counter()
        regenerate_via_endpoint(Endpoint(f"{url}/v1", None, None, args.concurrency, 2, 3600), tok, convs,
                                tmp / "endpoint", settings, eos[0])
        endpoint_s = time.perf_counter() - start
    capture.flush()
    start = time.perf_counter()
    regenerate(from_pretrained(target_dir, max_seq_len=args.max_length), tok, convs, tmp / "local", settings, eos)
    local_s = time.perf_counter() - start

    same_ids = same_prompt = tokens = unmatched = 0
    captured = _captured(tmp / "traffic.db")
    for r in captured:
        history, generated = json.loads(r["prompt"]), json.loads(r["reply_ids"])
        generated = [t for t in generated if t not in eos]
        prompt = tokenize_prompt(tok, history, args.max_length)[0]
        ids, _ = answer_ids(tok, history, prompt, r["reply"], False, None, 10**9)
        same_prompt += prompt == json.loads(r["prompt_ids"])
        same_ids += ids == generated
        tokens += len(generated)
        # generated ids the re-tokenised reply has no counterpart for (a split differing only shifts the rest)
        matched = SequenceMatcher(None, ids, generated, autojunk=False).get_matching_blocks()
        unmatched += len(generated) - sum(b.size for b in matched)
    rows, local_rows = _rows_by_key(tmp / "endpoint"), _rows_by_key(tmp / "local")
    both = rows.keys() & local_rows.keys()
    report = {"target": args.target, "conversations": len(convs), "replies": len(captured),
              "replies_retokenised_equal": same_ids, "prompts_equal_servers": same_prompt,
              "reply_tokens": tokens, "generated_tokens_unmatched": unmatched,
              "rows_endpoint": len(rows), "rows_local": len(local_rows),
              "rows_in_both": len(both), "rows_equal_local": sum(rows[k] == local_rows[k] for k in both),
              "endpoint_pass_s": round(endpoint_s, 1), "local_pass_s": round(local_s, 1)}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
