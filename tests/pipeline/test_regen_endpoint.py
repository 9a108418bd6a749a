"""prepare regenerating through an OpenAI-compatible endpoint: this project's own server on 127.0.0.1 (a tiny chat
target behind `build_app`, the real `openai` client in prepare). The rows hold the server's replies re-tokenised;
an interrupted pass resumes asking only for the conversations not yet written; a bad URL is one line."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter

import openai
import pytest
from fastapi.responses import JSONResponse
from pipeline.bench.openai_stream import running, served_ngram
from support.helpers import run_stage_on

from pipeline.config import load_config
from pipeline.errors import DraftsmithError
from pipeline.runstore import RunStore
from pipeline.serving.api_server import build_app
from pipeline.stages.prepare import run_prepare
from train.data import TokenizedSet, split_conversations
from train.regenerate_endpoint import FLUSH_S
from train.shards import done_keys, load_features

MODEL, KEY = "teacher", "sk-regen"
MAX_LENGTH, NEW_TOKENS = 48, 10


@pytest.fixture(scope="module")
def ending_target(tiny_chat_target, tmp_path_factory):
    """The tiny chat target, made to end its turn (<eos>, id 1) where it would have said w66: replies of every
    length, and second turns to regenerate."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("ending") / "model"
    shutil.copytree(tiny_chat_target, out)
    weights = load_file(str(out / "model.safetensors"))
    weights["lm_head.weight"][1] = 1.5 * weights["lm_head.weight"][66]
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


class Faults:
    """What the server is told to do beside serving, and the first user turn of every request it answered."""
    def __init__(self):
        self.fail_after: int | None = None  # answer this many chat requests, then 503 every one
        self.hold_after: int | None = None  # answer this many, then hold each later one until let through
        self.let_through = self.held = 0  # how many held requests may go on; how many were held
        self.throttle = 0  # refuse the next this many with 429
        self.answered: list[str] = []
        self.seen = self.in_flight = 0

    def settle(self) -> None:
        """Wait until the server has answered what a failed pass left in flight."""
        deadline = time.monotonic() + 30
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not self.in_flight


@pytest.fixture(scope="module")
def server(ending_target, tmp_path_factory):
    served = served_ngram(tmp_path_factory.mktemp("served"), ending_target, max_batch=2, max_queue=8)
    app, faults = build_app(served, MODEL, api_key=KEY), Faults()

    @app.middleware("http")
    async def inject(request, call_next):
        if request.url.path != "/v1/chat/completions":
            return await call_next(request)
        faults.seen += 1
        if faults.throttle:
            faults.throttle -= 1
            return JSONResponse({"error": {"message": "busy", "type": "rate_limit"}}, status_code=429,
                                headers={"retry-after-ms": "10"})
        if faults.fail_after is not None and len(faults.answered) >= faults.fail_after:
            return JSONResponse({"error": {"message": "injected outage", "type": "server_error"}}, status_code=503)
        first_user = json.loads(await request.body())["messages"][0]["content"]
        faults.in_flight += 1
        try:
            if faults.hold_after is not None and len(faults.answered) >= faults.hold_after:
                ticket, faults.held = faults.held, faults.held + 1
                while faults.hold_after is not None and ticket >= faults.let_through:
                    await asyncio.sleep(0.02)
            response = await call_next(request)
        finally:
            faults.in_flight -= 1
        if response.status_code == 200:
            faults.answered.append(first_user)
        return response

    with running(app) as url:
        yield url, faults


def conversations() -> list[list[dict]]:
    """Two-turn chats of the tiny vocabulary, each opening with its own user turn; every third opens mid-chat."""
    out = []
    for i in range(9):
        first = " ".join(f"w{4 + (i * 7 + j * 5) % 92}" for j in range(3 + i % 4))
        turns = [{"role": "user", "content": f"w{90 - i} {first}"}, {"role": "assistant", "content": "w5 w5"},
                 {"role": "user", "content": f"w{10 + i} w{20 + i}"}, {"role": "assistant", "content": "w6"}]
        out.append(([{"role": "assistant", "content": "w7"}] if i % 3 == 0 else []) + turns)
    return out


def config(tmp_path, target, source, url, *extra):
    return load_config(None, [f"run.dir={tmp_path / 'runs'}", f"target={target}", f"data.source={source}",
                              "data.val_fraction=0.3",
                              "data.min_assistant_tokens=1", f"data.max_length={MAX_LENGTH}",
                              f"data.regen_max_new_tokens={NEW_TOKENS}", f"data.regen_url={url}/v1",
                              "data.regen_concurrency=3", *extra])


