"""N-gram drafter (prompt lookup / Lookahead style): no weights, drafts what followed the current context before.

A trie holds every substring of the committed sequence up to `max_ngram + max_depth` tokens long, with how
often it occurs. The node of the longest recent suffix (up to max_ngram tokens) that has a continuation is the
match; its subtree is a tree of continuations with their counts, and propose() takes the most frequent of them
best-first within the budget. Appending a token extends only the suffix nodes it already tracks, so the cost
per committed token is O(max_ngram + max_depth), independent of the sequence length.

A `corpus` (a Corpus: `NgramDrafter.corpus`, a frozen trie of other token spans such as the target's own answers to
the training prompts) is where propose() looks first, as REST retrieves drafts from a datastore: a small target's
answers share many phrases, and the corpus holds them before the sequence does. The corpus decides whether its
continuation beats the sequence's own match: a frozen trie drafts only where the sequence has none (the rule
calibrate and validate measured); runtime.serving.reply_corpus, which learns served replies, also where its match is
longer.
"""
from __future__ import annotations

import abc
import heapq
import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.drafter import Drafter, DrafterKind
from runtime.speculation.sampling import SamplingParams
from runtime.speculation.tree import DraftTree


# How likely a continuation node is accepted, for DraftTree.scores: P(depth d) ~ FIRST * NEXT^(d-1), as measured on
# held-out conversations of the default target (docs/logs/cpu-2026-11.md,
# "Measurements moved out of docstrings (2026-11-28)")
FIRST_ACCEPT, NEXT_ACCEPT = 0.61, 0.87
# The same for a corpus continuation where the sequence had no match
CORPUS_FIRST_ACCEPT, CORPUS_NEXT_ACCEPT = 0.55, 0.7
MAX_NGRAM = 4  # longest suffix matched, by default
CORPUS_MAX_TOKENS = 1_000_000  # a saved corpus inherited over retrainings stops here (the trie is held in memory)


def depth_score(depth: int, first: float = FIRST_ACCEPT, later: float = NEXT_ACCEPT) -> float:
    return math.log(first) + (depth - 1) * math.log(later)


