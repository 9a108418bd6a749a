"""Continuous-batched generation, self-distillation regeneration (resumable after a kill), the feature cache."""
import os
import subprocess
import sys

import pytest
import torch

from runtime.speculation.engine import Engine, EngineConfig
from runtime.speculation.sampling import SamplingParams
from runtime.target.loading import from_pretrained
from train.batch_generate import BatchGenerator, Request
from train.batches import Batches
from train.data import TokenizedSet
from train.recipes import eagle as eagle_recipe
from train.regenerate import RegenSettings, cache_features, regenerate
from train.shards import done_keys, load_features, merge_shards, save_features


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    hf = tiny_model_dir("llama", tie_word_embeddings=True, initializer_range=0.3)
    return from_pretrained(hf, max_seq_len=128)


def test_batch_generator_equals_one_at_a_time_decoding(target):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 9, 5, 14, 2, 7)]
    budgets = [12, 5, 16, 9, 1, 12]
    stop = (int(torch.randint(0, 96, (), generator=g)),)
    gen = BatchGenerator(target, batch_size=2, stop_ids=stop, keep_hidden=True, max_len=64)  # forces refills
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        gen.submit(Request(i, p, n))
    done = {}
    while gen.busy:
        done.update({c.key: c for c in gen.step()})
    engine = Engine(target, None, EngineConfig(max_seq_len=64))
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        c = done[i]
        assert c.tokens == engine.generate(p, n, SamplingParams(), stop_ids=stop).tokens
        assert c.stopped == (c.tokens[-1] in stop)
        full = torch.tensor([p + c.tokens])
        ref = target(full, target.new_cache(1, 64), torch.arange(full.shape[1])[None], no_logits=True).hidden[0]
        assert c.hidden.shape == ref.shape
        torch.testing.assert_close(c.hidden, ref, atol=1e-4, rtol=1e-4)


def test_batch_generator_decodes_only_its_busy_rows(target):
    """Once the queue is dry, finished rows are packed away: every step feeds exactly the answers still going, and
    the moved rows keep their history (same tokens as decoding each prompt alone)."""
    g = torch.Generator().manual_seed(3)
    budgets = [2, 9, 4, 13, 6]
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 3, 11, 7, 4)]
    gen = BatchGenerator(target, batch_size=4, max_len=64)
    fed = []
    forward = target.forward  # every step's forward, recorded by its token shape

    def recorded(tokens, *args, **kwargs):
        fed.append(tokens.shape)
        return forward(tokens, *args, **kwargs)

    target.forward = recorded
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        gen.submit(Request(i, p, n))
    done = {}
    try:
        while gen.busy:
            done.update({c.key: c for c in gen.step()})
    finally:
        del target.forward
    decode_rows = [b for b, t in fed if t == 1]  # prefills feed whole prompts (none is one token long)
    assert sum(decode_rows) == sum(budgets) - len(budgets)  # the prefill gives each answer's first token
    assert max(decode_rows) == 4 and decode_rows[-1] == 1  # the longest answer ends alone
    engine = Engine(target, None, EngineConfig(max_seq_len=64))
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        assert done[i].tokens == engine.generate(p, n, SamplingParams()).tokens


@pytest.mark.parametrize("keep_hidden", [True, False])
def test_a_continuing_request_reuses_its_rows_cache(target, keep_hidden):
    """A request that continues a finished one (the next turn) prefills only past the prefix they share, and
    generates what a fresh prefill of its whole prompt would, hidden states included."""
    g = torch.Generator().manual_seed(4)
    first = {k: torch.randint(0, 96, (n,), generator=g).tolist() for k, n in (("a", 6), ("b", 9), ("c", 4))}
    gen = BatchGenerator(target, batch_size=2, keep_hidden=keep_hidden, max_len=96)
    for k, p in first.items():
        gen.submit(Request(k, p, 8))
    done, expected_reuse = {}, 0
    while gen.busy:
        for c in gen.step():
            done[c.key] = c
            if len(c.key) == 1:  # the next turn: the answer, then new user tokens; "b" changes its last answer token
                answer = c.tokens[:-1] + [(c.tokens[-1] + 1) % 96] if c.key == "b" else c.tokens
                fed = len(c.prompt) + len(c.tokens) - (0 if keep_hidden else 1)
                expected_reuse += min(fed, len(c.prompt) + len(answer) - (c.key == "b"))
                gen.submit(Request(c.key * 2, c.prompt + answer + [5, 7, 11], 6, continues=c.key))
    assert gen.reused_tokens == expected_reuse > 0
    assert gen.prompt_tokens == sum(len(c.prompt) for c in done.values())
    engine = Engine(target, None, EngineConfig(max_seq_len=96))
    for k in ("aa", "bb", "cc"):
        c = done[k]
        assert c.tokens == engine.generate(c.prompt, 6, SamplingParams()).tokens
        if keep_hidden:
            full = torch.tensor([c.prompt + c.tokens])
            ref = target(full, target.new_cache(1, 96), torch.arange(full.shape[1])[None], no_logits=True).hidden
            torch.testing.assert_close(c.hidden, ref[0], atol=1e-4, rtol=1e-4)


def test_batch_generator_refuses_a_request_that_does_not_fit(target):
    gen = BatchGenerator(target, 2, max_len=16)
    with pytest.raises(ValueError, match="exceed the cache length 16"):
        gen.submit(Request("long", [1] * 10, 8))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.submit(Request("bad", [1, 500], 2))


