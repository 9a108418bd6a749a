"""Llama-family decoder (Llama/SmolLM2, Qwen2 with qkv bias, Qwen3 with qk-norm, Mistral) over a static KV cache.

One forward serves prefill, decode and tree verification: T new tokens per sequence are written at
slots cache.lengths[b] + t, and each attends to the committed prefix plus the new tokens that `tree_mask`
allows (causal when None). Weights load from an HF safetensors directory; q/k/v and gate/up are fused at load
so a decode step runs two matmuls per block instead of five.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import cpu_gemm
from runtime.attention import attention_weights, pick_backend
from runtime.kv_cache import KVCache

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)

    @staticmethod
    def from_hf(hf: dict) -> "ModelConfig":
        arch = hf.get("model_type")
        if arch not in ARCHITECTURES:
            raise ValueError(f"model_type {arch!r} is not supported; expected one of {ARCHITECTURES}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported; expected 'silu'")
        if arch in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
            raise ValueError(f"{arch} with use_sliding_window=true is not supported")
        # transformers >= 5 nests rope settings in rope_parameters; older configs use rope_theta + rope_scaling
        rope = dict(hf.get("rope_parameters") or {**(hf.get("rope_scaling") or {}),
                                                   "rope_theta": hf.get("rope_theta", 10000.0)})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "linear", "llama3"):
            raise ValueError(f"rope_type {kind!r} is not supported; expected default, linear or llama3")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor {rope['partial_rotary_factor']} is not supported; expected 1.0")
        scaling = RopeScaling(kind, float(rope.get("factor", 1.0)), float(rope.get("low_freq_factor", 1.0)),
                              float(rope.get("high_freq_factor", 4.0)),
                              int(rope.get("original_max_position_embeddings", 8192)))
        n_heads = hf["num_attention_heads"]
        attention_bias = bool(hf.get("attention_bias", False))
        return ModelConfig(
            arch=arch, vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
            n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            intermediate_size=hf["intermediate_size"], norm_eps=hf["rms_norm_eps"],
            rope_theta=float(rope["rope_theta"]), max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or arch == "qwen2",  # qwen2 always has q/k/v biases, never an o bias
            o_bias=attention_bias and arch != "qwen2", mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=arch == "qwen3", sliding_window=hf.get("sliding_window") if arch == "mistral" else None,
            rope_scaling=scaling)


@dataclass(frozen=True)
class Taps:
    """Extra outputs for drafter training and calibration; the plain forward captures nothing."""
    hidden_layers: tuple[int, ...] = ()  # residual stream after these blocks (0-based), [B, T, dim]
    attention_layers: tuple[int, ...] = ()  # softmax attention weights of these blocks, [B, heads, T, keys]


@dataclass
class ForwardOutput:
    logits: Tensor | None  # [B, T, V] or [B, 1, V] (last_logits_only) or None (no_logits)
    hidden: Tensor  # [B, T, dim] after the final norm
    layer_hidden: dict[int, Tensor] = field(default_factory=dict)
    attention: dict[int, Tensor] = field(default_factory=dict)


def packed_min_fp32_rows(cpu_vendor: str) -> int:
    """From how many rows an fp32 product runs prepacked. Fewer run faster through MKL on Intel CPUs (see
    Packable); elsewhere MKL takes a generic path: on an AVX2 AMD EPYC a SmolLM2 decode step took 76 ms through
    MKL and 52 ms prepacked (2 rows: 116 against 65), so there every product is prepacked (unless own_fp32_kernel)."""
    return 4 if cpu_vendor == "GenuineIntel" else 1


def own_fp32_kernel(cpu_vendor: str) -> bool:
    """Whether fp32 inference products run through our kernel (kernels/cpu_gemm) instead of oneDNN: on the AVX2 AMD
    EPYC it takes a SmolLM2 forward's products from 34 to 22 ms at 1 row and from 53 to 31 ms at 7 (its docstring
    has the table). Intel CPUs keep MKL and oneDNN, which were tuned there; ours is not measured on one."""
    return cpu_vendor == "AuthenticAMD"


PACKED_MIN_FP32_ROWS = packed_min_fp32_rows(cpu_gemm.cpu_info("vendor_id"))
OWN_FP32_KERNEL = own_fp32_kernel(cpu_gemm.cpu_info("vendor_id"))
# Our kernel serves products of up to this many rows: every decode, verify and short prefill, so a verify of up to
# 255 draft nodes equals decoding bit for bit. oneDNN takes longer prefills and batched feature passes: from ~64
# rows on it is faster (at 1024 rows 2.0 against 2.6 s for a SmolLM2 forward's products on the AMD host).
OWN_MAX_ROWS = 256
# oneDNN's prepacked bf16 product gives every row exactly its one-row result up to 32 rows and switches to a kernel
# that rounds differently beyond: a verify of more rows goes in 32-row slices, or greedy output would drift from AR
PACKED_EXACT_ROWS = 32


class Packable:
    """A module whose matmul weight can carry a oneDNN-prepacked copy for CPU inference (`pack`).

    MKL re-packs the weight on every call: a 2..16-row product (tree verify) then costs 1.5-3x a one-row one
    (decode). Prepacked once, oneDNN runs both at about the cost of streaming the weight once. The plain
    weight stays: training, export and embedding lookups read it, and non-CPU inputs fall back to it.

    In fp32 on Intel CPUs, MKL's own kernel still wins for 1..3 rows (a SmolLM2 decode step on Sapphire Rapids: 42
    ms against 48 prepacked; at 4 rows 68 against 55), so those take the plain path (PACKED_MIN_FP32_ROWS); in
    bf16 the prepacked kernel wins from one row on (an unpacked bf16 product is slower than an fp32 one here).
    Where OWN_FP32_KERNEL, fp32 products of up to OWN_MAX_ROWS rows run through kernels/cpu_gemm instead."""

    weight: Tensor
    packed: Tensor | None = None
    panels: Tensor | None = None  # the weight packed for kernels/cpu_gemm, where its fp32 products of few rows run

    def pack(self) -> None:
        own = OWN_FP32_KERNEL and self.weight.dtype == torch.float32 and cpu_gemm.serves(self.weight)
        self.panels = cpu_gemm.pack(self.weight) if own else None
        # the blocked layout oneDNN picks for a 16-row batch serves 1..16 rows about equally well
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 16)

    def unpack(self) -> None:
        self.packed = self.panels = None

    @property
    def own_fp32(self) -> bool:
        return self.panels is not None

    def linear(self, x: Tensor, bias: Tensor | None) -> Tensor:
        # neither fast path has a backward: they serve only forwards no gradient flows through
        inference = x.device.type == "cpu" and not (torch.is_grad_enabled()
                                                    and (x.requires_grad or self.weight.requires_grad))
        if self.own_fp32 and inference and x.dtype == torch.float32 and x.numel() <= OWN_MAX_ROWS * x.shape[-1]:
            return cpu_gemm.small_linear(x, self.panels, self.weight.shape[0], bias)
        if self.packed is not None and inference and x.dtype == self.packed.dtype \
                and (x.dtype != torch.float32 or x.numel() >= PACKED_MIN_FP32_ROWS * x.shape[-1]):
            if x.dtype == torch.bfloat16 and x.numel() > PACKED_EXACT_ROWS * x.shape[-1]:
                rows = x.reshape(-1, x.shape[-1]).split(PACKED_EXACT_ROWS)
                return torch.cat([self._packed(r, bias) for r in rows]).view(*x.shape[:-1], -1)
            return self._packed(x, bias)
        return F.linear(x, self.weight, bias)

    def _packed(self, x: Tensor, bias: Tensor | None) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


class Linear(nn.Linear, Packable):
    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x, self.bias)


@lru_cache(maxsize=None)
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack `dtype` weights on this CPU: its bf16 path needs AVX-512 (bw, vl, dq) or
    AVX-NE-CONVERT, so e.g. an AVX2-only CPU keeps the plain kernel (probed once, as torch decides it)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 16)
    except RuntimeError:
        return False
    return True


def pack_for_cpu(model: nn.Module) -> nn.Module:
    """Prepack every Packable's weight for oneDNN; a no-op off CPU or where oneDNN cannot pack its dtype. Call it
    after the last .to() and the last weight update: packed copies neither move nor follow the weights."""
    for module in model.modules():
        if isinstance(module, Packable) and module.weight.device.type == "cpu" and onednn_packs(module.weight.dtype):
            module.pack()
    return model


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


def attention_mask(lengths: Tensor, positions: Tensor, n_live: int, tree_mask: Tensor | None,
                   window: int | None = None, always: bool = False) -> Tensor | None:
    """[B, 1, T, n_live] bool: the committed prefix (slots < lengths[b]), plus the new tokens `tree_mask` [T, T]
    allows (causal when None), minus keys a sliding `window` excludes. None when one decode token may see every
    live key (no mask to build or apply), unless `always` (static shapes read keys beyond the live ones)."""
    B, T = positions.shape
    if B == 1 and T == 1 and (window is None or n_live <= window) and not always:
        return None
    device = positions.device
    if tree_mask is None:
        tree_mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    elif tree_mask.shape != (T, T):
        raise ValueError(f"tree_mask has shape {tuple(tree_mask.shape)}, expected ({T}, {T})")
    key = torch.arange(n_live, device=device)
    offset = key[None, :] - lengths[:, None]  # [B, n_live]: index among the new tokens, < 0 for the prefix
    is_new = (offset >= 0) & (offset < T)
    new_visible = tree_mask[:, offset.clamp(0, T - 1)].permute(1, 0, 2)  # [B, T, n_live]
    mask = (offset < 0)[:, None, :] | (is_new[:, None, :] & new_visible)
    if window is not None:  # keys keep their slot as position; queries use their (tree) position
        mask &= positions[:, :, None] - key[None, None, :] < window
    return mask[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: Tensor, layer: int, cache: KVCache, slots: Tensor, n_live: int, mask: Tensor | None,
                cos: Tensor, sin: Tensor, want_weights: bool, keep: Tensor | None = None,
                rows: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """keep [B, Hkv, 1|T, n_live]: SpecAttn's keys per kv head (runtime.attention), None: every key.
        rows: indices into the B*T queries whose output is wanted; the result is then [len(rows), dim] and the
        output projection runs on those only (training skips the queries no loss reads, see train.ttt)."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x).view(B, T, H + 2 * Hkv, D)
        qk, v = qkv[:, :, :H + Hkv], qkv[:, :, H + Hkv:]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])], dim=2)
        q, k = apply_rope(qk, cos, sin).split([H, Hkv], dim=2)
        keys, values = cache.write(layer, slots, k, v, n_live)
        q = q.transpose(1, 2)  # [B, H, T, D]
        attend = getattr(cache, "attend", None) or pick_backend(x.device)  # a cache may bring its own (train.ttt)
        out = attend(q, keys, values, mask, keep).transpose(1, 2).reshape(B, T, H * D)
        if rows is not None:
            out = out.reshape(B * T, H * D).index_select(0, rows)
        return self.wo(out), attention_weights(q, keys, mask) if want_weights else None


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


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, max_seq_len: int):
        super().__init__()
        self.config, self.max_seq_len = cfg, max_seq_len
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.output = Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg, max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.output.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.output.weight.device

    def pack_for_cpu(self) -> "Transformer":
        return pack_for_cpu(self)

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache:
        max_len = max_len or self.max_seq_len
        if max_len > self.max_seq_len:
            raise ValueError(f"cache length {max_len} exceeds the model's max_seq_len {self.max_seq_len}")
        c = self.config
        return KVCache(c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim, self.dtype, self.device)

    def forward(self, tokens: Tensor, cache: KVCache, positions: Tensor, tree_mask: Tensor | None = None,
                *, last_logits_only: bool = False, kv_keep: list[Tensor | None] | None = None) -> tuple[Tensor, Tensor]:
        """tokens, positions [B, T] -> (logits [B, T, V] or [B, 1, V], hidden [B, T, dim]). Writes KV at
        cache.lengths + t but does not advance: the caller decides what is committed. kv_keep: per layer the keys
        sparse (SpecAttn) verification reads, see Attention.forward; None: dense."""
        out = self.run(tokens, cache, positions, tree_mask, last_logits_only=last_logits_only, kv_keep=kv_keep)
        return out.logits, out.hidden

    def run(self, tokens: Tensor, cache: KVCache, positions: Tensor, tree_mask: Tensor | None = None, *,
            taps: Taps = Taps(), last_logits_only: bool = False, no_logits: bool = False,
            kv_keep: list[Tensor | None] | None = None) -> ForwardOutput:
        B, T = tokens.shape
        if cache.batch != B:
            raise ValueError(f"tokens have batch {B} but the cache was built for batch {cache.batch}")
        if int(positions.max()) >= self.max_seq_len:
            raise ValueError(f"position {int(positions.max())} is beyond max_seq_len {self.max_seq_len}")
        slots = cache.slots(T)
        n_live = int(cache.lengths.max()) + T
        mask = attention_mask(cache.lengths, positions, n_live, tree_mask, self.config.sliding_window)
        return self.run_placed(tokens, cache, positions, slots, n_live, mask, taps=taps,
                               last_logits_only=last_logits_only, no_logits=no_logits, kv_keep=kv_keep)

    def run_uncached(self, tokens: Tensor, *, no_logits: bool = False) -> ForwardOutput:
        """Whole sequences [B, T] at positions 0..T-1, causal, keeping no KV: training (autograd cannot go through
        the cache's in-place writes of every layer) and cache-free export."""
        B, T = tokens.shape
        positions = torch.arange(T, device=tokens.device).expand(B, T)
        empty = torch.zeros(B, dtype=torch.long, device=tokens.device)
        mask = attention_mask(empty, positions, T, None, self.config.sliding_window)
        return self.run_placed(tokens, NoCache(), positions, None, T, mask, no_logits=no_logits)

    def run_placed(self, tokens: Tensor, cache: "KVCache | NoCache", positions: Tensor, slots: Tensor | None,
                   n_live: int, mask: Tensor | None, *, taps: Taps = Taps(), last_logits_only: bool = False,
                   no_logits: bool = False, kv_keep: list[Tensor | None] | None = None) -> ForwardOutput:
        """run() with the KV slots and the attention mask [B, 1, T, n_live] chosen by the caller: draft trees
        keep their nodes' KV where runtime.dynamic_tree.TreeSlots puts them, and each node sees its ancestors only."""
        cos, sin = self.rope_cos[positions].unsqueeze(2), self.rope_sin[positions].unsqueeze(2)
        x = self.tok_embeddings(tokens)
        out = ForwardOutput(None, x)
        for i, block in enumerate(self.layers):
            h, weights = block.attention(block.attention_norm(x), i, cache, slots, n_live, mask, cos, sin,
                                         i in taps.attention_layers, None if kv_keep is None else kv_keep[i])
            x = x + h
            x = x + block.feed_forward(block.ffn_norm(x))
            if weights is not None:
                out.attention[i] = weights
            if i in taps.hidden_layers:
                out.layer_hidden[i] = x
        out.hidden = self.norm(x)
        if not no_logits:
            out.logits = self.output(out.hidden[:, -1:] if last_logits_only else out.hidden)
        return out

    @staticmethod
    def from_pretrained(path: str | Path, dtype: torch.dtype = torch.float32, max_seq_len: int | None = None,
                        device: torch.device | str = "cpu") -> "Transformer":
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: no config.json (expected an HF model directory)")
        cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
        max_seq_len = max_seq_len or min(cfg.max_position_embeddings, 4096)
        with torch.device("meta"):
            model = Transformer(cfg, max_seq_len)
        model.load_state_dict(load_hf_state_dict(path, cfg), assign=True)
        if cfg.tie_embeddings:  # assign=True made two parameters; re-tie so the table exists (and casts) once
            model.output.weight = model.tok_embeddings.weight
        model.rope_cos, model.rope_sin = rope_tables(cfg, max_seq_len)  # computed in fp32, cast with the weights
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False).pack_for_cpu()


