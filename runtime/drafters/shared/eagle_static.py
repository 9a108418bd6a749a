"""An EAGLE drafter's greedy draft trees at static shapes: on a CUDA drafter, each propose is one CUDA graph replay.

An eager propose costs about as much as the graphed verify on a GPU (docs/logs/gpu-2026-11.md,
"2026-11-26: the default eagle bundle on the real target"): Python, a few dozen kernel
launches and host reads for a drafter of one block. Captured, the whole propose is one launch with no host read: the
committed pairs' causal step, then per depth the draft head's top-`width` children of the nodes it expands and those
nodes' own step.

Same tree as EagleDrafter.propose under greedy (runtime.speculation.dynamic_tree.grow_tree, EAGLE-2), at static shapes:
- the pending pairs are padded to a bucket; padding rows write KV after the real ones, where the tree's own writes
  land before anything reads them;
- the root draws its top `width` children; at each further depth the `width` frontier nodes of best cumulative
  score (stable order on ties: the eager sort's) are expanded in one step and each draws its top `width`; then the
  best `nodes` of all candidates are kept, parents before children. A chain is width 1;
- the expanded nodes sit at the slots after the root's position n, in expansion order, at position n + depth, and
  see the committed prefix, their expanded ancestors and themselves: where runtime.speculation.dynamic_tree.TreeSlots
  puts them;
- attention reads the key span that holds the step's slots (runtime.speculation.cuda_graphs.key_span) with a mask;
  scores are summed in float64 as the eager tree's are.
Graphs are keyed by (bucket, budget, span); off CUDA (`use_graph=False`) the same static step runs eagerly, for tests.
`compile` fuses the step first (runtime.speculation.cuda_graphs.compile_step).
"""
from __future__ import annotations

import torch

from runtime.speculation.cuda_graphs import BUCKETS, bucket_for, capture, check_static_inputs, compile_step, key_span, require_cuda
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.dynamic_tree import tree_probs
from runtime.speculation.sampling import SamplingParams
from runtime.speculation.tree import DraftTree
from runtime.target.kv_cache import KVCache

GREEDY = SamplingParams()
Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def tree_slots(budget: DraftBudget) -> int:
    """Drafter KV slots a propose's expanded nodes take after the root's position: `width` a depth below the root."""
    return (budget.depth - 1) * budget.width


