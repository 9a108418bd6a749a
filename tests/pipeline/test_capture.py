"""Traffic capture into a real SQLite database through SQLAlchemy: answered requests (whole or streamed) are
recorded with their token ids, refused ones (no API key, bad input) never; the table keeps its size and age
limits; a bad database URL or limit is a one-line error."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import sqlalchemy as sa
from pipeline.bench.openai_stream import running, served_ngram

from pipeline.errors import DraftsmithError
from pipeline.serving.api_server import build_app
from pipeline.serving.capture import ROWS_ENV, TABLE, URL_ENV, CaptureSettings, Captured, TrafficCapture

MODEL, KEY = "drafter", "sk-capture"


def rows(url: str) -> list[dict]:
    with sa.create_engine(url).connect() as conn:
        return [dict(r._mapping) for r in conn.execute(sa.text(f"SELECT * FROM {TABLE} ORDER BY id"))]


def test_answered_requests_are_captured_and_refused_ones_never(tiny_chat_target, tmp_path):
    served = served_ngram(tmp_path, tiny_chat_target)
    url = f"sqlite:///{tmp_path / 'traffic.db'}"
    capture = TrafficCapture(CaptureSettings(url))
    with running(build_app(served, MODEL, api_key=KEY, capture=capture)) as base:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
        chat = [{"role": "user", "content": "w5 w6 w7 w5"}]
        whole = c.chat.completions.create(model=MODEL, messages=chat, max_tokens=10, temperature=0)
        pieces = [ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt="w9 w8 w9", max_tokens=8,
                                                                    temperature=0, stream=True)]
        keyless = httpx.post(f"{base}/v1/chat/completions",
                             json={"model": MODEL, "messages": [{"role": "user", "content": "w77 secret"}]})
        assert keyless.status_code == 401
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="other", prompt="w78 refused", max_tokens=4)
        capture.flush()
    got = rows(url)
    assert [r["endpoint"] for r in got] == ["/v1/chat/completions", "/v1/completions"]
    first, second = got
    assert json.loads(first["prompt"]) == chat and first["reply"] == whole.choices[0].message.content
    assert json.loads(first["prompt_ids"]) == served.chat_ids(chat[0]["content"])
    reply_ids = json.loads(first["reply_ids"])
    assert len(reply_ids) == whole.usage.completion_tokens and first["finish_reason"] == "length"
    assert served.tokenizer.decode(reply_ids, skip_special_tokens=True) == first["reply"]
    assert json.loads(second["prompt"]) == "w9 w8 w9" and second["reply"] == "".join(pieces)
    assert second["temperature"] == 0.0 and second["model"] == MODEL
    assert not any("w77" in r["prompt"] or "w78" in r["prompt"] for r in got)


def test_the_table_keeps_its_size_and_age_limits(tmp_path):
    url = f"sqlite:///{tmp_path / 'limits.db'}"

    def row(i: int) -> Captured:
        return Captured("/v1/completions", MODEL, f"prompt {i}", [i], f"reply {i}", [i, i], 0.0, "length")

    capture = TrafficCapture(CaptureSettings(url, max_rows=3, max_age_days=1.0))
    for i in range(1, 6):
        capture.add(row(i))
        capture.flush()  # one write each: the oldest go as new ones come
    capture.add(row(0), created=time.time() - 2 * 86400)  # the newest row, but older than a day
    capture.flush()
    assert [r["prompt"] for r in rows(url)] == [json.dumps(f"prompt {i}") for i in (3, 4, 5)]
    assert capture.dropped == 0


def test_bad_capture_settings_are_one_line_errors(tmp_path, monkeypatch):
    with pytest.raises(DraftsmithError, match="traffic capture: cannot open 'nosuchdb://x'"):
        TrafficCapture(CaptureSettings("nosuchdb://x"))
    with pytest.raises(DraftsmithError, match="capture max_rows=0: expected an integer >= 1"):
        CaptureSettings("sqlite://", max_rows=0)
    monkeypatch.setenv(ROWS_ENV, "many")
    with pytest.raises(DraftsmithError, match="DRAFTSMITH_CAPTURE_MAX_ROWS='many': expected an integer"):
        CaptureSettings.from_env()
    monkeypatch.delenv(ROWS_ENV)
    monkeypatch.delenv(URL_ENV, raising=False)
    assert CaptureSettings.from_env().url is None  # off by default
