"""Static, pre-allocated KV cache with per-sequence lengths.

Slot s of sequence b holds the token at position s: everything below `lengths[b]` is committed. A forward
writes its T new tokens at slots lengths[b]..lengths[b]+T-1 without advancing; the caller then either
`advance`s (plain decoding, prefill) or `compact`s (speculative verify: only the accepted path survives).
Target and KV-holding drafters (EAGLE, LM) share this class.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if max_len < 1 or batch < 1:
            raise ValueError(f"KVCache: max_len={max_len} and batch={batch} must both be >= 1")
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.rows = torch.arange(batch, device=device)[:, None]  # batch index for advanced indexing

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def row(self, b: int) -> "KVCache":
        """Sequence b as a batch-1 cache over the same storage: continuous batching prefills one row while the
        others keep their state."""
        return self.rows_view(b, b + 1)

    def rows_view(self, start: int, stop: int) -> "KVCache":
        """Sequences start..stop-1 as a cache over the same storage (writes, advances and resets land here)."""
        if not 0 <= start < stop <= self.batch:
            raise ValueError(f"KVCache: rows {start}..{stop - 1} outside the batch of {self.batch}")
        view = KVCache.__new__(KVCache)
        view.k, view.v = self.k[:, start:stop], self.v[:, start:stop]
        view.lengths, view.rows = self.lengths[start:stop], self.rows[:stop - start]
        return view

    def move_row(self, src: int, dst: int) -> None:
        """Sequence src's committed slots and length to row dst; row src is left empty."""
        n = int(self.lengths[src])
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst], self.lengths[src] = n, 0

    def reset(self) -> None:
        self.lengths.zero_()

    def slots(self, n_new: int) -> torch.Tensor:
        """[B, n_new] slots the next forward writes; a clear error when they do not fit."""
        longest = int(self.lengths.max())
        if longest + n_new > self.max_len:
            raise ValueError(f"KVCache: {n_new} new tokens after {longest} cached ones exceed the cache "
                             f"length {self.max_len} (raise max_seq_len)")
        return self.lengths[:, None] + torch.arange(n_new, device=self.lengths.device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              n_live: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, T, kv_heads, head_dim] at `slots` [B, T]; return the live keys and values
        [B, kv_heads, n_live, head_dim] (slicing to the live length is what keeps short contexts cheap)."""
        self.k[layer][self.rows, :, slots] = k
        self.v[layer][self.rows, :, slots] = v
        return self.k[layer, :, :, :n_live], self.v[layer, :, :, :n_live]

    def advance(self, n: int | torch.Tensor) -> None:
        """Commit the first n written slots (an int for every sequence, or a [B] tensor)."""
        lengths = self.lengths + n
        if int(lengths.max()) > self.max_len:
            raise ValueError(f"KVCache: advancing by {n} overflows the cache length {self.max_len}")
        self.lengths.copy_(lengths)

    def compact(self, keep: list[int] | torch.Tensor) -> None:
        """Keep only the written slots at offsets `keep` [k] (ascending, relative to each sequence's length):
        they move, in place and in every layer, to offsets 0..k-1; lengths advance by k. The offsets are checked
        on the host, so on a GPU this waits for the device at most twice (the bounds check, and the offsets' copy
        where rows move), not once per check."""
        keep = keep.tolist() if isinstance(keep, torch.Tensor) else list(keep)
        n = len(keep)
        if any(b <= a for a, b in zip(keep, keep[1:])) or (n and keep[0] < 0):
            raise ValueError(f"KVCache.compact: keep offsets must be ascending and >= 0, got {keep}")
        if n and int(self.lengths.max()) + keep[-1] >= self.max_len:
            raise ValueError(f"KVCache.compact: offset {keep[-1]} lies beyond the cache length {self.max_len}")
        if keep != list(range(n)):  # a chain's accepted prefix is already in place: nothing to copy
            src_slots = self.lengths[:, None] + torch.tensor(keep, device=self.lengths.device)
            dst_slots = self.lengths[:, None] + torch.arange(n, device=self.lengths.device)
            for cache in (self.k, self.v):
                # advanced indexing on the right makes a copy first, so overlapping moves are safe
                cache[:, self.rows, :, dst_slots] = cache[:, self.rows, :, src_slots]
        self.lengths += n
