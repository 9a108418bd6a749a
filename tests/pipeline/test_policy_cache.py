"""The batch policy measured at start-up is kept per host and bundle: a second start on the same host times nothing,
a start whose key changed (batch size, threads, bundle) measures again, and a corrupt kept file is logged once and
measured over."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from pipeline.bench.openai_stream import served_ngram

from export.bundle_writer import write_bundle
from pipeline.serving import policy_cache
from pipeline.sources import target_fingerprint
from runtime.serving import budget_tuner

TREE = {"depth": 2, "width": 2, "nodes": 4, "adaptive": False, "lookup": 0, "max_tree": 0}


@pytest.fixture
def timings(monkeypatch, tmp_path):
    """Count the batched timing runs the tuner makes (each call still times), with a fresh project home."""
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    calls = []
    timed = budget_tuner.time_batch

    def counting(*args, **kwargs):
        calls.append(args[5])  # the batch size timed
        return timed(*args, **kwargs)

    monkeypatch.setattr(budget_tuner, "time_batch", counting)
    return calls


def start(tmp_path, target, max_batch=2, name="a"):
    return served_ngram(tmp_path / name, target, max_batch=max_batch, policy="measured", budget=TREE)


def kept_files():
    return sorted(policy_cache.cache_dir().glob("*.json"))


def test_a_second_start_reuses_the_measured_policy(tmp_path, tiny_chat_target, timings):
    first = start(tmp_path, tiny_chat_target)
    per_size = len(first.engine.policy.report["by_batch"][0]["options"])  # plain and each budget
    assert sorted(timings) == [1] * per_size + [2] * per_size and per_size >= 3 and len(kept_files()) == 1
    measured = len(timings)
    second = start(tmp_path, tiny_chat_target)
    assert len(timings) == measured, "a second start with the same key timed again"
    assert second.engine.policy == first.engine.policy and second.engine.policy.report == first.engine.policy.report

    start(tmp_path, tiny_chat_target, max_batch=3)  # another batch setting: measured, kept beside the first
    assert timings[measured:] and sorted(set(timings[measured:])) == [1, 2, 3] and len(kept_files()) == 2
    measured = len(timings)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        start(tmp_path, tiny_chat_target)  # another thread count
    finally:
        torch.set_num_threads(threads)
    assert len(timings) == measured + 2 * per_size and len(kept_files()) == 3
    measured = len(timings)
    write_bundle(tmp_path / "b" / "bundle", {"kind": "ngram", "max_ngram": 4}, None, data_digest="other",
                 target_fingerprint=target_fingerprint(tiny_chat_target), config={}, code_version="test")
    start(tmp_path, tiny_chat_target, name="b")  # another bundle
    assert len(timings) == measured + 2 * per_size and len(kept_files()) == 4


def test_a_corrupt_kept_policy_is_logged_and_measured_again(tmp_path, tiny_chat_target, timings, caplog):
    start(tmp_path, tiny_chat_target)
    [path] = kept_files()
    good = json.loads(path.read_text())
    for broken in ("{not json", json.dumps({"key": good["key"], "policy": {"steps": [[2, None]]}})):
        path.write_text(broken)
        before = len(timings)
        with caplog.at_level(logging.WARNING, logger="draftsmith.serving"):
            caplog.clear()
            served = start(tmp_path, tiny_chat_target)
        lines = [r.getMessage() for r in caplog.records if r.name == "draftsmith.serving"]
        assert len(lines) == 1 and str(path) in lines[0] and "measuring it again" in lines[0]
        assert len(timings) > before and served.engine.policy.steps[0][0] == 1
        assert json.loads(path.read_text())["key"] == good["key"]  # measured over and kept again
    caplog.clear()
    before = len(timings)
    start(tmp_path, tiny_chat_target)
    assert len(timings) == before and not caplog.records
