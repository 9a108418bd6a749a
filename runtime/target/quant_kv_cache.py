"""KV cache with a quantised history (QuantSpec): committed tokens older than the most recent `recent` ones are
stored as int8, int4 or hierarchical int4 codes; the recent ones and every uncommitted (draft tree) slot stay in
full precision. A drop-in for KVCache wherever a model writes and reads its cache (Transformer.forward, EAGLE).

Why the split: verification rolls back (compacts) only uncommitted slots, which are full precision, so a token's
codes are written once, when it leaves the recent window, and never moved or re-quantised; and the most recent
tokens, which attention tends to weigh most, are read exactly.

Layout: slots [0, quantized) are codes + scales in kernels/kv_quant.py's formats, one scale per (token, head), or
per group of INT4_GROUP channels for int4. Scales are computed when a token is quantised, from that token alone:
nothing to calibrate ahead of time and nothing a later token can change. Slots from `quantized` on live in a
full-precision KVCache `window` whose slot 0 is absolute slot `quantized`; it is reallocated to the live length
plus WINDOW_HEADROOM whenever it shifts, so it never holds more than the recent tokens and one forward's new ones.

Readers of "hier-int4" (the int8 code split into two int4 planes): "target" decodes both planes, which equals
int8 bit for bit; "draft" decodes the upper plane alone (half the bytes, int4 precision).

The boundary moves in blocks (QuantSpec's double buffer): with L committed tokens, slots below
max(0, floor((L - recent) / block) * block) are codes, so between `recent` and `recent + block - 1` committed tokens
stay exact. Blocks are what keep speculative decoding lossless: every query of a verify forward reads the boundary
of the committed length at its start, while plain decoding reads the boundary of each query's own length. The two
agree as long as a verify does not reach the next boundary move, and `exact_depth` says how deep a tree may go
for that (the engine caps its draft budget with it), which costs a shorter tree once per block.

Cost: each forward dequantises the whole quantised prefix of a layer before attention, so on CPU this is slower
than KVCache. What it buys is KV memory
on GPU (int8 about 1/4 of fp32, int4 about 1/7), where quantisation and dequantisation run as the Triton kernels;
read bandwidth drops only with an attention kernel that reads the codes directly, which this torch path does not
have.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from kernels.kv_quant import (dequant_full, dequant_upper, dequantize_int4, dequantize_int8, quantize_hierarchical,
                              quantize_int4, quantize_int8)
from runtime.target.kv_cache import KVCache

SCHEMES = ("int8", "int4", "hier-int4")
READERS = ("target", "draft")
INT4_GROUP = 32  # channels per int4 scale (the whole head when head_dim is not a multiple)
MIN_BLOCK = 16  # fewest tokens quantised at once: each move cuts one draft tree short (see exact_depth)
WINDOW_HEADROOM = 64  # free full-precision slots kept past the live ones: a verify tree fits without a regrow


@dataclass(frozen=True)
class KVQuant:
    """How a cache stores its history: `scheme`, the `recent` tokens kept exact, and who reads it."""
    scheme: str
    recent: int = 64
    reader: str = "target"

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"KV quantisation scheme {self.scheme!r} is not one of {SCHEMES}")
        if self.reader not in READERS:
            raise ValueError(f"KV reader {self.reader!r} is not one of {READERS}")
        if isinstance(self.recent, bool) or not isinstance(self.recent, int) or self.recent < 0:
            raise ValueError(f"KV recent window {self.recent!r}: expected an int >= 0")

    @property
    def block(self) -> int:
        return max(self.recent, MIN_BLOCK)

    def boundary(self, committed: int) -> int:
        """Slots below this are codes once `committed` tokens are committed."""
        return max(0, (committed - self.recent) // self.block * self.block)

    def group(self, head_dim: int) -> int:
        return math.gcd(head_dim, INT4_GROUP)

    def quantize(self, x: Tensor) -> tuple[Tensor, ...]:
        """x [..., head_dim] -> the code planes, each [..., *]; the last plane holds the scales."""
        if self.scheme == "int8":
            return quantize_int8(x)
        if self.scheme == "int4":
            return quantize_int4(x, self.group(x.shape[-1]))
        return quantize_hierarchical(x)

    def read_planes(self, planes: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """The planes this reader touches: a drafter skips the hierarchical lower plane."""
        return (planes[0], planes[2]) if self.scheme == "hier-int4" and self.reader == "draft" else planes

    def dequantize(self, planes: tuple[Tensor, ...]) -> Tensor:
        read = self.read_planes(planes)
        if self.scheme == "int8":
            return dequantize_int8(*read)
        if self.scheme == "int4":
            return dequantize_int4(*read)
        return dequant_upper(*read) if self.reader == "draft" else dequant_full(*read)

    def read_bits(self, head_dim: int) -> float:
        """Bits per cached value a read touches, codes and scales together."""
        planes = self.read_planes(self.quantize(torch.zeros(1, head_dim)))
        return sum(p.numel() * p.element_size() * 8 for p in planes) / head_dim


class QuantizedKVCache:
    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int, quant: KVQuant,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if max_len < 1 or batch < 1:
            raise ValueError(f"QuantizedKVCache: max_len={max_len} and batch={batch} must both be >= 1")
        self.quant, self.max_len, self.quantized = quant, max_len, 0
        sample = quant.quantize(torch.zeros(1, head_dim, dtype=dtype, device=device))
        shape = (n_layers, batch, n_kv_heads, max_len)
        self.k_planes = tuple(torch.zeros(shape + p.shape[1:], dtype=p.dtype, device=device) for p in sample)
        self.v_planes = tuple(torch.zeros_like(p) for p in self.k_planes)
        self.window = KVCache(n_layers, batch, n_kv_heads, min(max_len, quant.recent + WINDOW_HEADROOM), head_dim,
                              dtype, device)

    @property
    def lengths(self) -> Tensor:
        """[B] committed tokens per sequence (a fresh tensor: the window and the boundary own the state)."""
        return self.window.lengths + self.quantized

    @property
    def batch(self) -> int:
        return self.window.batch

    def reset(self) -> None:
        self.window.reset()
        self.quantized = 0

    def slots(self, n_new: int) -> Tensor:
        longest = int(self.window.lengths.max()) + self.quantized
        self._fit(longest + n_new)
        return self.window.slots(n_new) + self.quantized

    def exact_depth(self) -> int:
        """Most tokens past the root a verify forward may hold so that its deepest query reads the boundary plain
        decoding would: one less than the commits left before the boundary moves (batch 1)."""
        committed = int(self.lengths[0])
        blocks_done = max(committed - self.quant.recent, 0) // self.quant.block
        return self.quant.recent + (blocks_done + 1) * self.quant.block - committed - 1

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor, n_live: int) -> tuple[Tensor, Tensor]:
        """As KVCache.write: new tokens go to the full-precision window; the quantised prefix is read back
        dequantised in front of it."""
        q = self.quantized
        self._fit(n_live)  # drafters place tree slots themselves, without slots()
        keys, values = self.window.write(layer, slots - q, k, v, n_live - q)
        if q == 0:
            return keys, values
        old_k = self.quant.dequantize(tuple(p[layer, :, :, :q] for p in self.k_planes)).to(keys.dtype)
        old_v = self.quant.dequantize(tuple(p[layer, :, :, :q] for p in self.v_planes)).to(values.dtype)
        return torch.cat([old_k, keys], dim=2), torch.cat([old_v, values], dim=2)

    def advance(self, n: int | Tensor) -> None:
        self._fit(int((self.lengths + n).max()))
        self.window.advance(n)
        self._quantize_old()

    def compact(self, keep: list[int] | Tensor) -> None:
        """As KVCache.compact; only window (full-precision) slots move, the codes are never touched."""
        self.window.compact(keep)
        self._quantize_old()

    def _fit(self, n_slots: int) -> None:
        """Make the window reach absolute slot n_slots - 1; a clear error past the cache length."""
        if n_slots > self.max_len:
            raise ValueError(f"QuantizedKVCache: {n_slots} slots exceed the cache length {self.max_len} "
                             "(raise max_seq_len)")
        if n_slots - self.quantized > self.window.max_len:
            self._rewindow(0, n_slots - self.quantized)

    def _quantize_old(self) -> None:
        """Move the committed tokens below the boundary of the shortest sequence into the codes."""
        boundary = max(self.quantized, self.quant.boundary(int(self.lengths.min())))
        n = boundary - self.quantized
        if n == 0:
            return
        q, w = self.quantized, self.window
        for planes, exact in ((self.k_planes, w.k), (self.v_planes, w.v)):
            for plane, codes in zip(planes, self.quant.quantize(exact[:, :, :, :n])):
                plane[:, :, :, q:boundary] = codes
        self._rewindow(n, int(w.lengths.max()) - n)
        self.quantized = boundary

    def _rewindow(self, shift: int, live: int) -> None:
        """A fresh window starting `shift` slots later, with room for `live` slots plus the headroom. Everything
        that fits carries over, tree slots a drafter wrote earlier in the same propose() included."""
        old = self.window
        L, B, H, capacity, D = old.k.shape
        new = KVCache(L, B, H, min(live + WINDOW_HEADROOM, self.max_len - self.quantized - shift), D, old.k.dtype,
                      old.k.device)
        n = min(capacity - shift, new.max_len)
        new.k[:, :, :, :n] = old.k[:, :, :, shift:shift + n]
        new.v[:, :, :, :n] = old.v[:, :, :, shift:shift + n]
        new.lengths.copy_(old.lengths - shift)
        self.window = new


@contextlib.contextmanager
def reading_as(cache: KVCache | QuantizedKVCache, reader: str):
    """Inside, `cache`'s history is read as `reader` reads it (a drafter sharing the target's cache reads the upper
    plane of a hierarchical one); a full-precision cache reads the same for everyone."""
    quant = getattr(cache, "quant", None)
    if quant is None:
        yield
        return
    cache.quant = replace(quant, reader=reader)
    try:
        yield
    finally:
        cache.quant = quant


def new_kv_cache(n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int, quant: KVQuant | None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> KVCache | QuantizedKVCache:
    """A full-precision KVCache when `quant` is None, else a QuantizedKVCache."""
    if quant is None:
        return KVCache(n_layers, batch, n_kv_heads, max_len, head_dim, dtype, device)
    return QuantizedKVCache(n_layers, batch, n_kv_heads, max_len, head_dim, quant, dtype, device)


def kv_cache_as(cache: KVCache | QuantizedKVCache, quant: KVQuant | None) -> KVCache | QuantizedKVCache:
    """`cache` itself if it is already stored as `quant` says, else an empty cache of the same shape that is."""
    if getattr(cache, "quant", None) == quant:
        return cache
    k = cache.window.k if isinstance(cache, QuantizedKVCache) else cache.k
    L, B, H, _, D = k.shape
    return new_kv_cache(L, B, H, cache.max_len, D, quant, k.dtype, k.device)