def load_hf_state_dict(path: Path, cfg: ModelConfig) -> dict[str, Tensor]:
    """Read every *.safetensors shard and rename/fuse HF tensors into this module's layout."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weights")
    hf: dict[str, Tensor] = {}
    for f in files:
        hf.update(load_file(str(f)))
    hf = {k.removeprefix("model."): v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}

    def take(name: str) -> Tensor:
        if name not in hf:
            raise ValueError(f"{path}: weight {name!r} is missing for a {cfg.arch} model")
        return hf.pop(name)

    def linear(*names: str) -> Tensor:  # fused along the output dimension
        return torch.cat([take(n) for n in names])

    sd = {"tok_embeddings.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")}
    if cfg.tie_embeddings:
        hf.pop("lm_head.weight", None)  # some tied checkpoints store a copy
        sd["output.weight"] = sd["tok_embeddings.weight"]
    else:
        sd["output.weight"] = take("lm_head.weight")
    for i in range(cfg.n_layers):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        sd[p + "attention_norm.weight"] = take(p + "input_layernorm.weight")
        sd[p + "ffn_norm.weight"] = take(p + "post_attention_layernorm.weight")
        sd[p + "attention.wqkv.weight"] = linear(*(a + f"{n}_proj.weight" for n in "qkv"))
        if cfg.qkv_bias:
            sd[p + "attention.wqkv.bias"] = torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"])
        sd[p + "attention.wo.weight"] = linear(a + "o_proj.weight")
        if cfg.o_bias:
            sd[p + "attention.wo.bias"] = take(a + "o_proj.bias")
        if cfg.qk_norm:
            sd[p + "attention.q_norm.weight"] = take(a + "q_norm.weight")
            sd[p + "attention.k_norm.weight"] = take(a + "k_norm.weight")
        m = p + "mlp."
        sd[p + "feed_forward.w13.weight"] = linear(m + "gate_proj.weight", m + "up_proj.weight")
        sd[p + "feed_forward.w2.weight"] = linear(m + "down_proj.weight")
        if cfg.mlp_bias:
            sd[p + "feed_forward.w13.bias"] = torch.cat([take(m + "gate_proj.bias"), take(m + "up_proj.bias")])
            sd[p + "feed_forward.w2.bias"] = take(m + "down_proj.bias")
    if hf:
        raise ValueError(f"{path}: unexpected weights for a {cfg.arch} model: {sorted(hf)[:5]}")
    return sd


def hf_config(cfg: ModelConfig) -> dict:
    """config.json fields for HF transformers: the inverse of ModelConfig.from_hf."""
    s = cfg.rope_scaling
    rope = {"rope_type": s.kind, "rope_theta": cfg.rope_theta}
    if s.kind != "default":
        rope["factor"] = s.factor
    if s.kind == "llama3":
        rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position)
    hf = {"model_type": cfg.arch, "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
          "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
          "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.norm_eps,
          "hidden_act": "silu", "rope_parameters": rope, "max_position_embeddings": cfg.max_position_embeddings,
          "tie_word_embeddings": cfg.tie_embeddings, "mlp_bias": cfg.mlp_bias}
    if cfg.arch != "qwen2":  # qwen2's q/k/v biases are implied by the architecture
        hf["attention_bias"] = cfg.o_bias
    if cfg.arch == "mistral":
        hf["sliding_window"] = cfg.sliding_window
    return hf


def hf_state_dict(model: Transformer) -> dict[str, Tensor]:
    """The inverse of load_hf_state_dict: this module's weights under HF names, q/k/v and gate/up split again.
    A tied lm_head is left out, as HF checkpoints store it once (as the embedding)."""
    cfg, sd = model.config, model.state_dict()
    q_kv = [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim]
    hf = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"]}
    if not cfg.tie_embeddings:
        hf["lm_head.weight"] = sd["output.weight"]
    for i in range(cfg.n_layers):
        p, a, m = f"layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        hf[f"model.layers.{i}.input_layernorm.weight"] = sd[p + "attention_norm.weight"]
        hf[f"model.layers.{i}.post_attention_layernorm.weight"] = sd[p + "ffn_norm.weight"]
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            for name, t in zip("qkv", sd[p + f"attention.wqkv.{kind}"].split(q_kv)):
                hf[a + f"{name}_proj.{kind}"] = t
        hf[a + "o_proj.weight"] = sd[p + "attention.wo.weight"]
        if cfg.o_bias:
            hf[a + "o_proj.bias"] = sd[p + "attention.wo.bias"]
        if cfg.qk_norm:
            hf[a + "q_norm.weight"] = sd[p + "attention.q_norm.weight"]
            hf[a + "k_norm.weight"] = sd[p + "attention.k_norm.weight"]
        for kind in ("weight", "bias") if cfg.mlp_bias else ("weight",):
            gate, up = sd[p + f"feed_forward.w13.{kind}"].chunk(2)
            hf[m + f"gate_proj.{kind}"], hf[m + f"up_proj.{kind}"] = gate, up
            hf[m + f"down_proj.{kind}"] = sd[p + f"feed_forward.w2.{kind}"]
    return {k: v.contiguous() for k, v in hf.items()}


def hf_causal_lm(model: Transformer, **config_overrides):
    """An HF transformers causal LM with the weights of `model`, on its device and in its dtype (eval mode);
    `config_overrides` go into the HF config (e.g. eos_token_id=None)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = hf_config(model.config)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, **config_overrides)
    with torch.device(model.device):
        hf = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    weights = hf_state_dict(model)
    if model.config.tie_embeddings:  # HF's module lists the tied lm_head under its own name too
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    hf.load_state_dict(weights, strict=True)
    return hf.eval().requires_grad_(False)