def expected_rows(url: str, tokenizer, chats: list[list[dict]]) -> tuple[list[list[int]], Counter]:
    """The oracle: each chat's turns asked in order with the openai client, the last reply's text re-tokenised
    after its templated prompt (+ <eos> when the server stopped); and the requests each chat takes."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    rows, asked = [], Counter()
    for chat in chats:
        turns = [dict(t) for t in chat[1 if chat[0]["role"] == "assistant" else 0:]]
        row = None
        for k in (1, 3):
            prompt = tokenizer.apply_chat_template(turns[:k], add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
            if len(prompt) >= MAX_LENGTH - 1:
                break
            reply = client.chat.completions.create(model=MODEL, messages=turns[:k], temperature=0,
                                                   max_tokens=min(NEW_TOKENS, MAX_LENGTH - len(prompt))).choices[0]
            asked[turns[0]["content"]] += 1
            stopped = reply.finish_reason == "stop"
            row = prompt + tokenizer(reply.message.content).input_ids + [1] * stopped
            turns[k] = {"role": "assistant", "content": reply.message.content}
            if not stopped:
                break
        rows.append(row)
    return rows, asked


def rows_of(path) -> list[list[int]]:
    ts = TokenizedSet.load(path)
    return [ts.row(i)[0].tolist() for i in range(len(ts))]


def test_an_interrupted_pass_resumes_and_its_rows_are_the_servers_replies(tmp_path, server, ending_target,
                                                                          monkeypatch):
    from transformers import AutoTokenizer

    url, faults = server
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations()))
    splits = split_conversations(conversations(), 0.3)
    assert splits["train"] and splits["val"]
    monkeypatch.setenv("DRAFTSMITH_REGEN_API_KEY", KEY)
    store = RunStore(tmp_path / "runs", "r")

    faults.fail_after = 4  # the server goes down after four answers: the pass stops with one line
    cfg = config(tmp_path, ending_target, source, url, "data.regen_retries=0", "data.cache_hidden=true")
    with pytest.raises(DraftsmithError, match=r"/v1: HTTP 503, with retries off: injected outage; finished "
                                              r"conversations are kept, a rerun continues from them$") as e:
        run_stage_on(store, "prepare", cfg, ending_target, run_prepare)
    assert "\n" not in str(e.value)
    work = next((tmp_path / "runs/r").glob(".prepare-work-*")) / "train"
    done = done_keys(work)
    assert 0 < len(done) < len(splits["train"])
    kept = {c[-4]["content"] for i, c in enumerate(splits["train"]) if i in done}

    faults.settle()
    faults.fail_after, faults.throttle, first, seen = None, 2, len(faults.answered), faults.seen
    cfg = config(tmp_path, ending_target, source, url, "data.regen_retries=2", "data.cache_hidden=true")
    rec = run_stage_on(store, "prepare", cfg, ending_target, run_prepare)
    assert rec["status"] == "completed" and "regenerated through http://127.0.0.1" in rec["message"]
    resumed = Counter(faults.answered[first:])
    assert faults.seen - seen == sum(resumed.values()) + 2  # two 429s, retried; nothing else refused
    tokenizer = AutoTokenizer.from_pretrained(ending_target)
    out = tmp_path / "runs/r/prepare"
    for split in ("train", "val"):
        rows, asked = expected_rows(url, tokenizer, splits[split])
        assert rows_of(out / f"{split}.safetensors") == rows
        for chat, n in asked.items():  # finished chats are not asked again; the others exactly as often as needed
            assert resumed[chat] == (0 if chat in kept else n), chat
        assert load_features(out, split, sum(map(len, rows))) is not None  # computed locally over these ids
    stops = [row[-1] == 1 for split in ("train", "val") for row in rows_of(out / f"{split}.safetensors")]
    assert any(stops) and not all(stops)  # both kinds of endings are covered
    assert not list((tmp_path / "runs/r").glob(".prepare-work*"))


def test_a_prepare_killed_mid_pass_resumes_from_what_it_wrote(tmp_path, server, ending_target):
    """kill -9 of `pipeline run --stage prepare` while it regenerates through the server: the rerun asks only for
    the conversations not yet written, and its rows are the server's replies."""
    from transformers import AutoTokenizer

    url, faults = server
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations()))
    splits = split_conversations(conversations(), 0.3)
    overrides = [f"run.dir={tmp_path / 'runs'}", f"target={ending_target}", f"data.source={source}",
                 "data.val_fraction=0.3", "data.min_assistant_tokens=1", f"data.max_length={MAX_LENGTH}",
                 f"data.regen_max_new_tokens={NEW_TOKENS}", f"data.regen_url={url}/v1", "data.regen_concurrency=3",
                 "data.cache_hidden=false"]
    argv = [sys.executable, "-m", "pipeline.cli", "run", "--stage", "prepare", "--run-id", "r", *overrides]
    env = {**os.environ, "DRAFTSMITH_REGEN_API_KEY": KEY}

    # Held requests cannot finish, so the kill lands mid-pass however slow the host; one is let through per
    # flush interval until a flush has written a conversation.
    faults.hold_after, answered = len(faults.answered) + 4, len(faults.answered)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, work, let_at = time.monotonic() + 300, None, time.monotonic()
    while proc.poll() is None and time.monotonic() < deadline:
        work = next((tmp_path / "runs/r").glob(".prepare-work-*"), None)
        if work is not None and (work / "train").is_dir() and done_keys(work / "train"):
            break
        if faults.held > faults.let_through and time.monotonic() - let_at > FLUSH_S + 1:
            faults.let_through, let_at = faults.let_through + 1, time.monotonic()
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL  # killed mid-pass, not finished
    faults.hold_after = None  # the killed pass's held requests finish; settle waits for them
    faults.settle()
    done = done_keys(work / "train")
    assert 0 < len(done) < len(splits["train"]) and len(faults.answered) > answered
    kept = {c[-4]["content"] for i, c in enumerate(splits["train"]) if i in done}

    first = len(faults.answered)
    rerun = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    resumed = Counter(faults.answered[first:])
    tokenizer = AutoTokenizer.from_pretrained(ending_target)
    rows, asked = expected_rows(url, tokenizer, splits["train"])
    assert rows_of(tmp_path / "runs/r/prepare/train.safetensors") == rows
    for chat, n in asked.items():
        assert resumed[chat] == (0 if chat in kept else n), chat
    assert not list((tmp_path / "runs/r").glob(".prepare-work*"))


