"""An EAGLE drafter's greedy chain (width 1) at static shapes: on a CUDA drafter, each propose is one CUDA graph
replay (issue #8).

On an H200 the eager propose of the default bundle's depth-2 chain cost 3.2 ms per speculative step, about as
much as the graphed verify (3.4 ms; docs/gpu.md, 2026-11-26): Python, a few dozen kernel launches and host reads
for a drafter of one block. Captured, the whole propose is one launch with no host read: the committed pairs'
causal step, then per chain node the draft head's argmax and the node's own step.

Same arithmetic as EagleDrafter.propose under greedy with width 1, at static shapes:
- the pending pairs are padded to a bucket; padding rows write KV after the real ones, where the chain's own writes
  land before anything reads them;
- attention reads the whole static cache with a mask, each row seeing the slots up to its own;
- chain node j sits at slot n + j and position n + j + 1 (n: the pairs in the cache once the pending ones are in)
  and sees the prefix and the nodes before it, which is where runtime.dynamic_tree.TreeSlots puts a chain.
Graphs are keyed by (bucket, depth); off CUDA (`use_graph=False`) the same static step runs eagerly, for tests.
`compile` fuses the step first (runtime.cuda_graphs.compile_step).
"""
from __future__ import annotations

import torch

from runtime.cuda_graphs import BUCKETS, bucket_for, capture, check_static_inputs, compile_step, require_cuda
from runtime.dynamic_tree import tree_probs
from runtime.kv_cache import KVCache
from runtime.sampling import SamplingParams

GREEDY = SamplingParams()


class StaticEagleChain:
    def __init__(self, model, cache: KVCache, buckets: tuple[int, ...] = BUCKETS, use_graph: bool = True,
                 warmup: int = 2, compile: bool = False):
        """`model`: a runtime.eagle.EagleModel; `cache`: its KV cache (batch 1, full precision)."""
        device = model.fc.weight.device
        require_cuda(device, use_graph, "drafter")
        check_static_inputs("StaticEagleChain", cache, buckets)
        self.model, self.cache, self.use_graph, self.warmup = model, cache, use_graph, warmup
        self.buckets = tuple(sorted(set(buckets)))
        largest = self.buckets[-1]
        self.tokens = torch.zeros(1, largest, dtype=torch.long, device=device)
        self.features = torch.zeros(1, largest, model.cfg.dim, dtype=model.fc.weight.dtype, device=device)
        self.n_pending = torch.ones(1, dtype=torch.long, device=device)
        self.offsets = torch.arange(largest, device=device)
        self.key_slot = torch.arange(cache.max_len, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.run_step = compile_step(self._step, compile)

    def fits(self, n_pending: int, depth: int, cached: int) -> bool:
        """Whether `n_pending` pairs after `cached` ones, and a chain of `depth`, fit a bucket and the cache."""
        size = bucket_for(n_pending, self.buckets)
        return size is not None and cached + max(size, n_pending + depth) <= self.cache.max_len

    def __call__(self, tokens: torch.Tensor, features: torch.Tensor, depth: int) -> torch.Tensor:
        """The pending pairs (tokens [T], features [T, H]) -> the chain's target token ids [depth]: a view of a
        static buffer, valid until the next call. Writes the pairs' KV after the cache's length without
        advancing it (the caller advances by T)."""
        T = tokens.numel()
        size = bucket_for(T, self.buckets)
        self.tokens[0, :T] = tokens
        self.features[0, :T] = features
        self.n_pending.fill_(T)
        if not self.use_graph:
            return self.run_step(size, depth)
        key = (size, depth)
        if key not in self.graphs:
            self.graphs[key] = capture(lambda: self.run_step(size, depth), self.warmup)
        else:
            self.graphs[key][0].replay()
        return self.graphs[key][1]

    def _step(self, size: int, depth: int) -> torch.Tensor:
        m, cache, L = self.model, self.cache, self.cache.max_len
        own = cache.lengths + self.offsets[:size]  # the pairs' slots; pair j sits at position slot + 1
        positions = (own + 1).clamp(max=m.rope_cos.shape[0] - 1)  # padding rows: any valid position
        mask = (self.key_slot[None, :] <= own[:, None])[None, None]
        out = m.step(self.tokens[:, :size], self.features[:, :size], positions[None], cache, own[None], L, mask)[0]
        feature = out[0].index_select(0, self.n_pending - 1)[0]  # [H]: what the last real pair predicted
        first = cache.lengths + self.n_pending  # [1]: the root's position, the first chain node's slot
        keep = m.head.keep_ids
        chain = []
        for j in range(depth):
            pick = tree_probs(m.head(feature), GREEDY).topk(1).indices.view(1)  # the ranking eager drafting uses
            token = pick if keep is None else keep[pick]
            chain.append(token)
            if j + 1 < depth:
                slot = (first + j).view(1, 1)
                mask = (self.key_slot <= slot[0]).view(1, 1, 1, L)
                feature = m.step(token.view(1, 1), feature.view(1, 1, -1), slot + 1, cache, slot, L, mask)[0][0]
        return torch.cat(chain)
