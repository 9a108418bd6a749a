"""Batched speculative decoding: B sequences drafted, their trees verified in one target forward, each row keeping
its own accepted path (continuous batching: requests join and leave between steps).

A row is what Engine.generate runs for one request: its own draft tree (chain or tree, its budget and positions),
its lookup branch, acceptance, bonus token, adaptive depth and fallback. One forward verifies every row's tree:
the trees are padded to the longest (a padding token sees the prefix and itself, no real token sees it) and each
row's tree mask and cache length are its own; afterwards each row's cache keeps only its accepted path, for the
target and (through the BatchDrafter) the drafter. Greedy rows equal batch-1 decoding token for token; sampled rows
keep the target's distribution (runtime.speculation.verify.verify_batch: each row its own params and generator).

How many nodes a row drafts depends on how many rows run (a BatchPolicy, measured by runtime.serving.budget_tuner): as
the batch grows a verify turns compute-bound and smaller trees pay, and above some batch size plain batched decoding
does.

A request is prefilled alone in a free row (KVCache.row) when it joins; a finished row frees its slot at once, and
before each step the busy rows are packed together so the step computes only them. Full-precision KV and dense
verification: a quantised history and SpecAttn keep one boundary or key selection per sequence, which a batch does
not share (runtime.serving.served_engine drops them for its batched engine, and says so). With
EngineConfig.static_verify a step of one row verifies at static shapes as Engine's do (a CUDA graph on a GPU) and each
row drafts with its own drafter's static steps; a step of several rows runs eagerly.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from runtime.drafters.ngram import NgramDrafter
from runtime.drafters.shared.batch_drafter import batch_drafter
from runtime.serving.reply_corpus import ReplyCorpus
from runtime.serving.spec_counters import SpecCounters
from runtime.speculation.cuda_graphs import StaticVerifier
from runtime.speculation.decode_stats import Clock, DecodeStats
from runtime.speculation.draft_budget import BatchPolicy, DraftBudget, ServedBudget
from runtime.speculation.drafter import Drafter
from runtime.speculation.engine import EngineConfig, Generation, check_request, prompt_window
from runtime.speculation.sampling import SamplingParams
from runtime.speculation.tree import DraftTree
from runtime.speculation.verify import verify, verify_batch
from runtime.target.kv_cache import KVCache
from runtime.target.model import Taps, Transformer


@dataclass(frozen=True)
class BatchRequest:
    key: Hashable  # the caller's handle, returned with its generation
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams = SamplingParams()
    stop_ids: tuple[int, ...] = ()
    generator: torch.Generator | None = field(default=None, compare=False)  # on the target's device


@dataclass
class _Row:
    request: BatchRequest
    out: list[int]
    n_cached: int  # the row's cache length, kept on the host
    speculating: bool
    stats: DecodeStats
    started: float
    prefill_s: float
    lookup: NgramDrafter | None

    @property
    def done(self) -> bool:
        return len(self.out) >= self.request.max_new_tokens or not set(self.request.stop_ids).isdisjoint(self.out)

    def final(self) -> list[int]:
        """The tokens the request keeps: up to its first stop id (included) or max_new_tokens."""
        stop = set(self.request.stop_ids)
        first_stop = next((i for i, t in enumerate(self.out) if t in stop), None)
        return self.out[: self.request.max_new_tokens if first_stop is None else
                        min(first_stop + 1, self.request.max_new_tokens)]


class BatchEngine:
    def __init__(self, target: Transformer, new_drafter: Callable[[], Drafter] | None, cfg: EngineConfig,
                 max_batch: int, policy: BatchPolicy | None = None, replies: ReplyCorpus | None = None):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"BatchEngine: max_batch={max_batch!r}, expected an int >= 1")
        if cfg.kv_scheme is not None or cfg.sparse is not None:
            raise ValueError(f"BatchEngine runs a full-precision KV cache and dense verification, got kv_scheme="
                             f"{cfg.kv_scheme!r} and sparse={cfg.sparse is not None}")
        if cfg.max_seq_len > target.max_seq_len:
            raise ValueError(f"EngineConfig.max_seq_len={cfg.max_seq_len} exceeds the target's max_seq_len "
                             f"{target.max_seq_len} (load the target with a larger max_seq_len)")
        self.target, self.cfg, self.max_batch = target, cfg, max_batch
        self.policy = policy or BatchPolicy.fixed(ServedBudget.of(cfg))
        vocab, c = target.config.vocab_size, target.config
        first = None if new_drafter is None else new_drafter()
        static = (target.device.type == "cuda", cfg.compile_static) if cfg.static_verify else None
        self.drafter = None if first is None else batch_drafter(new_drafter, max_batch, static, first)
        if self.drafter is not None and self.drafter.vocab_size != vocab:
            raise ValueError(f"drafter vocab_size {self.drafter.vocab_size} != target vocab_size {vocab}: a drafter "
                             "must propose tokens of the target's vocabulary")
        budgets = [b for b in self.policy.budgets() if b is not None]
        # an n-gram drafter's own trie is the lookup: no branch beside it
        self.lookup_depth = max([b.lookup for b in budgets], default=0) \
            if first is not None and not isinstance(first, NgramDrafter) else 0
        # slots past a row's room: the padding tokens of a step whose longest tree is another row's
        longest = max([b.tree.max_nodes + b.lookup for b in budgets], default=0)
        self.cache = KVCache(c.n_layers, max_batch, c.n_kv_heads, cfg.max_seq_len + longest + 1, c.head_dim,
                             target.dtype, target.device)
        if self.drafter is not None:
            self.drafter.read_target_cache(self.cache.row)
        self.features = self.drafter.feature_layers if self.drafter is not None and self.drafter.needs_features else ()
        self.taps = Taps.entering(self.features)
        # a step of one row verifies at static shapes (a CUDA graph on a GPU) as Engine does; a batch eagerly
        self.static = StaticVerifier(target, self.cache.rows_view(0, 1), use_graph=target.device.type == "cuda",
                                     features=self.features, compile=cfg.compile_static) if cfg.static_verify else None
        self.rows: list[_Row | None] = [None] * max_batch
        self.queue: deque[BatchRequest] = deque()
        self.step_times: list[tuple[int, float]] | None = None  # a list: each step appends (rows, seconds)
        self.counters = SpecCounters()
        # each finished reply is added here (runtime.serving.reply_corpus), which the drafters read as their corpus
        self.replies = replies
        # called on the stepping thread with (key, tokens) as a row's kept tokens land (streaming); None: nobody asks
        self.on_commit: Callable[[Hashable, list[int]], None] | None = None

    # ------------------------------------------------------------------ requests

    def submit(self, request: BatchRequest) -> None:
        check_request(request.prompt, request.max_new_tokens, self.target.config.vocab_size, self.cfg.max_seq_len)
        if any(r.key == request.key for r in self.queue) or any(r and r.request.key == request.key for r in self.rows):
            raise ValueError(f"BatchEngine: request key {request.key!r} is already queued or running")
        self.queue.append(request)

    def cancel(self, key: Hashable) -> bool:
        """Drop a queued or running request (its row frees at once); whether it was there."""
        for r in self.queue:
            if r.key == key:
                self.queue.remove(r)
                return True
        for b, row in enumerate(self.rows):
            if row is not None and row.request.key == key:
                self._free(b)
                return True
        return False

    @property
    def busy(self) -> bool:
        return bool(self.queue) or any(r is not None for r in self.rows)

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.rows)

    def generate(self, requests: list[BatchRequest]) -> list[Generation]:
        """Run `requests` (unique keys) to the end, max_batch at a time; their generations in the same order."""
        for r in requests:
            self.submit(r)
        done: dict[Hashable, Generation] = {}
        while self.busy:
            done.update(self.step())
        return [done[r.key] for r in requests]

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def step(self) -> dict[Hashable, Generation]:
        """Fill free rows (each prefilled alone), then one draft + verify step over every busy row; returns the
        requests that finished, by key."""
        done: dict[Hashable, Generation] = {}
        for b in range(self.max_batch):
            while self.rows[b] is None and self.queue:
                done.update(self._admit(b, self.queue.popleft()))
        n = self._pack()
        if n == 0:
            return done
        start = time.perf_counter()
        clock = Clock(self.target.device)
        rows = self.rows[:n]
        budget = self.policy.at(n) if self.drafter is not None else None
        trees = self._draft(rows, budget)
        draft_s = clock.lap()
        view = self.cache.rows_view(0, n)
        logits, hidden = self._forward(rows, trees, view)
        verdicts = verify_batch(trees, logits, [r.request.params for r in rows],
                                [r.request.generator for r in rows])
        verify_s = clock.lap()
        kept = [[0] + [i + 1 for i in v.accepted] for v in verdicts]  # each row's root and accepted slots
        self._compact(view, kept)
        rollback_s = clock.lap()
        committed = [[t.host_lists().tokens[i] for i in v.accepted] + [v.next_token] for t, v in zip(trees, verdicts)]
        speculating = [b for b, r in enumerate(rows) if r.speculating]
        if speculating:
            moved = [torch.tensor([committed[b], kept[b]], device=self.target.device) for b in speculating]
            self.drafter.commit(speculating, [m[0] for m in moved],
                                [self._features(hidden[b].index_select(0, m[1])) for b, m in zip(speculating, moved)])
            for b in speculating:
                if rows[b].lookup is not None:
                    rows[b].lookup.commit(torch.tensor(committed[b]))
        draft_s += clock.lap()
        self.counters.record_step(n)
        for b, row in enumerate(rows):
            row.stats.draft_s += draft_s
            row.stats.verify_s += verify_s
            row.stats.rollback_s += rollback_s
            row.stats.record(trees[b], verdicts[b].accepted)
            self.counters.record_row(len(trees[b]), len(verdicts[b].accepted), self.drafter is not None)
            if row.speculating and row.stats.should_fall_back():
                row.speculating = False
            row.n_cached += len(kept[b])
            before = len(row.out)
            row.out += committed[b]
            if self.on_commit is not None:
                self._hand_out(row, before)
            if row.done:
                done[row.request.key] = self._finish(b)
        if self.step_times is not None:
            self.step_times.append((n, time.perf_counter() - start))
        return done

    def _draft(self, rows: list[_Row], budget: ServedBudget | None) -> list[DraftTree]:
        """Each row's tree: the drafter's within the row's budget (capped by the batch's), joined by its lookup
        branch and cut to the batch's max_tree (greedy rows); empty where the row does not draft."""
        device = self.target.device
        trees = [DraftTree.empty(device) for _ in rows]
        if budget is None:
            return trees
        rooms = [min(self.cfg.max_seq_len - r.n_cached - 1, r.request.max_new_tokens - len(r.out) - 1) for r in rows]
        drafting = [b for b, r in enumerate(rows) if r.speculating and rooms[b] > 0]
        if not drafting:
            return trees
        budgets = [_within(rows[b].stats.budget(rooms[b]), budget.tree) for b in drafting]
        proposed = self.drafter.propose(drafting, budgets, [rows[b].request.params for b in drafting],
                                        [rows[b].request.generator for b in drafting])
        for b, tree in zip(drafting, proposed):
            row, room = rows[b], rooms[b]
            if len(tree) > room:
                raise ValueError(f"drafter proposed {len(tree)} nodes, more than the budget of {room}")
            greedy = row.request.params.greedy
            cap = min(budget.max_tree, room) if budget.max_tree and greedy else room
            if row.lookup is not None and budget.lookup:
                tree = tree.union(row.lookup.propose(DraftBudget(depth=min(budget.lookup, room)), row.request.params),
                                  limit=cap)
            trees[b] = tree.best(cap) if len(tree) > cap else tree
        return trees

    def _forward(self, rows: list[_Row], trees: list[DraftTree], view: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over every row's root and tree, padded to the longest; logits [n, T, V], hidden."""
        T = 1 + max(len(t) for t in trees)
        tokens, positions, masks = [], [], []
        for row, tree in zip(rows, trees):
            h, pad = tree.host_lists(), T - 1 - len(tree)
            root = row.out[-1]
            tokens.append([root] + h.tokens + [root] * pad)
            positions.append([row.n_cached + d for d in [0] + tree.depth_list()] + [row.n_cached] * pad)
            if T > 1:  # a padding token sees only the prefix and itself
                masks += [r + [False] * pad for r in tree.ancestor_rows()]
                masks += [[False] * (T - pad + i) + [True] + [False] * (pad - 1 - i) for i in range(pad)]
        inputs = torch.tensor([tokens, positions], dtype=torch.long, device=self.target.device)
        tree_mask = None if T == 1 else torch.tensor(masks, dtype=torch.bool, device=self.target.device).view(
            len(rows), T, T)
        if self.static is not None and len(rows) == 1:
            return self.static(inputs[0], inputs[1], None if tree_mask is None else tree_mask[0],
                               cached=rows[0].n_cached)
        out = self.target(inputs[0], view, inputs[1], tree_mask, taps=self.taps)
        return out.logits, out.features(self.features)

    def _compact(self, view: KVCache, kept: list[list[int]]) -> None:
        """Each row's cache keeps its root's and accepted nodes' slots: an accepted chain is already in place."""
        advance = [0] * len(kept)
        for b, rows in enumerate(kept):
            if rows == list(range(len(rows))):
                advance[b] = len(rows)
            else:
                view.row(b).compact(rows)
        if any(advance):
            view.lengths += torch.tensor(advance, device=view.lengths.device)

    # ------------------------------------------------------------------ rows joining and leaving

    def _admit(self, b: int, request: BatchRequest) -> dict[Hashable, Generation]:
        """Prefill `request` alone into row b; a request that ends at its first token finishes here."""
        start, clock = time.perf_counter(), Clock(self.target.device)
        device, n = self.target.device, len(request.prompt)
        view = self.cache.row(b)
        view.lengths.zero_()
        prompt = torch.tensor(request.prompt, dtype=torch.long, device=device)
        out = self.target(prompt[None], view, torch.arange(n, device=device)[None], taps=self.taps,
                          last_logits_only=True)
        logits, hidden = out.logits, out.features(self.features)
        view.advance(n)
        root = verify(DraftTree.empty(device), logits[0], request.params, request.generator).next_token
        greedy_lookup = self.lookup_depth and request.params.greedy
        row = _Row(request, [root], n, self.drafter is not None, DecodeStats(self.cfg), start, 0.0,
                   NgramDrafter(self.target.config.vocab_size, max_depth=self.lookup_depth,
                                corpus=self.cfg.lookup_corpus) if greedy_lookup else None)
        self.rows[b] = row
        if not row.done and self.drafter is not None:
            sequence = torch.tensor(request.prompt + [root], device=device)
            self.drafter.reset(b, *prompt_window(sequence, self._features(hidden[0]), self.cfg.draft_window))
            if row.lookup is not None:
                row.lookup.reset(sequence.cpu())
        row.prefill_s = clock.lap()
        if self.on_commit is not None:
            self._hand_out(row, 0)
        return {request.key: self._finish(b)} if row.done else {}

    def _hand_out(self, row: _Row, before: int) -> None:
        """Give on_commit the row's kept tokens from index `before` on (none past a stop id or max_new_tokens); the
        row was not done before them, so only they can hold its end."""
        fresh, stop = row.out[before:row.request.max_new_tokens], set(row.request.stop_ids)
        first_stop = next((i for i, t in enumerate(fresh) if t in stop), None)
        fresh = fresh if first_stop is None else fresh[:first_stop + 1]
        if fresh:
            self.on_commit(row.request.key, fresh)

    def _finish(self, b: int) -> Generation:
        row = self._free(b)
        out = row.final()
        if self.replies is not None:
            self.replies.add(row.request.prompt, out)
        total = time.perf_counter() - row.started
        return Generation(out, row.stats.metrics(len(row.request.prompt), len(out), row.prefill_s, total))

    def _free(self, b: int) -> _Row:
        row, self.rows[b] = self.rows[b], None
        self.cache.lengths[b] = 0
        return row

    def _pack(self) -> int:
        """Move busy rows down into free ones so that rows 0..n-1 are the busy ones (a step computes only them);
        return n."""
        busy = [b for b, r in enumerate(self.rows) if r is not None]
        for dst, src in enumerate(busy):
            if dst != src:
                self.cache.move_row(src, dst)
                if self.drafter is not None:
                    self.drafter.move(src, dst)
                self.rows[dst], self.rows[src] = self.rows[src], None
        return len(busy)

    def _features(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return hidden if self.drafter is not None and self.drafter.needs_features else None


def _within(budget: DraftBudget, limit: DraftBudget) -> DraftBudget:
    """A row's (adaptive) budget cut to the batch's."""
    depth = min(budget.depth, limit.depth)
    return DraftBudget(depth=depth, width=min(budget.width, limit.width),
                       nodes=max(depth, min(budget.max_nodes, limit.max_nodes)))
