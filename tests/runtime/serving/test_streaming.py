"""Streaming out of the batched engine and its scheduler: each row's tokens are handed out as its steps commit them
and add up to its answer; a cancelled request leaves at once; the speculation counters add up to what each
generation measured."""
import threading
import time

import pytest
from support.helpers import NoisyOracle

from runtime.drafters.ngram import NgramDrafter
from runtime.serving.batch_engine import BatchEngine, BatchRequest
from runtime.serving.scheduler import Scheduler
from runtime.speculation.engine import EngineConfig
from runtime.target.loading import from_pretrained

PROMPTS = [[5, 17, 33, 5, 17, 42, 8], [1, 2, 3, 4, 5, 6], [9, 9, 8, 7], [40, 41, 40, 41, 40]]


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return from_pretrained(tiny_model_dir("llama"), max_seq_len=128)  # untied: varied answers, some drafts accepted


def engine(target, max_batch=3):
    return BatchEngine(target, lambda: NgramDrafter(target.config.vocab_size), EngineConfig(max_seq_len=100),
                       max_batch)


def test_each_rows_tokens_are_handed_out_as_they_land_and_add_up_to_its_answer(target):
    e = engine(target)
    streamed, steps_seen = {}, {}
    step = [0]

    def on_commit(key, tokens):
        streamed.setdefault(key, []).append(list(tokens))
        steps_seen.setdefault(key, []).append(step[0])

    e.on_commit = on_commit
    plain = engine(target).generate([BatchRequest(i, p, 30) for i, p in enumerate(PROMPTS)])
    stop = next(t for t in plain[0].tokens[3:] if t not in plain[0].tokens[:3])  # met part-way
    requests = [BatchRequest(i, p, 30, stop_ids=(stop,) if i == 0 else ()) for i, p in enumerate(PROMPTS)]
    for r in requests:
        e.submit(r)
    done = {}
    while e.busy:
        done.update(e.step())
        step[0] += 1
    for r in requests:
        chunks = streamed[r.key]
        assert sum(chunks, []) == done[r.key].tokens  # nothing lost, repeated or past a stop id
        assert chunks[0] == done[r.key].tokens[:1]  # the prefill's token comes alone, before any verify
        seen = steps_seen[r.key][1:]  # after the prefill's, one chunk a verify, each step its own
        assert len(chunks) > 2 and seen == sorted(set(seen))
    assert done[0].tokens[-1] == stop and len(done[0].tokens) < 30
    assert [done[i].tokens for i in range(1, 4)] == [g.tokens for g in plain[1:]]


def test_a_stop_id_inside_a_verifys_tokens_ends_the_stream_there(target):
    """An oracle drafter's chains are all accepted: each verify commits 6 tokens, the stop id is the 3rd of one."""
    prompt, cfg = PROMPTS[0], EngineConfig(max_seq_len=100, adaptive=False)
    reference = engine(target).generate([BatchRequest(0, prompt, 40)])[0].tokens
    stop = next(t for i, t in enumerate(reference) if i % 6 == 3 and t not in reference[:i])
    e = BatchEngine(target, lambda: NoisyOracle(target.config.vocab_size, prompt + reference, 1.0, 1, 0), cfg, 1)
    chunks = []
    e.on_commit = lambda key, tokens: chunks.append(list(tokens))
    answer = e.generate([BatchRequest(0, prompt, 40, stop_ids=(stop,))])[0].tokens
    assert answer == reference[:reference.index(stop) + 1] and sum(chunks, []) == answer
    assert e.counters.accepted_tokens == 5 * e.counters.drafts  # each verify committed 6 tokens
    assert chunks[0] == answer[:1] and 1 < len(chunks[-1]) < 6  # the last cut inside its verify's