def test_cached_features_give_the_same_loss_as_the_online_target(target, tmp_path):
    g = torch.Generator().manual_seed(2)
    rows = []
    for n in (12, 20, 7, 15):
        ids = torch.randint(0, 96, (n,), generator=g).tolist()
        rows.append((ids, [0] * 3 + [1] * (n - 3)))
    ts = TokenizedSet.from_rows(rows)
    cache_features(target, ts, tmp_path / "work", batch_size=3)
    merged, features, _ = merge_shards(tmp_path / "work")
    assert torch.equal(merged.input_ids, ts.input_ids) and torch.equal(merged.offsets, ts.offsets)
    save_features(features, tmp_path / "stage", "train")
    assert load_features(tmp_path / "stage", "val", ts.input_ids.numel()) is None
    features = load_features(tmp_path / "stage", "train", ts.input_ids.numel())
    assert features.dtype == torch.float16 and features.shape == (ts.input_ids.numel(), target.config.dim)
    with pytest.raises(ValueError, match="rerun prepare"):
        load_features(tmp_path / "stage", "train", ts.input_ids.numel() + 1)

    online, offline = Batches(ts, 4, seed=0), Batches(ts, 4, seed=0, features=features)
    model = eagle_recipe.build_eagle(target, None)
    loss_fn = eagle_recipe.eagle_loss(target, noise=0.0)
    with torch.no_grad():
        a, _ = loss_fn(model, online.batch_at(0))
        b, _ = loss_fn(model, offline.batch_at(0))
    assert abs(a.item() - b.item()) < 1e-2 * max(1.0, abs(a.item()))  # fp16 storage is the only difference


# ---- regeneration with a real chat template: the SmolLM2 tokenizer over a tiny random target of its vocabulary


@pytest.fixture(scope="module")
def chat_target(tiny_model_dir, smollm2_dir):
    from transformers import AutoTokenizer

    hf = tiny_model_dir("llama", vocab_size=49152, tie_word_embeddings=True, initializer_range=0.3)
    return from_pretrained(hf, max_seq_len=256), AutoTokenizer.from_pretrained(smollm2_dir)


def conversations(n: int) -> list[list[dict]]:
    out = []
    for i in range(n):
        turns = [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                 {"role": "assistant", "content": f"It is {2 * i}."},
                 {"role": "user", "content": "And times two?"},
                 {"role": "assistant", "content": f"{4 * i}."}]
        out.append(([{"role": "assistant", "content": "a fragment"}] if i % 3 == 0 else []) + turns)
    return out


SETTINGS = RegenSettings(max_length=160, max_new_tokens=12, min_assistant_tokens=4, batch_size=4,
                         params=SamplingParams(), keep_hidden=True, shard_rows=3)
STOP = tuple(range(0, 49152, 2))  # a random target rarely says <|im_end|>: every even id ends its answers

KILLED_RUN = """
import os, signal, sys, torch
from transformers import AutoTokenizer
from runtime.target.model import Transformer
from runtime.target.loading import from_pretrained
from train import shards
from train.regenerate import regenerate
sys.path.insert(0, {tests!r})
from test_regenerate import SETTINGS, STOP, conversations
flush = shards.ShardWriter.flush
def flush_then_die(self):
    flush(self)
    if self.next_index == 2:  # killed right after the second shard is on disk
        os.kill(os.getpid(), signal.SIGKILL)
shards.ShardWriter.flush = flush_then_die
regenerate(from_pretrained({model!r}, max_seq_len=256), AutoTokenizer.from_pretrained({tok!r}),
           conversations(10), __import__("pathlib").Path({work!r}), SETTINGS, STOP)
"""


@pytest.mark.slow
def test_regeneration_resumes_after_a_kill(chat_target, tiny_model_dir, smollm2_dir, tmp_path):
    target, tokenizer = chat_target
    work = tmp_path / "work"
    script = KILLED_RUN.format(tests=os.path.dirname(__file__), work=str(work), tok=str(smollm2_dir),
                               model=str(tiny_model_dir("llama", vocab_size=49152, tie_word_embeddings=True,
                                                        initializer_range=0.3)))
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    before = {p.name: p.read_bytes() for p in work.glob("shard-*.safetensors")}
    assert len(before) == 2 and 0 < len(done_keys(work)) < 10

    regenerate(target, tokenizer, conversations(10), work, SETTINGS, STOP)
    assert {p.name: p.read_bytes() for p in work.glob("shard-*.safetensors") if p.name in before} == before
    resumed, features, dropped = merge_shards(work)

    fresh_work = tmp_path / "fresh"
    regenerate(target, tokenizer, conversations(10), fresh_work, SETTINGS, STOP)
    fresh, fresh_features, _ = merge_shards(fresh_work)
    assert len(resumed) + sum(dropped.values()) == 10  # every conversation once: kept or dropped with a reason
    assert torch.equal(resumed.input_ids, fresh.input_ids) and torch.equal(resumed.loss_mask, fresh.loss_mask)
    assert features.shape == (resumed.input_ids.numel(), target.config.dim)
    torch.testing.assert_close(features, fresh_features, atol=2e-3, rtol=0)

    # both answers are the target's: the row holds the second prompt built on the regenerated first answer
    ids, mask = resumed.row(0)
    text = tokenizer.decode(ids)
    assert "a fragment" not in text and text.count("<|im_start|>assistant") == 2
    assert "It is 0." not in text and "And times two?" in text
    assert mask.sum().item() >= SETTINGS.min_assistant_tokens
