"""Greedy autoregressive decoding with the one-token decode step captured in a CUDA graph (issue #8).

At small model sizes a GPU decode step is bound by Python and kernel-launch overhead, not by the weights it
streams: SmolLM2-135M runs ~30 layers x ~15 kernels per token. Capturing the whole step -- embedding, every
block, the final norm, lm_head, argmax, and feeding the argmax back as the next step's input -- once in a CUDA
graph turns it into one launch, with no host synchronisation between tokens.

Capture needs static shapes, so the captured step differs from `Transformer.run` in one way: attention reads a
static span of the KV cache with a mask (key slot <= position) instead of slicing the cache to the live length.
The span is the smallest power of two (at least MIN_SPAN, at most the cache) that holds the step's keys, one graph
per span: a step's attention costs what the live context needs, not the whole cache (serving allocates the
target's full context, 4096 tokens for SmolLM2), at a few graphs more. The arithmetic over visible keys is the
same; masked keys get weight exactly 0. Same modules, same weights, same KV cache class (runtime/kv_cache.py):
the prefill runs through the ordinary `Transformer.forward`.

Scope: greedy decoding, batch 1, no sliding window, no SpecAttn / quantised KV. CUDA only; importing this module
needs no GPU.

A graph removes the launches' host cost but not the kernels themselves: at SmolLM2's size a graphed decode token
still costs ~2.5 ms on an H200 for ~0.14 ms of weight reads (docs/gpu.md). With `compile` a static step is fused by
torch.compile (inductor) before capture: norms, rope, cache writes, residual adds and SiLU become a few generated
kernels around the matmuls and attention.

`StaticVerifier` does the same for the Engine's verify forward (root + draft tree), any sampling: tree sizes are
bucketed to static shapes, one graph per bucket; SpecAttn's sparse verification included (kept keys as a static
input, listed inside the graph by the attention backend).
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.nn.functional as F

from kernels.sdpa import sdpa_kernels
from runtime.attention import SpecAttnConfig
from runtime.kv_cache import KVCache
from runtime.model import Transformer, apply_rope, attention_mask

Out = TypeVar("Out")
BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # verify sizes (root + nodes) that get a graph; larger ones run eagerly
MIN_SPAN = 256  # fewest cache slots a static step attends over (key_span)
STOP_CHECK = 16  # the graphed decoder looks for a stop token every this many tokens
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


class GraphedGreedyDecoder:
    """`generate(prompt_ids, max_new_tokens)` -> new tokens, greedy. `use_graph=False` runs the same static-shape
    step eagerly (to separate what capture buys from what the static step itself changes); `compile` fuses it
    first (compile_step). Each key span's step is captured on first use."""

    def __init__(self, model: Transformer, max_len: int, use_graph: bool = True, warmup: int = 3,
                 compile: bool = False):
        c = model.config
        require_cuda(model.device, use_graph)
        if c.sliding_window is not None:
            raise ValueError("GraphedGreedyDecoder does not support sliding-window attention")
        if max_len > model.max_seq_len:
            raise ValueError(f"max_len {max_len} exceeds the model's max_seq_len {model.max_seq_len}")
        self.model, self.max_len, self.use_graph, self.warmup = model, max_len, use_graph, warmup
        dev = model.device
        with torch.inference_mode():
            self.cache = model.new_cache(batch=1, max_len=max_len)
            self.token = torch.zeros(1, 1, dtype=torch.long, device=dev)  # input of the next step
            self.pos = torch.zeros(1, 1, dtype=torch.long, device=dev)  # its position == its cache slot
            self.step = torch.zeros(1, dtype=torch.long, device=dev)  # where the step writes its argmax in `out`
            self.out = torch.zeros(max_len, dtype=torch.long, device=dev)
            self.key_slot = torch.arange(max_len, device=dev)
        self.next_pos = 0  # the host's copy of `pos`: choosing a span reads nothing from the device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # by key span
        self.run_step = compile_step(self._step, compile)

    # ------------------------------------------------------------------ the static step
    def _step(self, span: int) -> None:
        m, cache, c = self.model, self.cache, self.model.config
        H, Hkv, D = c.n_heads, c.n_kv_heads, c.head_dim
        pos = self.pos
        cos, sin = m.rope_cos[pos].unsqueeze(2), m.rope_sin[pos].unsqueeze(2)  # [1, 1, 1, D]
        visible = (self.key_slot[:span] <= pos[0, 0]).view(1, 1, 1, span)
        slot = pos[0]
        x = m.tok_embeddings(self.token)
        with sdpa_kernels(x.device):  # the kernels the eager engine uses: the same rounding
            for i, block in enumerate(m.layers):
                a = block.attention
                qkv = a.wqkv(block.attention_norm(x)).view(1, 1, H + 2 * Hkv, D)
                qk, v = qkv[:, :, :H + Hkv], qkv[:, :, H + Hkv:]
                if a.q_norm is not None:
                    qk = torch.cat([a.q_norm(qk[:, :, :H]), a.k_norm(qk[:, :, H:])], dim=2)
                q, k = apply_rope(qk, cos, sin).split([H, Hkv], dim=2)
                cache.k[i].index_copy_(2, slot, k.transpose(1, 2))
                cache.v[i].index_copy_(2, slot, v.transpose(1, 2))
                keys, values = cache.k[i][:, :, :span], cache.v[i][:, :, :span]  # [1, Hkv, span, D] static views
                qg = q.reshape(1, Hkv, H // Hkv, D)  # grouped-query: each kv head's query heads as rows
                o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=visible)
                x = x + a.wo(o.reshape(1, 1, H * D))
                x = x + block.feed_forward(block.ffn_norm(x))
        logits = m.output(m.norm(x))
        nxt = logits[0, -1].argmax().view(1)
        self.out.index_copy_(0, self.step, nxt)
        self.token.copy_(nxt.view(1, 1))
        self.pos.add_(1)
        self.step.add_(1)

    def decode_step(self) -> None:
        """One more token: the static step over the span that holds the cache, replayed from its graph."""
        span = key_span(self.next_pos + 1, self.max_len)
        if not self.use_graph:
            self.run_step(span)
        elif span in self.graphs:
            self.graphs[span].replay()
        else:  # warmed up at this slot, rewound after each warm-up step; capture's replay makes this token
            state = (self.token, self.pos, self.step)
            saved = [t.clone() for t in state]
            rewind = lambda: [t.copy_(s) for t, s in zip(state, saved)]  # noqa: E731
            self.graphs[span] = capture(lambda: self.run_step(span), self.warmup, rewind)[0]
        self.next_pos += 1

    # ------------------------------------------------------------------ decoding
    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
        n = len(prompt_ids)
        if not prompt_ids or max_new_tokens < 1 or n + max_new_tokens - 1 > self.max_len:
            raise ValueError(f"prompt of {n} tokens + max_new_tokens={max_new_tokens} does not fit "
                             f"max_len={self.max_len}")
        m, cache, dev = self.model, self.cache, self.model.device
        cache.reset()
        prompt = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
        logits, _ = m(prompt, cache, torch.arange(n, device=dev)[None], last_logits_only=True)
        first = logits[0, -1].argmax().view(1)
        self.out[:1].copy_(first)
        self.token.copy_(first.view(1, 1))
        self.pos.fill_(n)
        self.step.fill_(1)
        self.next_pos = n
        stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=dev) if stop_ids else None
        made = 1
        while made < max_new_tokens:
            # a stop check costs a host sync: look every STOP_CHECK tokens, and trim what follows the stop below
            if stops is not None and made % STOP_CHECK == 0 and bool(torch.isin(self.out[:made], stops).any()):
                break
            self.decode_step()
            made += 1
        tokens = self.out[:made].tolist()
        stop = set(stop_ids)
        first_stop = next((i for i, t in enumerate(tokens) if t in stop), None)
        return tokens if first_stop is None else tokens[:first_stop + 1]


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
                 compile: bool = False):
        require_cuda(model.device, use_graph)
        check_static_inputs("StaticVerifier", cache, buckets)
        self.model, self.cache, self.use_graph, self.warmup = model, cache, use_graph, warmup
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
            return self.model(tokens, self.cache, positions, tree_mask, kv_keep=layers)
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
        out = m.run_placed(b.tokens, cache, b.positions, slots, span, mask, kv_keep=kv_keep)
        return out.logits, out.hidden
