"""Serving learns its replies: once a reply is served, drafting the same continuation proposes its tokens, so the
same request again takes fewer target forwards than it did; with learning off it takes as many. Replies stay the
target's own greedy replies either way."""
from __future__ import annotations

import torch
from pipeline.bench.openai_stream import served_ngram

from runtime.drafters.ngram import NgramDrafter
from runtime.serving.batch_engine import BatchRequest
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.sampling import SamplingParams

PROMPT = "w9 w31 w4 w17 w60 w2"
NEW_TOKENS = 32


def serve_twice(served) -> list:
    ids = served.chat_ids(PROMPT)
    return [served.scheduler.generate([BatchRequest(0, ids, NEW_TOKENS)])[0] for _ in range(2)]


def test_a_served_reply_is_drafted_for_the_next_request(tiny_chat_target, tmp_path):
    served = served_ngram(tmp_path, tiny_chat_target, max_batch=2, learn_tokens=4096)
    first, second = serve_twice(served)
    assert first.tokens == second.tokens and served.engine.replies.replies == 2
    ids, reply = served.chat_ids(PROMPT), first.tokens
    # a fresh row whose sequence ends as the prompt did, one reply token in: the reply's next tokens are proposed
    row = NgramDrafter(served.engine.target.config.vocab_size, corpus=served.engine.replies)
    row.reset(torch.tensor([0] + ids[-3:] + reply[:1]))
    assert row.propose(DraftBudget(depth=3), SamplingParams()).host_lists().tokens == reply[1:4]
    assert second.metrics.target_forwards < first.metrics.target_forwards

    plain = served_ngram(tmp_path, tiny_chat_target, max_batch=2, learn_tokens=0)
    again = serve_twice(plain)
    assert plain.engine.replies is None and [g.tokens for g in again] == [first.tokens] * 2
    assert again[1].metrics.target_forwards == again[0].metrics.target_forwards == first.metrics.target_forwards
