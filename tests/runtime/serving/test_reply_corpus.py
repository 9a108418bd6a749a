"""The corpus that learns served replies: a reply's continuation is drafted where its match beats the sequence's own,
the bundle's frozen corpus keeps its rule, the oldest replies leave first within the bound, and adds and lookups
from many threads leave the same corpus as one thread."""
from __future__ import annotations

import random
import sys
import threading

import pytest
import torch

from runtime.drafters.ngram import NgramDrafter
from runtime.serving.reply_corpus import ReplyCorpus
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.sampling import SamplingParams

V = 100
CHAIN = DraftBudget(depth=4)


def drafted(corpus, sequence: list[int], budget: DraftBudget = CHAIN) -> list[int]:
    d = NgramDrafter(V, corpus=corpus)
    d.reset(torch.tensor(sequence))
    return d.propose(budget, SamplingParams()).host_lists().tokens


def test_a_served_reply_is_drafted_where_its_match_is_longer():
    replies = ReplyCorpus(V, 1000, max_depth=8)
    assert drafted(replies, [1, 2, 3, 50, 51]) == []
    replies.add([1, 2, 3, 50, 51], [60, 61, 62, 63, 64, 65])  # a reply, after the prompt's last tokens
    assert replies.tokens == 4 + 6 and replies.replies == 1
    # another request's sequence ends as that prompt did: the reply follows
    assert drafted(replies, [9, 8, 50, 51]) == [60, 61, 62, 63]
    assert drafted(replies, [9, 8, 51, 60, 61]) == [62, 63, 64, 65]
    # the sequence's own match of one token ("61" -> 7) is shorter than the reply's of two: the reply wins
    assert drafted(replies, [61, 7, 8, 60, 61]) == [62, 63, 64, 65]
    # its own match is as long ("60 61" -> 7): the sequence wins
    assert drafted(replies, [60, 61, 7, 9, 60, 61]) == [7, 9, 60, 61]


def test_the_bundle_corpus_keeps_its_rule_beneath_the_replies():
    base = NgramDrafter.corpus(V, [torch.tensor([20, 21, 22, 23, 24])], max_depth=4)
    replies = ReplyCorpus(V, 1000, max_depth=4, base=base)
    assert drafted(replies, [1, 20, 21]) == [22, 23, 24]  # no reply matches: the frozen corpus
    assert drafted(replies, [21, 5, 20, 21]) == [5, 20, 21]  # the sequence has a match: frozen corpus stays out
    replies.add([20, 21], [22, 30, 31])
    assert drafted(replies, [1, 20, 21, 22]) == [30, 31]  # now a reply matches longer


def test_the_oldest_replies_leave_first_within_the_bound():
    replies = ReplyCorpus(V, 40, max_depth=4, context=0)  # two halves of 20 tokens
    spans = [[10 * k + i for i in range(8)] for k in range(1, 8)]
    for k, span in enumerate(spans):
        replies.add([], span)
        assert replies.tokens <= 40
        kept = [s for s in spans[:k + 1] if drafted(replies, [0, s[0], s[1]]) == s[2:6]]
        assert kept == spans[max(0, k + 1 - len(kept)):k + 1] and len(kept) >= min(k + 1, 2)  # the newest ones
    assert drafted(replies, [0, 10, 11]) == [] and drafted(replies, [0, 70, 71]) == [72, 73, 74, 75]


def tally(trie: NgramDrafter) -> dict[tuple[int, ...], int]:
    """Every string the trie holds with its count, whatever order its nodes were made in."""
    out, stack, seen = {}, [(0, ())], set()
    while stack:
        node, path = stack.pop()
        for child in trie._children(node):
            assert child not in seen and len(seen) < len(trie._count), "the trie's links are corrupt"
            seen.add(child)
            out[path + (trie._token[child],)] = trie._count[child]
            stack.append((child, path + (trie._token[child],)))
    return out


def paused_inside_append(after_lines: int, paused: threading.Event, resume: threading.Event):
    """A thread trace function that stops its thread once, `after_lines` lines into NgramDrafter._append, until
    `resume` is set: another thread then runs while this one is in the middle of adding a reply."""
    lines = 0

    def trace(frame, event, arg):
        nonlocal lines
        if frame.f_code is NgramDrafter._append.__code__:
            def local(frame, event, arg):
                nonlocal lines
                lines += 1
                if lines == after_lines:
                    paused.set()
                    resume.wait(30)
                return local
            return local
        return None

    return trace


def test_an_add_is_whole_while_other_threads_add_and_draft():
    rng = random.Random(0)
    first, second = ([rng.randrange(V) for _ in range(60)] for _ in range(2))
    replies = ReplyCorpus(V, 10 ** 6, max_depth=6, context=0)
    paused, resume, drafts = threading.Event(), threading.Event(), []
    trace = paused_inside_append(200, paused, resume)

    def add_first():
        sys.settrace(trace)
        try:
            replies.add([], first)
        finally:
            sys.settrace(None)

    adder = threading.Thread(target=add_first)
    adder.start()
    assert paused.wait(30)  # the first reply is half added
    others = [threading.Thread(target=replies.add, args=([], second)),
              threading.Thread(target=lambda: drafts.append(drafted(replies, first[:3])))]
    for t in others:
        t.start()
    for t in others:
        t.join(0.5)
    waited = [t.is_alive() for t in others]  # an add or lookup while another add is under way waits for it
    resume.set()
    for t in [adder] + others:
        t.join(30)
    alone = ReplyCorpus(V, 10 ** 6, max_depth=6, context=0)
    for span in (first, second):
        alone.add([], span)
    assert tally(replies._newer) == tally(alone._newer) and replies.tokens == alone.tokens == 120
    assert waited == [True, True] and len(drafts) == 1


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_tokens=0"):
        ReplyCorpus(V, 0, 4)
    with pytest.raises(ValueError, match="expected a Corpus of vocab_size 100"):
        ReplyCorpus(V, 10, 4, base=NgramDrafter(50))
