"""Self-distillation data: every assistant turn rewritten by the target itself, and the target's hidden states.

A drafter is judged by how often it guesses what the *target* says, so it should train on the target's answers,
not on whatever model wrote the dataset. Turns are regenerated in order: the answer to turn k is generated from
the conversation with turns < k already regenerated, and the next user turn follows it. A conversation ends at
its last assistant turn, at an answer cut by the length budget, or when the next prompt leaves no room.

Work is continuous-batched on the target (train.batch_generate) and written to resumable shards
(train.shards): a killed prepare is rerun and continues where it stopped.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from runtime.speculation.sampling import SamplingParams
from runtime.target.model import Taps, Transformer
from train.batch_generate import BatchGenerator, Completion, Request
from train.data import TokenizedSet, tokenize_prompt
from train.shards import Row, ShardWriter, done_keys, feature_bytes


@dataclass(frozen=True)
class RegenSettings:
    max_length: int  # prompt + answer tokens per row
    max_new_tokens: int  # per answer
    min_assistant_tokens: int
    batch_size: int
    params: SamplingParams
    keep_hidden: bool  # also store the target's features (the offline cache)
    streams: tuple[int, ...] = ()  # and the residual streams entering these layers (ForwardOutput.with_streams)
    seed: int = 0
    shard_rows: int = 64  # finished conversations per resumable shard


@dataclass
class _Conversation:
    key: int
    turns: list[dict]  # assistant turns before `answering` are already the target's
    answering: int = -1  # index of the assistant turn being generated
    prompt_mask: list[int] | None = None
    row: Row | None = None  # prompt + the latest finished answer


def opening_at_user(turns: list[dict]) -> list[dict]:
    """A copy without leading assistant turns: scraped fragments often open mid-conversation, and an answer
    to nothing would only lengthen every prompt."""
    first = next((i for i, t in enumerate(turns) if t["role"] != "assistant"), len(turns))
    return [dict(t) for t in turns[first:]]


def next_request(conv: _Conversation, tokenizer, s: RegenSettings) -> Request | None:
    """The request for the next assistant turn after `conv.answering`, or None when the conversation is done."""
    for k in range(conv.answering + 1, len(conv.turns)):
        if conv.turns[k]["role"] == "assistant":
            encoded = tokenize_prompt(tokenizer, conv.turns[:k], s.max_length - s.min_assistant_tokens)
            if encoded is None:
                return None
            conv.answering, (ids, conv.prompt_mask) = k, encoded
            # a later turn extends the last answer's row: the generator reuses its KV cache for the shared prefix
            return Request(conv.key, ids, min(s.max_new_tokens, s.max_length - len(ids)),
                           continues=None if conv.row is None else conv.key)
    return None


def regenerate(target: Transformer, tokenizer, conversations: list[list[dict]], work: Path, s: RegenSettings,
               stop_ids: tuple[int, ...]) -> None:
    """Regenerate `conversations` into shards under `work` (resuming a killed run); read them with merge_shards."""
    done = done_keys(work)
    todo = [_Conversation(i, opening_at_user(turns)) for i, turns in enumerate(conversations) if i not in done]
    if s.keep_hidden:
        bound = feature_bytes(len(todo) * s.max_length, target.config.dim * (1 + len(s.streams)))
        print(f"prepare: hidden-state cache for {len(todo)} conversations, at most {bound / 2**20:.0f} MiB (fp16)")
    writer = ShardWriter(work, s.shard_rows)
    gen = BatchGenerator(target, s.batch_size, s.params, stop_ids, s.keep_hidden, max_len=s.max_length,
                         generator=torch.Generator().manual_seed(s.seed), streams=s.streams)
    active: dict[int, _Conversation] = {}
    for conv in todo:
        request = next_request(conv, tokenizer, s)
        if request is None:
            writer.drop(conv.key, "no assistant turn fits")
        else:
            active[conv.key] = conv
            gen.submit(request)
    bar = tqdm(total=len(todo), initial=len(todo) - len(active), desc="prepare: regenerate", unit="conv",
               mininterval=2.0)
    new_tokens = 0
    while gen.busy:
        for c in gen.step():
            conv = active[c.key]
            new_tokens += len(c.tokens)
            if _answered(conv, c, tokenizer, s, gen):
                continue
            del active[c.key]
            if sum(conv.row.mask) >= s.min_assistant_tokens:
                writer.add(conv.row)
            else:
                writer.drop(conv.key, "too_few_assistant_tokens")
            bar.update(1)
            bar.set_postfix(tokens=new_tokens, prompt_reuse=f"{gen.reused_tokens / max(gen.prompt_tokens, 1):.0%}",
                            refresh=False)
    writer.flush()
    bar.close()


def _answered(conv: _Conversation, c: Completion, tokenizer, s: RegenSettings, gen: BatchGenerator) -> bool:
    """Record the answer; submit the next turn and return True if the conversation continues."""
    conv.row = Row(conv.key, c.prompt + c.tokens, conv.prompt_mask + [1] * len(c.tokens), c.hidden)
    text = tokenizer.decode(c.tokens, skip_special_tokens=True)
    conv.turns[conv.answering] = {"role": "assistant", "content": text}
    if not c.stopped:  # cut by the budget: a follow-up turn would answer a truncated reply
        return False
    request = next_request(conv, tokenizer, s)
    if request is None:
        return False
    gen.submit(request)
    return True


@torch.inference_mode()
def cache_features(target: Transformer, ts: TokenizedSet, work: Path, batch_size: int,
                   streams: tuple[int, ...] = ()) -> None:
    """The offline cache without regeneration: one frozen target pass over the train rows, into shards (the final
    hidden states and the residual streams entering the `streams` layers)."""
    done = done_keys(work)
    todo = [i for i in range(len(ts)) if i not in done]
    tokens = sum(ts.row(i)[0].numel() for i in todo)
    size = feature_bytes(tokens, target.config.dim * (1 + len(streams)))
    print(f"prepare: hidden-state cache for {len(todo)} rows, {size / 2**20:.0f} MiB (fp16)")
    todo.sort(key=lambda i: ts.row(i)[0].numel())  # similar lengths per batch: little padding
    writer = ShardWriter(work)
    with tqdm(total=tokens, desc="prepare: target features", unit="tok", unit_scale=True, mininterval=2.0) as bar:
        for start in range(0, len(todo), batch_size):
            rows = [ts.row(i) for i in todo[start:start + batch_size]]
            T = max(ids.numel() for ids, _ in rows)
            ids = torch.zeros(len(rows), T, dtype=torch.long)
            for b, (row_ids, _) in enumerate(rows):
                ids[b, :row_ids.numel()] = row_ids  # right padding: causal attention never sees it
            positions = torch.arange(T).expand(len(rows), T)
            hidden = target(ids.to(target.device), target.new_cache(len(rows), T), positions.to(target.device),
                            taps=Taps.entering(streams), no_logits=True).with_streams(streams)
            for b, (key, (row_ids, mask)) in enumerate(zip(todo[start:start + batch_size], rows)):
                n = row_ids.numel()
                writer.add(Row(key, row_ids.tolist(), mask.int().tolist(), hidden[b, :n].cpu()))
                bar.update(n)
    writer.flush()
