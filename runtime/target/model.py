"""Llama-family decoder (Llama/SmolLM2, Qwen2 with qkv bias, Qwen3 with qk-norm, Mistral) over a static KV cache.

One forward serves prefill, decode and tree verification: T new tokens per sequence are written at
slots cache.lengths[b] + t, and each attends to the committed prefix plus the new tokens that `tree_mask`
allows (causal when None); forward_uncached runs whole sequences without a cache (training, export). Weights
load from an HF safetensors directory; q/k/v and gate/up are fused at load so a decode step runs two matmuls per
block instead of five.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.target.attention import (Mask, attention_mask, attention_weights, causal_mask, head_groups,
                                      last_query_row, pick_backend)
from runtime.target.cpu_packing import Linear, pack_for_cpu, prefill_products
from runtime.target.kv_cache import KVCache
from runtime.target.model_config import ModelConfig

# most prompt tokens one prefill forward takes (Transformer.prefill); measured in
# docs/logs/cpu-2026-11.md, "Long prompts: maskless causal prefill in chunks (2026-11-28)"
PREFILL_CHUNK = 2048


@dataclass(frozen=True)
class Taps:
    """Extra outputs for drafters, their training and calibration; the plain forward captures nothing."""
    hidden_layers: tuple[int, ...] = ()  # residual stream after these blocks (0-based), [B, T, dim]
    attention_layers: tuple[int, ...] = ()  # softmax attention weights of these blocks, [B, heads, T, keys]
    # > 0: each block's weights averaged as tapped into this many kv-head groups (specattn.head_groups), so that
    # every layer's weights over a long row fit in memory
    attention_groups: int = 0
    attention_last_row: bool = False  # the last query's weights only [B, heads, 1, keys]: a root after a long prompt

    @staticmethod
    def entering(layers: tuple[int, ...]) -> "Taps":
        """The residual streams entering `layers` (layer k's input is block k-1's output; k >= 1)."""
        return Taps(hidden_layers=tuple(k - 1 for k in layers))


@dataclass
class ForwardOutput:
    logits: Tensor | None  # [B, T, V] or [B, 1, V] (last_logits_only) or None (no_logits)
    hidden: Tensor  # [B, T, dim] after the final norm
    layer_hidden: dict[int, Tensor] = field(default_factory=dict)
    attention: dict[int, Tensor] = field(default_factory=dict)

    def features(self, layers: tuple[int, ...]) -> Tensor:
        """What a drafter reads of this forward: the residual streams entering `layers`, concatenated in that order
        [B, T, len(layers) * dim] (the forward ran with Taps.entering(layers)); () : the final hidden [B, T, dim]."""
        return torch.cat([self.layer_hidden[k - 1] for k in layers], -1) if layers else self.hidden

    def with_streams(self, layers: tuple[int, ...]) -> Tensor:
        """What training reads: the final hidden state, then the residual streams entering `layers`."""
        return torch.cat([self.hidden] + [self.layer_hidden[k - 1] for k in layers], -1)


class NoCache:
    """Stands in for KVCache where a forward keeps no state: attention reads this step's own keys and values
    ([B, kv_heads, T, head_dim]), so training has no in-place writes and an exported graph no cache buffers."""

    def write(self, layer: int, slots: None, k: Tensor, v: Tensor, n_live: int) -> tuple[Tensor, Tensor]:
        return k.transpose(1, 2), v.transpose(1, 2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != self.weight.dtype:  # autocast's bf16 input, fp32 weight: the mixed call has no fused kernel
            return F.rms_norm(x.to(self.weight.dtype), self.weight.shape, self.weight, self.eps).to(x.dtype)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused kernel, fp32 accumulation


def rope_tables(cfg: ModelConfig, max_len: int) -> tuple[Tensor, Tensor]:
    """cos, signed sin [max_len, head_dim], half-split layout as HF checkpoints expect. The sin table's first half
    is negated so that rotating is a roll: x * cos + roll(x, D/2) * sin. Computed in fp32 exactly as HF does
    (same rounding of the angles at long positions)."""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
    s = cfg.rope_scaling
    if s.kind == "linear":
        inv_freq = inv_freq / s.factor
    elif s.kind == "llama3":  # long wavelengths slowed by `factor`, short kept, smooth ramp between
        wavelen = 2 * math.pi / inv_freq
        low_wl, high_wl = s.original_max_position / s.low_freq_factor, s.original_max_position / s.high_freq_factor
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        ramped = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wl, inv_freq / s.factor, torch.where(wavelen < high_wl, inv_freq, ramped))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    return torch.cat([angles, angles], dim=-1).cos(), torch.cat([-angles.sin(), angles.sin()], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, heads, D]; cos, sin [B, T, 1, D] from rope_tables."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: Tensor, layer: int, cache: KVCache, slots: Tensor, n_live: int, mask: Mask,
                cos: Tensor, sin: Tensor, want_weights: bool, keep: Tensor | None = None,
                rows: Tensor | None = None, last_query: bool = False,
                weights_last_row: bool = False) -> tuple[Tensor, Tensor | None]:
        """keep [B, Hkv, 1|T, n_live]: SpecAttn's keys per kv head (runtime.target.attention), None: every key.
        rows: indices into the B*T queries whose output is wanted; the result is then [len(rows), dim] and the
        output projection runs on those only (training skips the queries no loss reads, see train.ttt).
        last_query: only the last query's output is wanted ([B, 1, dim]); every token's keys and values are still
        written (a prefill's last layer, whose other outputs nothing reads). weights_last_row: the last query's only."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x).view(B, T, H + 2 * Hkv, D)
        qk, v = qkv[:, :, :H + Hkv], qkv[:, :, H + Hkv:]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])], dim=2)
        q, k = apply_rope(qk, cos, sin).split([H, Hkv], dim=2)
        keys, values = cache.write(layer, slots, k, v, n_live)
        q = q.transpose(1, 2)  # [B, H, T, D]
        if last_query:
            (q, mask), T = last_query_row(q, mask), 1
            keep = keep if keep is None or keep.shape[2] == 1 else keep[:, :, -1:]
        attend = getattr(cache, "attend", None) or pick_backend(x.device)  # a cache may bring its own (train.ttt)
        out = attend(q, keys, values, mask, keep).transpose(1, 2).reshape(B, T, H * D)
        if rows is not None:
            out = out.reshape(B * T, H * D).index_select(0, rows)
        return self.wo(out), attention_weights(q, keys, mask, weights_last_row) if want_weights else None


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w13 = Linear(cfg.dim, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)  # gate and up, fused
        self.w2 = Linear(cfg.intermediate_size, cfg.dim, bias=cfg.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)