def test_counters_add_up_to_what_each_generation_measured(target):
    e = engine(target)
    out = e.generate([BatchRequest(i, p, 25 + i) for i, p in enumerate(PROMPTS)])
    c = e.counters
    forwards = sum(g.metrics.target_forwards for g in out)
    assert c.draft_tokens == sum(g.metrics.draft_nodes for g in out) > 0
    assert c.drafts + c.plain_steps == forwards
    # every verify commits its accepted tokens plus one; the prefill commits the first (no stop ids here)
    assert c.accepted_tokens == sum(g.metrics.new_tokens - 1 - g.metrics.target_forwards for g in out)
    assert 0 < c.accepted_tokens < c.draft_tokens
    assert sum(c.accepted_per_pos) == c.accepted_tokens and c.accepted_per_pos == sorted(c.accepted_per_pos)[::-1]
    assert sum(c.tokens_per_verify.values()) == c.drafts
    assert sum(k * n for k, n in c.tokens_per_verify.items()) == c.drafts + c.accepted_tokens
    assert c.rolling_tau() == pytest.approx(1 + c.accepted_tokens / c.drafts)  # the window holds every draft
    assert 1 <= c.last_batch <= 3 and c.steps >= max(g.metrics.target_forwards for g in out)


def test_rolling_window_forgets_old_drafts():
    from runtime.serving.spec_counters import SpecCounters

    c = SpecCounters(window=3)
    for accepted in (4, 4, 4, 0, 0, 1):
        c.record_row(5, accepted, True)
    c.record_row(0, 0, True)
    assert (c.rolling_tau(), c.recent_drafts, c.drafts, c.plain_steps) == (pytest.approx(4 / 3), 3, 6, 1)
    assert c.accepted_per_pos == [4, 3, 3, 3]
    with pytest.raises(ValueError, match="window=0"):
        SpecCounters(window=0)


def test_a_streaming_request_gets_its_tokens_and_one_done_and_a_cancelled_one_leaves_at_once(target):
    s = Scheduler(engine(target, max_batch=2), max_queue=2, timeout_s=120.0)
    chunks, done = {0: [], 1: []}, []
    pending = s.submit([BatchRequest(None, PROMPTS[0], 20), BatchRequest(None, PROMPTS[1], 12)],
                       on_tokens=lambda i, t: chunks[i].append(t), on_done=lambda: done.append(1))
    answers = pending.result()
    assert [sum(chunks[i], []) for i in range(2)] == [g.tokens for g in answers]
    assert done == [1] and pending.done and not pending.cancel()

    slow, calls, after_cancel = s.engine.step, [], []
    cancelled = threading.Event()

    def crawl():  # slow steps, so the long request is still running when it is cancelled
        time.sleep(0.05)
        return slow()

    s.engine.step = crawl
    first = threading.Event()

    def on_tokens(i, tokens):
        calls.append(tokens)
        if cancelled.is_set():
            after_cancel.append(tokens)
        first.set()

    long = s.submit([BatchRequest(None, PROMPTS[2], 90)], on_tokens=on_tokens, on_done=lambda: done.append(2))
    assert first.wait(60)
    assert long.cancel()
    cancelled.set()
    deadline = time.monotonic() + 30
    while (s.rows_in_flight or s.engine.running) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s.rows_in_flight == 0 and s.engine.running == 0
    assert len(sum(calls, [])) < 90 and after_cancel == [] and done == [1]  # stopped early, no callback after
    s.engine.step = slow
    again = s.generate([BatchRequest(None, PROMPTS[3], 9)])  # serving goes on
    assert again[0].tokens == engine(target).generate([BatchRequest(0, PROMPTS[3], 9)])[0].tokens


def test_a_failing_callback_costs_only_its_own_stream(target):
    s = Scheduler(engine(target, max_batch=2), max_queue=2, timeout_s=120.0)
    calls = []

    def broken(i, tokens):
        calls.append(tokens)
        raise RuntimeError("a caller's bug")

    failing = s.submit([BatchRequest(None, PROMPTS[0], 15)], on_tokens=broken)
    other = s.submit([BatchRequest(None, PROMPTS[1], 15)], on_tokens=lambda i, t: None)
    alone = engine(target).generate([BatchRequest(0, PROMPTS[0], 15), BatchRequest(1, PROMPTS[1], 15)])
    assert [failing.result()[0].tokens, other.result()[0].tokens] == [g.tokens for g in alone]
    assert len(calls) == 1  # not called again after it failed
