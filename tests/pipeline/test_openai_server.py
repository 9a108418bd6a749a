"""The OpenAI-compatible server, driven by the real `openai` client over HTTP on 127.0.0.1: replies equal the
target's own greedy decoding, streamed or whole; bad input, a full queue, a timeout and a missing API key get
OpenAI-shaped errors with their HTTP codes; a client that leaves mid-stream frees its rows and others are served."""
from __future__ import annotations

import time

import httpx
import openai
import pytest
from pipeline.bench.openai_stream import running, served_ngram

from pipeline.serving.api_server import build_app
from runtime.serving.batch_engine import BatchRequest

MODEL, KEY = "draftsmith-drafter", "sk-test"
CHAT = [{"role": "user", "content": "w5 w6 w7 w5 w6 w7 w5 w6"}]


@pytest.fixture(scope="module")
def served(tiny_chat_target, tmp_path_factory):
    return served_ngram(tmp_path_factory.mktemp("served"), tiny_chat_target, max_batch=2, max_queue=2)


@pytest.fixture(scope="module")
def server(served):
    with running(build_app(served, MODEL, api_key=KEY)) as url:
        yield url


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def greedy(served, ids: list[int], n: int) -> str:
    """The target alone, greedy, batch 1: what every temperature-0 reply must say."""
    from runtime.speculation.engine import Engine, EngineConfig

    engine = Engine(served.engine.target, None, EngineConfig(max_seq_len=served.max_seq_len))
    return served.tokenizer.decode(engine.generate(ids, n, stop_ids=served.stop_ids).tokens, skip_special_tokens=True)


def streamed(stream, chat: bool) -> tuple[list[str], str | None]:
    pieces, finish = [], None
    for chunk in stream:
        choice = chunk.choices[0]
        text = choice.delta.content if chat else choice.text
        if text:
            pieces.append(text)
        finish = choice.finish_reason or finish
    return pieces, finish


def test_replies_equal_greedy_decoding_streamed_or_whole(server, served):
    c = client(server)
    whole = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    ids = served.chat_ids(CHAT[0]["content"])
    expected = greedy(served, ids, 24)
    assert whole.choices[0].message.content == expected and len(set(expected.split())) > 3
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == 24
    assert whole.choices[0].finish_reason == "length" and whole.model == MODEL
    pieces, finish = streamed(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                                        stream=True, seed=3), chat=True)
    assert "".join(pieces) == expected and finish == "length"
    assert len(pieces) > 4  # token by token as verifies commit, not one piece at the end

    prompt = "w9 w8 w9 w8 w30"  # a completion is the raw text, no chat template
    text = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    assert text == greedy(served, served.tokenizer(prompt).input_ids, 16)
    pieces, _ = streamed(c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                              stream=True), chat=False)
    assert "".join(pieces) == text

    stop = expected.split()[5]  # its first appearance ends the reply, streamed or not
    cut = expected[:expected.index(stop)]
    whole = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0, stop=[stop, "zz"])
    assert whole.choices[0].message.content == cut and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens < 24  # its rows stopped there, not at max_tokens
    pieces, finish = streamed(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                                        stop=stop, stream=True), chat=True)
    assert "".join(pieces) == cut and finish == "stop"

    sampled = [c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0.9, top_p=0.9,
                                         seed=11).choices[0].message.content for _ in range(2)]
    pieces, _ = streamed(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0.9,
                                                   top_p=0.9, seed=11, stream=True), chat=True)
    assert sampled[0] == sampled[1] == "".join(pieces) != expected[:len(sampled[0])]
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_bad_input_gets_an_openai_error_and_serving_goes_on(server, served):
    c = client(server)
    too_long = " ".join(["w7"] * (served.max_seq_len + 4))
    cases = [(dict(model="gpt-4"), "model 'gpt-4' is not served here"),
             (dict(max_tokens=-3), "max_tokens: Input should be greater than or equal to 1"),
             (dict(max_tokens=10**9), "max_new_tokens=1000000000 does not fit the served context of max_seq_len=256"),
             (dict(messages=[{"role": "user", "content": too_long}]), f"prompt of {served.max_seq_len + 6} tokens"),
             (dict(messages=[]), "messages: List should have at least 1 item"),
             (dict(n=2), "n: Input should be 1"), (dict(temperature=-1), "temperature: Input should be greater")]
    for overrides, message in cases:
        with pytest.raises(openai.BadRequestError, match=message) as refused:
            c.chat.completions.create(**(dict(model=MODEL, messages=CHAT, max_tokens=4) | overrides))
        assert refused.value.status_code == 400 and refused.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="prompt token ids must lie in 0..95"):
        c.completions.create(model=MODEL, prompt=[5, 500], max_tokens=2)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    broken = httpx.post(f"{server}/v1/chat/completions", content=b'{"model": "x", "messages": [', headers=headers)
    assert broken.status_code == 400 and broken.json()["error"]["message"] == "the request body is not valid JSON"
    with pytest.raises(openai.AuthenticationError, match="a valid API key is required") as refused:
        client(server, "wrong").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert refused.value.status_code == 401
    keyless = httpx.post(f"{server}/v1/chat/completions", json={"model": MODEL, "messages": CHAT})
    assert keyless.status_code == 401 and keyless.json()["error"]["code"] == "invalid_api_key"
    missing = httpx.get(f"{server}/v1/nothing", headers=headers)
    assert missing.status_code == 404 and "error" in missing.json()
    assert c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0).usage.completion_tokens


