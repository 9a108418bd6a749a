"""/metrics after real requests through the OpenAI-compatible server: the speculation counters equal what each
generation measured (a twin of the served model, run directly, drafts the same rows), latency histograms count
every reply, requests are counted by status; the drift alert fires once when acceptance stays below the validated
tau by more than the margin, and clears when it recovers."""
from __future__ import annotations

import logging

import httpx
import openai
import pytest
from pipeline.bench.openai_stream import running, served_ngram
from support.helpers import run_concurrently
from prometheus_client.parser import text_string_to_metric_families

from pipeline.errors import DraftsmithError
from pipeline.serving.api_server import build_app
from pipeline.serving.drift import DriftMonitor, DriftSettings
from runtime.serving.batch_engine import BatchRequest
from runtime.serving.spec_counters import SpecCounters

MODEL = "drafter"
PROMPTS = ["w5 w6 w7 w5 w6 w7 w5 w6", "w40 w41 w40 w41", "w9 w8 w9 w8 w9", "w60 w61 w62", "w11 w12 w13 w11 w12"]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample on /metrics by (name, sorted labels)."""
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_counters_equal_what_each_generation_measured(tiny_chat_target, tmp_path):
    served = served_ngram(tmp_path / "a", tiny_chat_target, max_batch=3, max_queue=4)
    twin = served_ngram(tmp_path / "b", tiny_chat_target, max_batch=1, max_queue=4)
    lengths = [30, 22, 26, 18, 28]
    with running(build_app(served, MODEL)) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        before = scrape(url)
        assert before[("draftsmith_spec_decode_num_drafts_total", ())] == 0

        def ask(i):
            return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[i]}],
                                             max_tokens=lengths[i], temperature=0)
        replies, errors = run_concurrently(ask, len(PROMPTS), timeout_s=300)  # batched together
        assert not errors
        m = scrape(url)
    # the same rows run one by one: drafting depends only on a row's own tokens, greedy and at a fixed budget
    generations = [twin.scheduler.generate([BatchRequest(None, twin.chat_ids(p), n, stop_ids=twin.stop_ids)])[0]
                   for p, n in zip(PROMPTS, lengths)]
    assert [g.tokens and len(g.tokens) for g in generations] == [replies[i].usage.completion_tokens for i in range(5)]
    forwards = sum(g.metrics.target_forwards for g in generations)
    drafts, draft_tokens, accepted = (m[(f"draftsmith_spec_decode_{n}_total", ())]
                                      for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    assert draft_tokens == sum(g.metrics.draft_nodes for g in generations) > 0
    assert drafts + m[("draftsmith_spec_decode_plain_steps_total", ())] == forwards
    if all(g.tokens[-1] not in twin.stop_ids for g in generations):  # no verify's tokens cut at an end of turn
        assert accepted == sum(len(g.tokens) - 1 - g.metrics.target_forwards for g in generations)
    assert 0 < accepted < draft_tokens
    per_pos = [m[("draftsmith_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(d)),))]
               for d in range(3) if ("draftsmith_spec_decode_num_accepted_tokens_per_pos_total",
                                     (("position", str(d)),)) in m]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True) and per_pos[0] <= drafts
    assert m[("draftsmith_spec_decode_tokens_per_verify_count", ())] == drafts
    assert m[("draftsmith_spec_decode_tokens_per_verify_sum", ())] == drafts + accepted
    assert m[("draftsmith_spec_decode_tokens_per_verify_bucket", (("le", "1"),))] == drafts - per_pos[0]
    assert m[("draftsmith_spec_decode_rolling_tau", ())] == pytest.approx(1 + accepted / drafts)
    assert m[("draftsmith_time_to_first_token_seconds_count", ())] == 5
    assert m[("draftsmith_time_per_output_token_seconds_count", ())] == 5
    assert m[("draftsmith_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))] == 5
    assert m[("draftsmith_queue_depth", ())] == 0 and m[("draftsmith_batch_size", ())] == 0
    assert m[("draftsmith_max_batch_size", ())] == 3 and m[("draftsmith_drift_alert", ())] == 0
    assert m[("draftsmith_engine_steps_total", ())] < forwards  # rows shared steps


def test_drift_alert_fires_once_below_the_margin_and_clears_on_recovery(caplog):
    counters = SpecCounters()
    monitor = DriftMonitor(counters, validated_tau=3.0, settings=DriftSettings(window=4, margin=0.5))
    caplog.set_level(logging.WARNING, logger="draftsmith.serving")
    for _ in range(3):
        counters.record_row(4, 1, True)  # 2 tokens a verify: below 3.0 - 0.5
    assert not monitor.check()  # the window has not filled: no verdict yet
    counters.record_row(4, 1, True)
    assert monitor.check() and monitor.check()
    counters.record_row(4, 4, True)  # one good verify: (2 * 3 + 5) / 4 = 2.75, within the margin
    assert not monitor.check()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("drift: rolling tau 2.00 over the last 4 drafted verifies is "
                                                   "below the bundle's validated tau 3.00 by more than 0.50")
    assert lines[1].startswith("drift over: rolling tau 2.75")
    assert not DriftMonitor(counters, None, DriftSettings(window=1, margin=0.0)).check()  # no validated tau
    with pytest.raises(DraftsmithError, match="drift window=0: expected an integer >= 1"):
        DriftSettings(window=0)


@pytest.mark.parametrize("name, value", [("DRAFTSMITH_DRIFT_WINDOW", "0"), ("DRAFTSMITH_DRIFT_WINDOW", "wide"),
                                         ("DRAFTSMITH_DRIFT_MARGIN", "-1"), ("DRAFTSMITH_DRIFT_MARGIN", "nan")])
def test_bad_drift_settings_are_one_line_errors_naming_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(DraftsmithError, match=f"^\\${name}='{value}': expected "):
        DriftSettings.from_env()


def test_a_drafter_that_drafts_badly_raises_the_alert_through_the_server(tiny_chat_target, tmp_path, caplog):
    """The n-gram drafter on text that rarely repeats: far below a validated tau of 3.5 (window 16, margin 0.3); a
    twin server told its validated tau is what it gets stays quiet."""
    caplog.set_level(logging.WARNING, logger="draftsmith.serving")
    results = {}
    for validated in (3.5, None):
        served = served_ngram(tmp_path / str(validated), tiny_chat_target, max_batch=2)
        if validated is None:  # what this drafter reaches on this traffic, measured above
            validated = results[3.5][1]
        app = build_app(served, MODEL, validated_tau=validated, drift=DriftSettings(window=16, margin=0.3))
        with running(app) as url:
            c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
            for p in PROMPTS[1:]:
                c.completions.create(model=MODEL, prompt=p + " w70 w20 w33", max_tokens=40, temperature=0)
            m = scrape(url)
        assert served.engine.counters.recent_drafts >= 16  # the window filled
        results[validated] = (m[("draftsmith_drift_alert", ())], m[("draftsmith_spec_decode_rolling_tau", ())])
    (alert, tau), (quiet, _) = results.values()
    assert tau < 3.5 - 0.3 and alert == 1 and quiet == 0
    assert m[("draftsmith_spec_decode_validated_tau", ())] == pytest.approx(tau)
    drift_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("drift:")]
    assert len(drift_lines) == 1 and "validated tau 3.50" in drift_lines[0]  # one line, not one per request