class Embedding(nn.Embedding):
    """The token table. Lean and tied to a head that our kernel's panels alone hold (Transformer.pack_for_cpu), it
    reads its rows from those, exactly: the table then exists once, not twice (docs/qwen.md has what it saves)."""

    rows_from: Callable[[Tensor | None], Tensor] | None = None  # Packable.weight_rows of that head

    def forward(self, tokens: Tensor) -> Tensor:
        if self.rows_from is None:
            return super().forward(tokens)
        return self.rows_from(tokens.reshape(-1)).view(*tokens.shape, -1)

    def table(self) -> Tensor:
        """The whole table [V, dim] (an engine's export of a drafter that shares it)."""
        return self.weight.detach() if self.rows_from is None else self.rows_from(None)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, max_seq_len: int):
        super().__init__()
        self.config, self.max_seq_len = cfg, max_seq_len
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.dim)
        self.output = Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg, max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @classmethod
    def empty(cls, cfg: ModelConfig, max_seq_len: int) -> "Transformer":
        """Its parameters on the meta device, for the caller to assign (load_state_dict(assign=True)): a random
        init first would be one full copy more in memory. Its rope tables are real, in fp32."""
        with torch.device("meta"):
            model = cls(cfg, max_seq_len)
        model.rope_cos, model.rope_sin = rope_tables(cfg, max_seq_len)
        return model

    @property
    def dtype(self) -> torch.dtype:  # the embedding's: a lean head's plain weight is a meta tensor
        return self.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:  # the final norm's: a lean model's table and head may be meta tensors
        return self.norm.weight.device

    def pack_for_cpu(self, lean: bool = False, keep_plain: tuple[nn.Module, ...] = ()) -> "Transformer":
        """Prepack the matmul weights for the CPU's kernels; `lean`: inference only, one copy of each weight but
        `keep_plain`'s (runtime.target.cpu_packing.pack_for_cpu). A lean head keeps its plain weight only where no
        exact copy can be read back (drafters read its rows: Packable.weight_rows); tied, the embedding then reads its
        rows there too (Embedding)."""
        pack_for_cpu(self, lean, keep_plain=(self.output, *keep_plain))
        head, table = self.output, self.tok_embeddings
        if lean and head.panels is not None and head not in keep_plain:
            meta = nn.Parameter(head.weight.detach().to("meta"), requires_grad=False)
            if head.weight is table.weight:
                table.weight, table.rows_from = meta, head.weight_rows
            head.weight = meta
        return self

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache:
        max_len = max_len or self.max_seq_len
        if max_len > self.max_seq_len:
            raise ValueError(f"cache length {max_len} exceeds the model's max_seq_len {self.max_seq_len}")
        c = self.config
        return KVCache(c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim, self.dtype, self.device)

    def forward(self, tokens: Tensor, cache: KVCache, positions: Tensor,
                tree_mask: Tensor | None = None, *, slots: Tensor | None = None, mask: Tensor | None = None,
                taps: Taps = Taps(), last_logits_only: bool = False, no_logits: bool = False,
                kv_keep: list[Tensor | None] | None = None, last_only: bool = False) -> ForwardOutput:
        """tokens, positions [B, T] -> logits [B, T, V] ([B, 1, V] with last_logits_only; None with no_logits), the
        final hidden states and what `taps` asks for. Writes KV at cache.lengths + t, each token seeing the committed
        prefix and the new tokens `tree_mask` [T, T] or [B, T, T] allows (causal when None), but does not advance:
        the caller decides what is committed.
        slots [B, T] and mask [B, 1, T, n_live], given together, place the KV and choose what each token sees
        instead (no checks, no host reads: static and graphed steps; draft trees keep their nodes where
        runtime.speculation.dynamic_tree.TreeSlots puts them, each node seeing its ancestors only).
        kv_keep: per layer the keys sparse (SpecAttn) verification reads, see Attention.forward; None: dense.
        last_only: hidden [B, 1, dim] of the last token only; the last layer then computes just the keys and values
        of the others (all a prefill needs of them)."""
        if mask is None:
            if slots is not None:
                raise ValueError("forward: slots need the mask that goes with them")
            B, T = tokens.shape
            if cache.batch != B:
                raise ValueError(f"tokens have batch {B} but the cache was built for batch {cache.batch}")
            if int(positions.max()) >= self.max_seq_len:
                raise ValueError(f"position {int(positions.max())} is beyond max_seq_len {self.max_seq_len}")
            slots = cache.slots(T)
            n_live = int(cache.lengths.max()) + T
            window = self.config.sliding_window
            mask = causal_mask(cache.lengths, T, n_live, tree_mask, window) \
                or attention_mask(cache.lengths, positions, n_live, tree_mask, window)
        elif slots is None or tree_mask is not None:
            raise ValueError("forward: a mask comes with its slots and replaces tree_mask")
        else:
            n_live = mask.shape[-1]
        return self._blocks(tokens, cache, positions, slots, n_live, mask, taps, last_logits_only, no_logits,
                            kv_keep, last_only)

    def prefill(self, tokens: Tensor, cache: KVCache, *, chunk: int | None = None,
                features: tuple[int, ...] | None = (),
                progress: Callable[[int, int], None] | None = None) -> tuple[Tensor, Tensor | None]:
        """Commit prompt tokens [B, T] after each sequence's cached ones: forwards of at most `chunk` tokens (equal
        pieces), each advancing the cache, so memory follows the chunk, not the prompt. Returns the last token's
        logits [B, 1, V] and what a drafter reads of every position (ForwardOutput.features(`features`): the
        hidden states [B, T, dim] with ()), or None with `features` None. Its products take the fastest
        kernel (prefill_products): no decode is compared with a prefill's rows. progress(done, T) after each.
        `chunk` defaults to PREFILL_CHUNK."""
        B, T = tokens.shape
        chunk = PREFILL_CHUNK if chunk is None else chunk
        if chunk < 1:
            raise ValueError(f"prefill chunk={chunk}, expected >= 1")
        cached = int(cache.lengths.max())
        if cached + T > cache.max_len:
            raise ValueError(f"a prompt of {T} tokens after {cached} cached ones exceeds the cache length "
                             f"{cache.max_len} (raise max_seq_len)")
        pieces = -(-T // chunk)
        size = -(-T // pieces)
        hidden, logits = [], None
        for start in range(0, T, size):
            piece = tokens[:, start:start + size]
            positions = cache.lengths[:, None] + torch.arange(piece.shape[1], device=tokens.device)
            last = start + size >= T
            with prefill_products():
                out = self(piece, cache, positions, taps=Taps.entering(features or ()), last_logits_only=True,
                           no_logits=not last, last_only=features is None)
            cache.advance(piece.shape[1])
            logits = out.logits
            if features is not None:
                hidden.append(out.features(features))
            if progress is not None:
                progress(min(start + size, T), T)
        return logits, None if features is None else torch.cat(hidden, 1)

    def forward_uncached(self, tokens: Tensor, *, no_logits: bool = False) -> ForwardOutput:
        """Whole sequences [B, T] at positions 0..T-1, causal, keeping no KV: training (autograd cannot go through
        the cache's in-place writes of every layer) and cache-free export."""
        B, T = tokens.shape
        positions = torch.arange(T, device=tokens.device).expand(B, T)
        empty = torch.zeros(B, dtype=torch.long, device=tokens.device)
        mask = attention_mask(empty, positions, T, None, self.config.sliding_window)
        return self._blocks(tokens, NoCache(), positions, None, T, mask, Taps(), False, no_logits, None, False)

    def _blocks(self, tokens: Tensor, cache: "KVCache | NoCache", positions: Tensor, slots: Tensor | None,
                n_live: int, mask: Mask, taps: Taps, last_logits_only: bool, no_logits: bool,
                kv_keep: list[Tensor | None] | None, last_only: bool) -> ForwardOutput:
        """The layers themselves, once the KV slots and the mask are chosen (forward, forward_uncached)."""
        cos, sin = self.rope_cos[positions].unsqueeze(2), self.rope_sin[positions].unsqueeze(2)
        x = self.tok_embeddings(tokens)
        out = ForwardOutput(None, x)
        for i, block in enumerate(self.layers):
            tail = last_only and i == len(self.layers) - 1
            h, weights = block.attention(block.attention_norm(x), i, cache, slots, n_live, mask, cos, sin,
                                         i in taps.attention_layers, None if kv_keep is None else kv_keep[i],
                                         last_query=tail, weights_last_row=taps.attention_last_row)
            x = (x[:, -1:] if tail else x) + h
            x = x + block.feed_forward(block.ffn_norm(x))
            if weights is not None:
                out.attention[i] = head_groups(weights, taps.attention_groups)
            if i in taps.hidden_layers:
                out.layer_hidden[i] = x
        out.hidden = self.norm(x)
        if not no_logits:
            out.logits = self.output(out.hidden[:, -1:] if last_logits_only else out.hidden)
        return out