def until(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


@pytest.fixture
def slow_steps(monkeypatch):
    """Slows the given engine's steps: a long reply is still running while the test does its part."""
    def slow(engine, seconds: float = 0.05):
        step = engine.step

        def crawl():
            time.sleep(seconds)
            return step()
        monkeypatch.setattr(engine, "step", crawl)
    return slow


def test_a_full_queue_is_429_and_a_timeout_504(tiny_chat_target, tmp_path, slow_steps):
    served = served_ngram(tmp_path, tiny_chat_target, max_batch=1, max_queue=0, timeout_s=2.0)
    slow_steps(served.engine, 0.5)  # in 2 s a reply reaches 5 steps: 21 tokens at most, no end of turn among them
    with running(build_app(served, MODEL)) as url:
        c = client(url, "none")
        stream = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=200, temperature=0, stream=True)
        next(iter(stream))  # it holds the only row
        with pytest.raises(openai.RateLimitError, match="server busy: 1 rows running or queued, at most 1"):
            c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
        with pytest.raises(openai.APIError, match="request timed out after 2 s"):
            list(stream)  # past its 2 s: the stream ends with the timeout as an error event
        assert until(lambda: served.scheduler.rows_in_flight == 0)  # its row left at the next step
        with pytest.raises(openai.APIStatusError, match="request timed out after 2 s") as late:
            c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=200)
        assert late.value.status_code == 504
        metrics = httpx.get(f"{url}/metrics").text
    assert 'draftsmith_requests_total{endpoint="/v1/chat/completions",status="429"} 1.0' in metrics
    assert 'draftsmith_requests_total{endpoint="/v1/chat/completions",status="504"} 2.0' in metrics


def test_a_client_leaving_mid_stream_frees_its_rows_and_others_are_served(tiny_chat_target, tmp_path, slow_steps):
    served = served_ngram(tmp_path, tiny_chat_target, max_batch=2, max_queue=0)
    slow_steps(served.engine, 0.1)
    with running(build_app(served, MODEL)) as url:
        c = client(url, "none")
        stream = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=220, temperature=0, stream=True)
        chunks = iter(stream)
        next(chunks), next(chunks)
        stream.close()
        steps = served.engine.counters.steps
        assert until(lambda: served.scheduler.rows_in_flight == 0 and served.engine.running == 0)
        after_close = served.engine.counters.steps - steps
        whole = served.scheduler.generate([BatchRequest(None, served.chat_ids(CHAT[0]["content"]), 220,
                                                        stop_ids=served.stop_ids)])[0]
        assert after_close < whole.metrics.target_forwards // 2  # dropped, not run to its end
        reply = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
        assert reply.choices[0].message.content == greedy(served, served.chat_ids(CHAT[0]["content"]), 8)
        gone = 'draftsmith_requests_total{endpoint="/v1/chat/completions",status="499"} 1.0'
        assert until(lambda: gone in httpx.get(f"{url}/metrics").text)


def test_pipeline_serve_openai_serves_the_registered_champion(tmp_path, tiny_chat_target):
    """`pipeline serve --openai` loads models:/NAME@champion through the pyfunc's path (hashes, target fingerprint),
    on 127.0.0.1, the API key from $DRAFTSMITH_API_KEY, the validated tau from the version's tags."""
    import os
    import subprocess
    import sys

    from support.mlflow_server import run_stage, validated_run

    from pipeline.bench.load import free_port, stop, wait_healthy
    from pipeline.cli import main
    from pipeline.config import load_config
    from pipeline.sources import target_fingerprint
    from pipeline.stages.register import run_promote, run_register

    overrides = [f"run.dir={tmp_path / 'runs'}", f"target={tiny_chat_target}",
                 f"register.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    cfg = load_config(None, overrides)
    store = validated_run(cfg, "r1", 1.5, target_fingerprint=target_fingerprint(tiny_chat_target))
    run_stage(cfg, store, "register", run_register)
    assert run_stage(cfg, store, "promote", run_promote)["metrics"]["promoted"]
    assert main(["serve", "--api-key", "k", *overrides]) == 2  # the key guards only the OpenAI server
    port, log = free_port(), tmp_path / "serve.log"
    env = {**os.environ, "DRAFTSMITH_API_KEY": KEY, "DRAFTSMITH_MAX_BATCH": "2", "DRAFTSMITH_BATCH_POLICY": "fixed"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "--openai", "--port", str(port),
                                 *overrides], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, log, timeout_s=300)
        url = f"http://127.0.0.1:{port}"
        reply = client(url).chat.completions.create(model=cfg.register.model_name, messages=CHAT, max_tokens=12,
                                                    temperature=0)
        assert reply.usage.completion_tokens == 12 and reply.choices[0].message.content.startswith("w")
        metrics = httpx.get(f"{url}/metrics").text
        assert "draftsmith_spec_decode_validated_tau 2.0" in metrics  # validated_run's tau, from the tags
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").models.list()
    finally:
        stop(proc)
