"""The engine's target forward at static shapes, captured in CUDA graphs (`StaticVerifier`).

At small model sizes a GPU step is bound by kernel launches, not by the weights it streams; a captured step is one
launch with no host synchronisation inside. Capture needs static shapes: verify sizes (root + draft tree) are
padded to buckets, and attention reads a static span of the KV cache with a mask instead of slicing the cache to the
live length. The span is the smallest power of two (at least MIN_SPAN, at most the cache) that holds the step's
keys, a graph per (bucket, span): a step's attention costs what the live context needs, not the whole cache. Masked
keys get weight exactly 0, so the arithmetic over visible keys is that of the eager forward. With `compile` a static
step is fused by torch.compile (inductor) before capture. CUDA only where graphs are captured; off CUDA the same
static step runs eagerly, which is what the CPU tests check.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

from runtime.target.attention import SpecAttnConfig, attention_mask
from runtime.target.kv_cache import KVCache
from runtime.target.model import Taps, Transformer

Out = TypeVar("Out")
BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # verify sizes (root + nodes) that get a graph; larger ones run eagerly
MIN_SPAN = 256  # fewest cache slots a static step attends over (key_span)
# specialisations of one static step's code (every bucket, depth and instance is one): dynamo's default of 8
# would send later ones back to eager without a word
RECOMPILE_LIMIT = 512


def require_cuda(device: torch.device, use_graph: bool, what: str = "model") -> None:
    if use_graph and device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA {what}, got device {device}")


def compile_step(step: Callable[..., Out], enabled: bool) -> Callable[..., Out]:
    """`step` compiled by torch.compile (inductor) where `enabled`, else `step` itself. The whole step or an error
    (fullgraph: a graph break would split it silently). It compiles on its first call, which a capture's warm-up
    makes; the first bucket at its own shapes, the second once more with the bucket size symbolic (torch's automatic
    dynamic shapes), which then serves the later ones (but size 1, which torch specialises): a few compiles a step,
    not one per bucket. Each bucket is still captured in a graph of its own."""
    if not enabled:
        return step
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(step, fullgraph=True)


def key_span(n_keys: int, max_len: int) -> int:
    """The cache slots [0, span) a static step attends over when it needs the first `n_keys`: the smallest power of
    two >= n_keys, at least MIN_SPAN, at most max_len (a shape per doubling of the context, not per length)."""
    if not 0 < n_keys <= max_len:
        raise ValueError(f"a static step needs {n_keys} keys, expected 1..{max_len} (the cache length)")
    return min(max_len, max(MIN_SPAN, 1 << (n_keys - 1).bit_length()))


def check_static_inputs(who: str, cache: KVCache, buckets: tuple[int, ...]) -> None:
    """A static step writes one sequence's full-precision KV at bucketed sizes."""
    if cache.batch != 1 or type(cache) is not KVCache:
        raise ValueError(f"{who} needs a batch-1, full-precision KVCache")
    if not buckets or min(buckets) < 1:
        raise ValueError(f"{who}: buckets={buckets}, expected sizes >= 1")