def answer_spans(input_ids: torch.Tensor, loss_mask: torch.Tensor, offsets: torch.Tensor,
                 context: int = MAX_NGRAM) -> list[torch.Tensor]:
    """Every run of loss-masked tokens (an answer) of the rows a flat (input_ids, loss_mask, offsets) set holds,
    each with up to `context` tokens before it in its row, so an answer's opening matches its turn header."""
    spans, zero = [], torch.zeros(1, dtype=torch.int32)
    for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        edges = torch.diff(loss_mask[a:b].bool().int(), prepend=zero, append=zero)
        starts, ends = (edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()
        spans += [input_ids[a + max(0, s - context):a + e].long() for s, e in zip(starts, ends)]
    return spans


def save_corpus(path: Path, spans: list[torch.Tensor], vocab_size: int) -> None:
    """A corpus's spans as safetensors (flat int32 tokens + offsets; the vocabulary size in the metadata)."""
    from safetensors.torch import save_file

    lengths = torch.tensor([0] + [s.numel() for s in spans], dtype=torch.int64)
    tokens = torch.cat(spans).int() if spans else torch.zeros(0, dtype=torch.int32)
    save_file({"tokens": tokens, "offsets": lengths.cumsum(0)}, str(path), metadata={"vocab_size": str(vocab_size)})


def corpus_spans(path: Path) -> tuple[list[torch.Tensor], int]:
    """The spans of a file save_corpus wrote, and its vocabulary size."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        vocab_size, tokens, offsets = int(f.metadata()["vocab_size"]), f.get_tensor("tokens"), f.get_tensor("offsets")
    bounds = offsets.tolist()
    return [tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:])], vocab_size


def load_corpus(path: Path, max_depth: int) -> NgramDrafter:
    """The corpus trie of a file save_corpus wrote, holding continuations up to `max_depth` tokens."""
    spans, vocab_size = corpus_spans(path)
    return NgramDrafter.corpus(vocab_size, spans, max_depth=max_depth)


def merged_spans(newer: list[torch.Tensor], older: list[torch.Tensor],
                 max_tokens: int = CORPUS_MAX_TOKENS) -> list[torch.Tensor]:
    """`newer`'s spans, then `older`'s not among them, each once, until `max_tokens`."""
    seen, out, total = set(), [], 0
    for span in itertools.chain(newer, older):
        key = tuple(span.tolist())
        if key in seen:
            continue
        if total + span.numel() > max_tokens:
            break
        seen.add(key)
        out.append(span.long())
        total += span.numel()
    return out


class Corpus(abc.ABC):
    """Token spans an n-gram drafter continues its sequence's tail from (NgramDrafter's `corpus`)."""

    vocab_size: int

    @abc.abstractmethod
    def continuations(self, tail: list[int], budget: DraftBudget, device: torch.device,
                      matched: int) -> DraftTree | None:
        """Continuations of a match of `tail`'s last tokens within `budget`, where they beat the sequence's own match
        of `matched` tokens (0: it has none); None where they do not."""


class NgramDrafter(Drafter, Corpus):
    def __init__(self, vocab_size: int, max_ngram: int = MAX_NGRAM, max_depth: int = 8, min_ngram: int = 1,
                 corpus: Corpus | None = None):
        for name, v in (("vocab_size", vocab_size), ("max_ngram", max_ngram), ("max_depth", max_depth),
                        ("min_ngram", min_ngram)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"NgramDrafter: {name}={v!r}, expected an int >= 1")
        if min_ngram > max_ngram:
            raise ValueError(f"NgramDrafter: min_ngram={min_ngram} > max_ngram={max_ngram}")
        if corpus is not None and (not isinstance(corpus, Corpus) or corpus.vocab_size != vocab_size):
            raise ValueError(f"NgramDrafter: corpus={corpus!r}, expected a Corpus of vocab_size {vocab_size}")
        self.vocab_size, self.corpus = vocab_size, corpus
        self.max_ngram, self.max_depth, self.min_ngram = max_ngram, max_depth, min_ngram
        self._device = torch.device("cpu")  # trees go where reset's tokens live (the engine's device)
        self._window = max_ngram + max_depth  # a matched context plus its longest continuation
        self._clear()

    def _clear(self) -> None:
        # Node 0 is the empty string. Flat int lists and one int-keyed dict rather than a dict per node: the trie
        # grows by up to `window` nodes per token, and that many container objects gave 0.2 s GC pauses.
        self._edges: dict[int, int] = {}  # node * vocab_size + token -> child
        self._token: list[int] = [-1]
        self._first_child: list[int] = [-1]  # children as a linked list, newest first
        self._next_sibling: list[int] = [-1]
        self._count: list[int] = [0]  # occurrences of the node's string in the sequence
        self._last: list[int] = [0]  # end of its latest occurrence: ties in count go to the most recent
        self._suffixes: list[int] = []  # _suffixes[L-1] = node of the last L committed tokens, L <= window
        self._tail: list[int] = []  # the last max_ngram committed tokens, to match in the corpus
        self._length = 0

    @staticmethod
    def corpus(vocab_size: int, spans: list[torch.Tensor], max_ngram: int = MAX_NGRAM, max_depth: int = 8,
               min_ngram: int = 2) -> NgramDrafter:
        """A trie of every substring within one of `spans`, to pass as another drafter's `corpus`: its
        continuations of at least `min_ngram` matched tokens are proposed where that drafter's sequence has none."""
        trie = NgramDrafter(vocab_size, max_ngram, max_depth, min_ngram)
        for span in spans:
            trie.add_span(span)
        return trie

    def add_span(self, span: torch.Tensor) -> None:
        """A corpus's further span [m]: its substrings are counted, none across it and the spans before."""
        self._suffixes = []
        self._append(span)

    def _append(self, tokens: torch.Tensor) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"NgramDrafter: tokens of shape {tuple(tokens.shape)}, expected [m]")
        values = tokens.tolist()
        if values and not (0 <= min(values) and max(values) < self.vocab_size):
            raise ValueError(f"NgramDrafter: token ids in [{min(values)}, {max(values)}], expected "
                             f"[0, {self.vocab_size})")
        for token in values:
            self._length += 1
            extended = []
            for node in [0, *self._suffixes[: self._window - 1]]:
                key = node * self.vocab_size + token
                child = self._edges.get(key)
                if child is None:
                    child = self._edges[key] = len(self._count)
                    self._token.append(token)
                    self._next_sibling.append(self._first_child[node])
                    self._first_child[node] = child
                    self._first_child.append(-1)
                    self._count.append(0)
                    self._last.append(0)
                self._count[child] += 1
                self._last[child] = self._length
                extended.append(child)
            self._suffixes = extended
        self._tail = (self._tail + values[-self.max_ngram:])[-self.max_ngram:]

    def _children(self, node: int) -> Iterator[int]:
        child = self._first_child[node]
        while child >= 0:
            yield child
            child = self._next_sibling[child]

    def reset(self, tokens: torch.Tensor, features: torch.Tensor | None = None) -> None:
        if tokens.numel() == 0:
            raise ValueError("NgramDrafter.reset: empty token sequence, expected at least the root token")
        self._clear()
        self._device = tokens.device
        self._append(tokens)

    def commit(self, tokens: torch.Tensor, features: torch.Tensor | None = None) -> None:
        self._append(tokens)

    def _match(self) -> tuple[int, int] | None:
        """(trie node, length) of the longest recent suffix (min_ngram..max_ngram tokens) that occurred before with a
        continuation."""
        longest = min(self.max_ngram, len(self._suffixes))
        for length in range(longest, self.min_ngram - 1, -1):
            node = self._suffixes[length - 1]
            if self._first_child[node] >= 0:
                return node, length
        return None

    def match_of(self, context: list[int]) -> tuple[int, int] | None:
        """(trie node, length) of the longest suffix (min_ngram..max_ngram tokens) of `context` that has a
        continuation here."""
        for length in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            node = 0
            for token in context[-length:]:
                node = self._edges.get(node * self.vocab_size + token)
                if node is None:
                    break
            if node is not None and self._first_child[node] >= 0:
                return node, length
        return None

    def continuations(self, tail: list[int], budget: DraftBudget, device: torch.device,
                      matched: int) -> DraftTree | None:
        """As a frozen corpus: continuations only where the sequence has no match of its own."""
        found = None if matched else self.match_of(tail)
        return None if found is None else self.tree_at(found[0], budget, device)

    def propose(self, budget: DraftBudget, params: SamplingParams,
                generator: torch.Generator | None = None) -> DraftTree:
        """Most frequent continuations of the match, best-first by count: a child never outranks its parent, so
        the tree is the budget's worth of most frequent paths; the corpus's where it beats the sequence's match.
        Deterministic (q None) whatever the params."""
        match = self._match()
        if self.corpus is not None:
            tree = self.corpus.continuations(self._tail, budget, self._device, 0 if match is None else match[1])
            if tree is not None:
                return tree
        if match is not None:
            return self.tree_at(match[0], budget, self._device, FIRST_ACCEPT, NEXT_ACCEPT)
        return DraftTree.empty(self._device)

    def tree_at(self, match: int, budget: DraftBudget, device: torch.device, first: float = CORPUS_FIRST_ACCEPT,
                later: float = CORPUS_NEXT_ACCEPT) -> DraftTree:
        """The most frequent continuations of trie node `match` within `budget`, scored as a corpus's by default."""
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        order = itertools.count()  # heap tie-break: expansion order
        frontier: list[tuple] = []

        def push_children(node: int, parent: int, depth: int) -> None:
            best = heapq.nlargest(budget.width, self._children(node), key=lambda c: (self._count[c], self._last[c]))
            for child in best:
                rank = (-self._count[child], -self._last[child], next(order))
                heapq.heappush(frontier, (rank, child, parent, depth))

        push_children(match, -1, 1)
        while frontier and len(tokens) < budget.max_nodes:
            _, node, parent, depth = heapq.heappop(frontier)
            tokens.append(self._token[node])
            parents.append(parent)
            scores.append(depth_score(depth, first, later))
            if depth < budget.depth:
                push_children(node, len(tokens) - 1, depth + 1)
        return DraftTree.from_lists(tokens, parents, scores, device)

class NgramKind(DrafterKind):
    name = "ngram"
    weighted = False
    calibrates = False

    def config(self, module, draft_vocab, settings):
        return {"kind": self.name, "max_ngram": settings.max_ngram}

    def drafter(self, module, config, target, max_len, keep_ids):
        return NgramDrafter(target.config.vocab_size, **{k: v for k, v in config.items() if k != "kind"})


KIND = NgramKind()
