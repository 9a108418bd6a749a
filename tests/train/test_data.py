"""prepare's data: the training/validation split (train.data.is_validation, split_conversations) and the assistant loss
masks (tokenize_conversation)."""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest

from train.data import is_validation, split_conversations, tokenize_conversation

N = 3000
FRACTION = 0.1


def conversations(n: int = N) -> list[list[dict]]:
    return [[{"role": "user", "content": f"question {i}: what is {i} times {i % 7}?"},
             {"role": "assistant", "content": f"{i} times {i % 7} is {i * (i % 7)}."}] for i in range(n)]


def key(turns: list[dict]) -> str:
    return turns[0]["content"]


def val_keys(convs: list[list[dict]], fraction: float = FRACTION) -> list[str]:
    return [key(t) for t in split_conversations(convs, fraction)["val"]]


def test_the_split_is_disjoint_complete_and_near_the_fraction():
    convs = conversations()
    splits = split_conversations(convs, FRACTION)
    train, val = {key(t) for t in splits["train"]}, {key(t) for t in splits["val"]}
    assert not train & val and train | val == {key(t) for t in convs}
    assert len(splits["train"]) + len(splits["val"]) == N  # each conversation once
    # within 4.5 standard deviations of a binomial draw
    assert abs(len(val) / N - FRACTION) < 4.5 * math.sqrt(FRACTION * (1 - FRACTION) / N), len(val)


def test_the_split_does_not_depend_on_record_order():
    convs = conversations()
    shuffled = convs[:]
    random.Random(0).shuffle(shuffled)
    assert sorted(val_keys(shuffled)) == sorted(val_keys(convs))
    order = {key(t): i for i, t in enumerate(shuffled)}
    assert [order[k] for k in val_keys(shuffled)] == sorted(order[k] for k in val_keys(shuffled))  # input order kept


def test_a_larger_fraction_only_adds_validation_conversations():
    convs = conversations()
    assert set(val_keys(convs, 0.05)) < set(val_keys(convs, FRACTION))


def test_the_split_is_the_same_in_another_process():
    """A content hash, not Python's per-process salted hash(): another run puts every conversation on the same side."""
    code = ("import json, sys; sys.path.insert(0, %r); from test_data import conversations, val_keys; "
            "print(json.dumps(val_keys(conversations())))") % os.path.dirname(__file__)
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == val_keys(conversations())


def test_the_side_of_a_conversation_is_pinned():
    """The split is part of a run's data: a change of hash or threshold would move conversations between runs."""
    convs = conversations(40)
    assert [i for i, t in enumerate(convs) if is_validation(t, 0.25)] == [12, 14, 16, 22, 23, 26, 38]


def mask_runs(ids: list[int], mask: list[int]) -> tuple[list[list[int]], list[int]]:
    """The runs of consecutive masked ids, and the unmasked ids."""
    runs, outside = [], []
    for i, (t, m) in enumerate(zip(ids, mask)):
        if not m:
            outside.append(t)
        elif i and mask[i - 1]:
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs, outside


CHAT = [{"role": "user", "content": "w10 w11 w12"}, {"role": "assistant", "content": "w50 w51"},
        {"role": "user", "content": "w13"}, {"role": "assistant", "content": "w52 w53 w54"}]


def test_exactly_the_assistant_tokens_are_masked(tiny_chat_target):
    """A word-level tokenizer with a chat template (tests/conftest.py): assistant words are w50 and up."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_target)
    ids, mask = tokenize_conversation(tok, CHAT, max_length=64)
    words = tok.convert_ids_to_tokens(ids)
    assert "<assistant>" in words and "<user>" in words
    assert mask == [int(w.startswith("w5")) for w in words]
    short, short_mask = tokenize_conversation(tok, CHAT, max_length=7)  # truncated: the same mask, cut
    assert short == ids[:7] and short_mask == mask[:7]


@pytest.mark.slow
def test_exactly_the_assistant_turns_are_masked_in_smollm2s_template(smollm2_dir):
    """Each masked run is one reply and its end of turn (what the template adds past the generation prompt), and
    everything else is the template without the replies."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    turns = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4.\nSure!"},
             {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": " Six, of course"}]
    ids, mask = tokenize_conversation(tok, turns, max_length=512)
    text = tok.apply_chat_template(turns, tokenize=False)
    assert tok.decode(ids) == text
    runs, outside = mask_runs(ids, mask)
    replies = [t["content"] + "<|im_end|>\n" for t in turns if t["role"] == "assistant"]
    assert [tok.decode(r) for r in runs] == replies
    for reply in replies:
        text = text.replace(reply, "", 1)
    assert tok.decode(outside) == text