class StaticEagleTree:
    def __init__(self, model, cache: KVCache, buckets: tuple[int, ...] = BUCKETS, use_graph: bool = True,
                 warmup: int = 2, compile: bool = False):
        """`model`: an EAGLE model (runtime.drafters.shared.eagle_drafting.EagleBase); `cache`: its KV cache (batch 1,
        full precision)."""
        device = model.fc.weight.device
        require_cuda(device, use_graph, "drafter")
        check_static_inputs("StaticEagleTree", cache, buckets)
        self.model, self.cache, self.use_graph, self.warmup = model, cache, use_graph, warmup
        self.buckets = tuple(sorted(set(buckets)))
        largest = self.buckets[-1]
        self.tokens = torch.zeros(1, largest, dtype=torch.long, device=device)
        self.features = torch.zeros(1, largest, model.feature_dim, dtype=model.fc.weight.dtype, device=device)
        self.n_pending = torch.ones(1, dtype=torch.long, device=device)
        self.key_slot = torch.arange(cache.max_len, device=device)  # also the offsets of pending pairs and nodes
        self.graphs: dict[tuple[int, DraftBudget, int], tuple[torch.cuda.CUDAGraph, Tensors]] = {}
        self.run_step = compile_step(self._step, compile)

    def n_keys(self, n_pending: int, budget: DraftBudget, cached: int) -> int | None:
        """Cache slots a propose of `n_pending` pairs after `cached` ones writes up to: the pairs' bucket and the
        tree's expanded nodes; None when the pairs fit no bucket."""
        size = bucket_for(n_pending, self.buckets)
        return None if size is None else cached + max(size, n_pending + tree_slots(budget))

    def fits(self, n_pending: int, budget: DraftBudget, cached: int) -> bool:
        """Whether `n_pending` pairs after `cached` ones, and the tree's expanded nodes, fit a bucket and the cache
        (and the draft vocabulary has `width` tokens to draw)."""
        n_keys = self.n_keys(n_pending, budget, cached)
        return n_keys is not None and n_keys <= self.cache.max_len and budget.width <= self.model.head.weight.shape[0]

    def __call__(self, tokens: torch.Tensor, features: torch.Tensor, budget: DraftBudget, cached: int) -> DraftTree:
        """The pending pairs (tokens [T], features [T, H]) after `cached` ones (the cache's length, known on the
        host) -> the greedy draft tree within `budget`, scored as the eager one. Writes the pairs' KV after the
        cache's length without advancing it (the caller advances by T)."""
        T = tokens.numel()
        size = bucket_for(T, self.buckets)
        self.tokens[0, :T] = tokens
        self.features[0, :T] = features
        self.n_pending.fill_(T)
        span = key_span(self.n_keys(T, budget, cached), self.cache.max_len)
        shape = (size, budget.depth, budget.width, budget.max_nodes, span)
        key = (size, budget, span)
        if not self.use_graph:
            out = self.run_step(*shape)
        elif key not in self.graphs:
            self.graphs[key] = capture(lambda: self.run_step(*shape), self.warmup)
            out = self.graphs[key][1]
        else:
            graph, out = self.graphs[key]
            graph.replay()
        tokens, parents, scores = (t.clone() for t in out)  # the static buffers change at the next replay
        return DraftTree(tokens, parents, None, scores.float())

    def _step(self, size: int, depth: int, width: int, limit: int, span: int) -> Tensors:
        m, cache, key_slot = self.model, self.cache, self.key_slot[:span]
        own = cache.lengths + self.key_slot[:size]  # the pairs' slots; pair j sits at position slot + 1
        positions = (own + 1).clamp(max=m.rope_cos.shape[0] - 1)  # padding rows: any valid position
        mask = (key_slot[None, :] <= own[:, None])[None, None]
        out = m.step(self.tokens[:, :size], self.features[:, :size], positions[None], cache, own[None], span, mask)[0]
        root_feature = out[0].index_select(0, self.n_pending - 1)  # [1, H]: what the last real pair predicted
        root = cache.lengths + self.n_pending  # [1]: the root's position, the first expanded node's slot

        keep = m.head.keep_ids  # target id of each draft-vocabulary index; None: the full vocabulary
        # candidates in eager order, per depth: target token id, parent (-1: the root), cumulative log-prob,
        # effective score (never above the parent's), the feature expanding it reads (its parent's), and the
        # slots it may see when expanded (the committed prefix and its expanded ancestors)
        p, index = tree_probs(m.head(root_feature), GREEDY).topk(width)
        score = p[0].double().log()
        ids = [index[0] if keep is None else keep[index[0]]]
        parents, scores, effective = [torch.full_like(index[0], -1)], [score], [score]
        feeds = [root_feature.expand(width, -1)]
        sees = [(key_slot < root).expand(width, span)]
        start = 0  # first candidate of the frontier (the last depth's)
        for level in range(1, depth):
            eff = torch.cat(effective)
            frontier = torch.arange(start, eff.numel(), device=eff.device)
            chosen = frontier[eff[start:].sort(descending=True, stable=True).indices[:width]]
            slots = root + (level - 1) * width + self.key_slot[:width]
            node_sees = torch.cat(sees)[chosen] | (key_slot[None, :] == slots[:, None])  # [w, span]
            f = m.step(torch.cat(ids)[chosen][None], torch.cat(feeds)[chosen][None], (root + level).expand(width)[None],
                       cache, slots[None], span, node_sees[None, None])[0][0]  # [w, H]
            p, index = tree_probs(m.head(f), GREEDY).topk(width)  # [w, w], each row in draw order
            score = torch.cat(scores)[chosen][:, None] + p.double().log()
            start = eff.numel()
            ids.append(index.flatten() if keep is None else keep[index.flatten()])
            parents.append(chosen.repeat_interleave(width))
            scores.append(score.flatten())
            effective.append(torch.minimum(eff[chosen][:, None], score).flatten())
            feeds.append(f.repeat_interleave(width, 0))
            sees.append(node_sees.repeat_interleave(width, 0))

        eff, parent = torch.cat(effective), torch.cat(parents)
        kept = eff.sort(descending=True, stable=True).indices[:limit].sort().values  # best `limit`, in eager order
        renumbered = torch.full_like(parent, -1)
        renumbered[kept] = torch.arange(kept.numel(), device=kept.device)
        kept_parent = parent[kept]
        tree_parents = torch.where(kept_parent >= 0, renumbered[kept_parent.clamp(min=0)], -1)
        return torch.cat(ids)[kept], tree_parents, eff[kept]