def test_a_bad_url_or_config_is_one_line(tmp_path, server, ending_target, capsys):
    from pipeline.bench.load import free_port
    from pipeline.cli import main

    url, _ = server
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations()))
    store = RunStore(tmp_path / "runs", "r")
    # nothing listens on that port: one line naming the URL, after the retries (the CLI prints it, exit 2)
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = config(tmp_path, ending_target, source, dead, "data.regen_retries=1", "data.cache_hidden=false")
    with pytest.raises(DraftsmithError, match=rf"^prepare: data.regen_url {dead}/v1: unreachable, after 1 retries "
                                              r"\(All connection attempts failed\); finished conversations") as e:
        run_stage_on(store, "prepare", cfg, ending_target, run_prepare)
    assert "\n" not in str(e.value)
    with pytest.raises(DraftsmithError, match="data.regenerate is false"):
        cfg = config(tmp_path, ending_target, source, url, "data.regenerate=false")
        run_stage_on(store, "prepare", cfg, ending_target, run_prepare)
    assert main(["config", "data.regen_url=127.0.0.1:8000"]) == 2
    assert "data.regen_url: Value error, expected an http:// or https:// base URL" in capsys.readouterr().err


def test_a_missing_api_key_is_one_line(tmp_path, server, ending_target, monkeypatch):
    url, _ = server
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations()))
    monkeypatch.delenv("DRAFTSMITH_REGEN_API_KEY", raising=False)
    cfg = config(tmp_path, ending_target, source, url, "data.cache_hidden=false")
    with pytest.raises(DraftsmithError, match=r"/v1: HTTP 401: a valid API key is required") as e:
        run_stage_on(RunStore(tmp_path / "runs", "k"), "prepare", cfg, ending_target, run_prepare)
    assert "\n" not in str(e.value)


def test_settings_that_only_pace_requests_leave_the_digest_alone(tmp_path):
    """Lowering the concurrency after 429s neither reruns a finished prepare nor loses a killed one's work dir."""
    from pipeline.stages import get_stage, inputs_digest

    def digest(*overrides):
        cfg = load_config(None, ["data.regen_url=http://127.0.0.1:9/v1", "data.cache_hidden=false", *overrides])
        return inputs_digest(get_stage("prepare"), cfg, RunStore(tmp_path, "r"))

    assert digest() == digest("data.regen_concurrency=2", "data.regen_retries=0", "data.regen_timeout_s=5",
                              "data.regen_api_key_env=OTHER")
    assert len({digest(), digest("data.regen_model=m"), digest("data.regen_url=http://127.0.0.1:8/v1")}) == 3
