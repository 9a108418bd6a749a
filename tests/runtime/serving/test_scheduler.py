"""The scheduler that owns a batched engine: concurrent callers each get their own answers; a full queue, a timeout
and a failing step are answered at once and the scheduler keeps serving."""
import threading
import time

import pytest
from support.helpers import run_concurrently

from runtime.drafters.ngram import NgramDrafter
from runtime.serving.batch_engine import BatchEngine, BatchRequest
from runtime.serving.scheduler import QueueFull, RequestTimedOut, Scheduler, SchedulerError
from runtime.speculation.engine import Engine, EngineConfig
from runtime.target.loading import from_pretrained

PROMPTS = [[5, 17, 33, 5, 17, 42, 8], [1, 2, 3, 4, 5, 6], [9, 9, 8, 7], [40, 41, 40, 41, 40], [3], [7, 70, 7, 12]]


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return from_pretrained(tiny_llama_dir, max_seq_len=128)


def batch1(target, prompt, n):
    return Engine(target, None, EngineConfig(max_seq_len=128)).generate(prompt, n).tokens


def scheduler(target, max_batch=2, max_queue=4, timeout_s=60.0):
    engine = BatchEngine(target, lambda: NgramDrafter(target.config.vocab_size), EngineConfig(max_seq_len=100),
                         max_batch)
    return Scheduler(engine, max_queue, timeout_s)


def test_concurrent_callers_get_their_own_answers(target):
    s = scheduler(target, max_batch=3, max_queue=8)

    def call(i):
        rows = [BatchRequest(None, PROMPTS[(i + j) % 6], 10 + 3 * i + j) for j in range(1 + i % 2)]
        return [g.tokens for g in s.generate(rows)]

    answers, errors = run_concurrently(call, 6, timeout_s=300)
    assert not errors and len(answers) == 6
    for i in range(6):
        assert answers[i] == [batch1(target, PROMPTS[(i + j) % 6], 10 + 3 * i + j) for j in range(1 + i % 2)]
    assert s.rows_in_flight == 0


def test_a_full_queue_is_refused_at_once_and_the_rest_are_answered(target):
    s = scheduler(target, max_batch=1, max_queue=1)
    first = threading.Thread(target=lambda: s.generate([BatchRequest(None, PROMPTS[0], 60)]))
    first.start()
    while s.rows_in_flight < 1:
        time.sleep(0.01)
    start = time.monotonic()
    with pytest.raises(QueueFull, match="server busy: 1 rows running or queued, at most 2"):
        s.generate([BatchRequest(None, PROMPTS[1], 5), BatchRequest(None, PROMPTS[2], 5)])
    assert time.monotonic() - start < 5  # refused, not queued
    with pytest.raises(QueueFull, match="a request of 3 rows can never fit"):
        s.generate([BatchRequest(None, PROMPTS[1], 5)] * 3)
    assert [g.tokens for g in s.generate([BatchRequest(None, PROMPTS[1], 5)])] == [batch1(target, PROMPTS[1], 5)]
    first.join(timeout=300)
    assert s.rows_in_flight == 0


def test_a_timed_out_request_is_answered_and_leaves_the_batch(target):
    s = scheduler(target, max_batch=2, max_queue=2, timeout_s=0.5)
    slow, steps = s.engine.step, []

    def crawl():  # every step takes 0.2 s: a long request cannot finish in time
        time.sleep(0.2)
        steps.append(1)
        return slow()

    s.engine.step = crawl
    with pytest.raises(RequestTimedOut, match="timed out after 0.5 s: 1 of its 1 rows unfinished"):
        s.generate([BatchRequest(None, PROMPTS[0], 90)])
    at_timeout = len(steps)
    deadline = time.monotonic() + 60
    while s.rows_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.rows_in_flight == 0 and s.engine.running == 0
    assert len(steps) - at_timeout <= 2  # its row was dropped (the step under way ends), not run to the end
    s.engine.step, s.timeout_s = slow, 60.0
    assert [g.tokens for g in s.generate([BatchRequest(None, PROMPTS[2], 6)])] == [batch1(target, PROMPTS[2], 6)]


def test_a_failing_step_answers_everyone_with_its_error_and_serving_goes_on(target):
    s = scheduler(target)
    step = s.engine.step

    def fail():
        raise RuntimeError("boom")

    s.engine.step = fail
    with pytest.raises(SchedulerError, match="generation failed: RuntimeError: boom"):
        s.generate([BatchRequest(None, PROMPTS[0], 8), BatchRequest(None, PROMPTS[1], 8)])
    assert s.rows_in_flight == 0 and not s.engine.busy
    s.engine.step = step
    assert [g.tokens for g in s.generate([BatchRequest(None, PROMPTS[3], 7)])] == [batch1(target, PROMPTS[3], 7)]
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        s.generate([BatchRequest(None, PROMPTS[3], 0)])
    with pytest.raises(ValueError, match="max_queue=-1"):
        Scheduler(s.engine, -1, 1.0)
