"""A lookup corpus that learns from what it serves, as suffix decoding does: each finished reply (with the last few
prompt tokens before it, so its opening matches) is added between retrainings, so a structure the traffic repeats
is drafted from the next request on, not only after the drafter is trained on it.

Replies are kept in two tries, the newer filling up to half of `max_tokens`; when it is full the older one goes
whole and the newer takes its place, so the most recent replies are kept (between half and all of `max_tokens`
tokens), the oldest going first, and memory stays bounded with no trie ever rebuilt. A continuation of replies is
proposed where its match is longer than the sequence's own (the traffic itself is better evidence than a shorter
match in the sequence), the longer match of the two tries winning, the newer on a tie; elsewhere the bundle's frozen
corpus (`base`) decides as it always has.

The batched engine adds and drafts on its own thread; a lock makes every add and lookup whole, so any other thread
may add or draft too.
"""
from __future__ import annotations

import threading

import torch

from runtime.drafters.ngram import MAX_NGRAM, Corpus, NgramDrafter
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.tree import DraftTree

MIN_MATCH = 2  # a reply continuation needs at least this many matched tokens (a frozen corpus's min_ngram)


class ReplyCorpus(Corpus):
    def __init__(self, vocab_size: int, max_tokens: int, max_depth: int, base: Corpus | None = None,
                 context: int = MAX_NGRAM):
        for name, v in (("vocab_size", vocab_size), ("max_tokens", max_tokens), ("max_depth", max_depth)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ReplyCorpus: {name}={v!r}, expected an int >= 1")
        if base is not None and (not isinstance(base, Corpus) or base.vocab_size != vocab_size):
            raise ValueError(f"ReplyCorpus: base={base!r}, expected a Corpus of vocab_size {vocab_size}")
        self.vocab_size, self.max_tokens, self.max_depth, self.base = vocab_size, max_tokens, max_depth, base
        self.context = context  # prompt tokens kept before each reply
        self._lock = threading.Lock()
        self._newer, self._older = self._trie(), None
        self._newer_tokens = self._older_tokens = 0
        self.replies = 0  # replies added, ever

    def _trie(self) -> NgramDrafter:
        return NgramDrafter.corpus(self.vocab_size, [], max_depth=self.max_depth, min_ngram=MIN_MATCH)

    @property
    def tokens(self) -> int:
        """Tokens of replies (with their context) held now."""
        with self._lock:
            return self._newer_tokens + self._older_tokens

    def add(self, prompt: list[int], reply: list[int]) -> None:
        """A served reply (and the `context` prompt tokens before it); at most half of max_tokens of it is kept."""
        span = (prompt[-self.context:] if self.context else []) + list(reply)
        span = span[: self.max_tokens // 2]
        if len(span) <= MIN_MATCH:
            return
        tokens = torch.tensor(span, dtype=torch.long)
        with self._lock:
            if self._newer_tokens + len(span) > self.max_tokens // 2 and self._newer_tokens:
                self._older, self._older_tokens = self._newer, self._newer_tokens
                self._newer, self._newer_tokens = self._trie(), 0
            self._newer.add_span(tokens)
            self._newer_tokens += len(span)
            self.replies += 1

    def continuations(self, tail: list[int], budget: DraftBudget, device: torch.device,
                      matched: int) -> DraftTree | None:
        """The replies' continuation where its match is longer than the sequence's `matched` tokens, else the base
        corpus's answer."""
        with self._lock:
            best = None
            for trie in (self._newer, self._older):
                found = None if trie is None else trie.match_of(tail)
                if found is not None and found[1] > matched and (best is None or found[1] > best[2]):
                    best = (trie, found[0], found[1])
            if best is not None:
                return best[0].tree_at(best[1], budget, device)
        return None if self.base is None else self.base.continuations(tail, budget, device, matched)