def capture(step: Callable[[], Out], warmup: int,
            rewind: Callable[[], object] = lambda: None) -> tuple[torch.cuda.CUDAGraph, Out]:
    """`step` captured in a CUDA graph (a memory pool of its own: graphs replay in any order), and the static
    outputs it returns. Warms up off the capture stream first (lazy inits, cuBLAS workspaces), calling `rewind`
    after each warm-up step (a step that advances its own inputs runs each time from where it was); capturing runs
    nothing, so the graph is replayed once before returning: the outputs hold this call's values."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
            rewind()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    graph.replay()
    return graph, outputs


def bucket_for(size: int, buckets) -> int | None:
    """The smallest bucket >= size; None when there is none."""
    return next((b for b in buckets if b >= size), None)


class _Bucket:
    """Static inputs of one verify size, and the outputs its graph (or eager step) last wrote."""

    def __init__(self, size: int, device: torch.device, sparse: bool = False):
        self.sparse = sparse  # whether its step reads SpecAttn's kept keys
        self.tokens = torch.zeros(1, size, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, size, dtype=torch.long, device=device)
        self.padded = torch.eye(size, dtype=torch.bool, device=device)  # padding rows see the prefix and themselves
        self.causal = torch.ones(size, size, dtype=torch.bool, device=device).tril()
        self.tree = self.padded.clone()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}  # by key span


class StaticVerifier:
    """The Engine's target forward of one decode or verify step -- tokens, positions [1, T] and the tree mask
    [T, T] (None: T == 1) -- at static shapes: padded to the smallest bucket >= T, KV written at the cache's
    length + 0..bucket-1, attention over the key span that holds them (key_span) with a mask (`attention_mask` with
    n_live = span). On a CUDA target each (bucket, span) step is captured in a CUDA graph on first use and
    replayed.

    Padding rows see the committed prefix and themselves, and no real row sees them, so the real rows' outputs
    and KV are those of the unpadded forward. Their KV lands in slots after the real tokens, which the Engine never
    commits (it compacts the accepted rows) and every later forward overwrites before it reads them. Sizes beyond
    the largest bucket, or a bucket that would overrun the cache, run the ordinary eager forward.

    With `sparse` (SpecAttn) a call may bring `keep` [Ld, Hkv, 1, max_len], the draft layers' kept keys over the
    whole static cache. It is copied into a static buffer, and the step narrows it to the live keys and this step's
    (within its span) before the layers read it, so a backend that skips unkept keys (triton_sparse) reads no slot
    beyond them.

    The outputs are views of static buffers, valid until the next call; the Engine reads them within its step.
    Off CUDA (`use_graph=False`) the same static step runs eagerly: that is what the CPU tests check. `compile`
    fuses the dense steps first (compile_step); sparse ones stay as they are, their attention being a kernel of
    ours (triton_sparse) or sdpa over a mask."""

    def __init__(self, model: Transformer, cache: KVCache, buckets: tuple[int, ...] = BUCKETS,
                 use_graph: bool = True, warmup: int = 2, sparse: SpecAttnConfig | None = None,
                 compile: bool = False, features: tuple[int, ...] = ()):
        """`features`: what a step returns beside the logits (ForwardOutput.features: the drafter's read)."""
        require_cuda(model.device, use_graph)
        check_static_inputs("StaticVerifier", cache, buckets)
        self.model, self.cache, self.use_graph, self.warmup = model, cache, use_graph, warmup
        self.features, self.taps = features, Taps.entering(features)
        self.sizes = tuple(sorted(set(buckets)))
        self.buckets: dict[tuple[int, bool], _Bucket] = {}  # (size, sparse): a sparse step is another graph
        self.offsets = torch.arange(max(buckets), device=model.device)
        self.sparse, self.keep = sparse, None  # the static copy of a call's `keep`, allocated on first use
        self.key_slot = torch.arange(cache.max_len, device=model.device)
        self.dense_step = compile_step(self._step, compile)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor | None,
                 keep: torch.Tensor | None = None, cached: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`cached`: the cache's length where the caller knows it on the host (else it is read from the device)."""
        T = tokens.shape[1]
        size = bucket_for(T, self.sizes)
        if keep is not None and (self.sparse is None or keep.shape[-1] != self.cache.max_len):
            raise ValueError(f"StaticVerifier: keep {tuple(keep.shape)} needs sparse settings and one entry per "
                             f"slot of the static cache ({self.cache.max_len})")
        cached = int(self.cache.lengths[0]) if cached is None else cached
        if size is None or cached + size > self.cache.max_len:
            n_live = cached + T
            layers = None if keep is None else self.sparse.layer_keep(keep[..., :n_live])
            out = self.model(tokens, self.cache, positions, tree_mask, kv_keep=layers, taps=self.taps)
            return out.logits, out.features(self.features)
        if keep is not None:
            if self.keep is None:
                self.keep = torch.empty_like(keep)
            self.keep.copy_(keep)
        b = self.buckets.get((size, keep is not None))
        if b is None:
            b = self.buckets[(size, keep is not None)] = _Bucket(size, self.model.device, keep is not None)
        b.tokens[:, :T] = tokens
        b.positions[:, :T] = positions
        b.positions[:, T:] = positions[:, :1]  # any valid position: padding rows are never read
        b.tree.copy_(b.padded)
        b.tree[:T, :T] = b.causal[:T, :T] if tree_mask is None else tree_mask
        step = self._step if b.sparse else self.dense_step
        span = key_span(cached + size, self.cache.max_len)
        if not self.use_graph:
            logits, hidden = step(b, span)
        elif span not in b.graphs:  # the warm-up's KV writes go to the same slots the replay writes
            b.graphs[span] = capture(lambda: step(b, span), self.warmup)
            logits, hidden = b.graphs[span][1]
        else:
            graph, (logits, hidden) = b.graphs[span]
            graph.replay()
        return logits[:, :T], hidden[:, :T]

    def _step(self, b: _Bucket, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        m, cache, size = self.model, self.cache, b.tokens.shape[1]
        slots = cache.lengths[:, None] + self.offsets[:size]
        mask = attention_mask(cache.lengths, b.positions, span, b.tree, m.config.sliding_window, always=True)
        kv_keep = None
        if b.sparse:  # new views every step: a backend lists their keys inside the graph, not from a stale call
            kv_keep = self.sparse.layer_keep(self.keep[..., :span] & (self.key_slot[:span] < cache.lengths[0] + size))
        out = m(b.tokens, cache, b.positions, slots=slots, mask=mask, taps=self.taps, kv_keep=kv_keep)
        return out.logits, out.features(self.features)
