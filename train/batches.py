"""Deterministic batches from a TokenizedSet: the rows of step s are a pure function of (seed, s).

Resume therefore needs no iterator state, and every rank of a data-parallel run can rebuild the same global
batch and take its own share of rows. Within an epoch rows are shuffled, then sorted by length inside windows
of `bucket` batches, so a batch holds rows of similar length and little compute goes to padding on CPU.
"""
from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from train.data import TokenizedSet

PAD_ID = 0  # any id works: padded positions are outside `lengths` and the loss mask


def _generator(seed: int, epoch: int, purpose: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{epoch}:{purpose}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)


class Batches:
    """`batch_at(step)` -> input_ids [B, T] long (right-padded), loss_mask [B, T] bool, lengths [B] long,
    rows [B] long (dataset row of each batch row), and with cached target `features` (flat [tokens, H], aligned
    with data.input_ids) also features [B, T, H] in their stored dtype."""

    def __init__(self, data: TokenizedSet, batch_size: int, seed: int = 0, bucket: int = 8,
                 features: Tensor | None = None):
        if batch_size < 1 or len(data) < batch_size:
            raise ValueError(f"batch_size={batch_size}: expected 1 <= batch_size <= {len(data)} (rows in the set)")
        if bucket < 1:
            raise ValueError(f"bucket={bucket}: expected >= 1 batches per length-sorting window")
        if features is not None and features.shape[0] != data.input_ids.numel():
            raise ValueError(f"features cover {features.shape[0]} tokens, the data has {data.input_ids.numel()}")
        self.data, self.batch_size, self.seed, self.bucket = data, batch_size, seed, bucket
        self.features = features
        self.lengths = data.offsets[1:] - data.offsets[:-1]
        self.steps_per_epoch = len(data) // batch_size  # the remainder differs every epoch, so no row is lost
        self._epoch: tuple[int, Tensor] | None = None  # memo of the last epoch's [steps_per_epoch, B] row table

    def describe(self) -> dict:
        """What determines the batch sequence; a resumed run must see the same."""
        return {"rows": len(self.data), "tokens": int(self.lengths.sum()), "batch_size": self.batch_size,
                "seed": self.seed, "bucket": self.bucket, "cached_features": self.features is not None}

    def _epoch_rows(self, epoch: int) -> Tensor:
        if self._epoch is None or self._epoch[0] != epoch:
            B, n = self.batch_size, self.steps_per_epoch
            order = torch.randperm(len(self.data), generator=_generator(self.seed, epoch, "rows"))[: n * B]
            window = B * self.bucket
            for start in range(0, n * B, window):  # longest first inside each window: similar lengths per batch
                chunk = order[start:start + window]
                order[start:start + window] = chunk[self.lengths[chunk].argsort(descending=True, stable=True)]
            table = order.view(n, B)
            self._epoch = (epoch, table[torch.randperm(n, generator=_generator(self.seed, epoch, "batches"))])
        return self._epoch[1]

    def batch_at(self, step: int) -> dict[str, Tensor]:
        if step < 0:
            raise ValueError(f"step={step}: expected >= 0")
        rows = self._epoch_rows(step // self.steps_per_epoch)[step % self.steps_per_epoch]
        lengths = self.lengths[rows]
        T = int(lengths.max())
        input_ids = torch.full((len(rows), T), PAD_ID, dtype=torch.long)
        loss_mask = torch.zeros((len(rows), T), dtype=torch.bool)
        for i, r in enumerate(rows.tolist()):
            ids, mask = self.data.row(r)
            input_ids[i, : ids.numel()] = ids
            loss_mask[i, : mask.numel()] = mask
        batch = {"input_ids": input_ids, "loss_mask": loss_mask, "lengths": lengths, "rows": rows}
        if self.features is not None:
            feats = self.features.new_zeros(len(rows), T, self.features.shape[1])
            for i, r in enumerate(rows.tolist()):
                a, b = int(self.data.offsets[r]), int(self.data.offsets[r + 1])
                feats[i, : b - a] = self.features[a:b]
            batch["features"] = feats
        return batch


def shard_rows(batch: dict[str, Tensor], index: int, count: int) -> dict[str, Tensor]:
    """Rows index, index+count, ... of `batch`, trimmed to their longest row.

    Strided rather than contiguous: batch rows are sorted by length, so every shard gets a similar mix."""
    B = batch["input_ids"].shape[0]
    if B % count:
        raise ValueError(f"batch of {B} rows cannot be split into {count} equal shards "
                         f"(micro-batches x ranks); choose a batch size divisible by {count}")
    part = {k: v[index::count] for k, v in batch.items()}
    T = int(part["lengths"].max())
    return {k: v[:, :T] if v.dim() >= 2 else v for k, v in part.items()}  # [B, T, ...] tensors share the time axis
