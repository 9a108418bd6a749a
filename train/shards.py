"""Resumable work shards and the on-disk cache of target hidden states.

Long prepare work (regeneration, the hidden-state pass) appends finished rows to numbered shards in a work dir,
each written atomically; a killed run is rerun and skips every key already in a shard. `merge_shards` then
yields the rows in key order, so the result does not depend on where a run was interrupted.

The feature cache stores the target's final-norm hidden state for every token of a split, then the residual streams
entering the layers a drafter kind reads (runtime.target.model.ForwardOutput.with_streams; the layers are in each file's
metadata), fp16, flat and aligned with `TokenizedSet.input_ids` (same offsets), in files of about `SHARD_BYTES`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from train.data import TokenizedSet

SHARD_BYTES = 256 << 20
FEATURES_DIR = "features"


@dataclass
class Row:
    key: int  # position of the source item (conversation or row) in the input order
    ids: list[int]
    mask: list[int]
    hidden: torch.Tensor | None = None  # [len(ids), dim]


def _atomic_save(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


@dataclass
class ShardWriter:
    """Buffers finished rows (and keys that produced no row) and writes a shard every `rows_per_shard`."""
    work: Path
    rows_per_shard: int = 64
    rows: list[Row] = field(default_factory=list)
    dropped: dict[int, str] = field(default_factory=dict)  # key -> why

    def __post_init__(self):
        self.work.mkdir(parents=True, exist_ok=True)
        self.next_index = len(list(self.work.glob("shard-*.safetensors")))

    def add(self, row: Row) -> None:
        self.rows.append(row)
        if len(self.rows) >= self.rows_per_shard:
            self.flush()

    def drop(self, key: int, why: str) -> None:
        self.dropped[key] = why

    def flush(self) -> None:
        if not self.rows and not self.dropped:
            return
        ts = TokenizedSet.from_rows([(r.ids, r.mask) for r in self.rows])
        tensors = {"input_ids": ts.input_ids, "loss_mask": ts.loss_mask, "offsets": ts.offsets,
                   "keys": torch.tensor([r.key for r in self.rows], dtype=torch.int64)}
        if self.rows and self.rows[0].hidden is not None:
            tensors["features"] = torch.cat([r.hidden for r in self.rows]).to(torch.float16)
        meta = {"dropped": json.dumps({str(k): v for k, v in self.dropped.items()})}
        _atomic_save(tensors, self.work / f"shard-{self.next_index:05d}.safetensors", meta)
        self.next_index += 1
        self.rows, self.dropped = [], {}


def _shards(work: Path) -> list[Path]:
    return sorted(work.glob("shard-*.safetensors")) if work.is_dir() else []


def done_keys(work: Path) -> set[int]:
    """Keys a previous (possibly killed) run already finished, with or without a row."""
    done: set[int] = set()
    for path in _shards(work):
        with safe_open(str(path), "pt") as f:
            done.update(f.get_tensor("keys").tolist())
            done.update(int(k) for k in json.loads(f.metadata()["dropped"]))
    return done


def merge_shards(work: Path) -> tuple[TokenizedSet, torch.Tensor | None, dict[str, int]]:
    """All shards' rows in key order -> (rows, flat fp16 features or None, count of dropped keys per reason)."""
    rows: list[Row] = []
    dropped: dict[str, int] = {}
    for path in _shards(work):
        t = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            for why in json.loads(f.metadata()["dropped"]).values():
                dropped[why] = dropped.get(why, 0) + 1
        ts = TokenizedSet(t["input_ids"], t["loss_mask"], t["offsets"])
        for i, key in enumerate(t["keys"].tolist()):
            a, b = int(ts.offsets[i]), int(ts.offsets[i + 1])
            hidden = t["features"][a:b] if "features" in t else None
            rows.append(Row(key, ts.input_ids[a:b].tolist(), ts.loss_mask[a:b].tolist(), hidden))
    rows.sort(key=lambda r: r.key)
    merged = TokenizedSet.from_rows([(r.ids, r.mask) for r in rows])
    features = torch.cat([r.hidden for r in rows]) if rows and rows[0].hidden is not None else None
    return merged, features, dropped


def feature_bytes(tokens: int, dim: int) -> int:
    return tokens * dim * 2  # fp16


def save_features(features: torch.Tensor, out_dir: Path, split: str, streams: tuple[int, ...] = ()) -> list[str]:
    """Flat [tokens, (1 + len(streams)) * dim] features (the final hidden state, then the residual streams entering
    the `streams` layers) -> `out_dir/features/<split>-XXXXX.safetensors`; returns the relative paths."""
    d = out_dir / FEATURES_DIR
    d.mkdir(parents=True, exist_ok=True)
    per_part = max(1, SHARD_BYTES // (features.shape[1] * 2))
    names = []
    for i, start in enumerate(range(0, features.shape[0], per_part)):
        name = f"{FEATURES_DIR}/{split}-{i:05d}.safetensors"
        save_file({"features": features[start:start + per_part].to(torch.float16).contiguous()}, str(out_dir / name),
                  metadata={"streams": json.dumps(list(streams))})
        names.append(name)
    return names


def load_features(stage_dir: Path, split: str, expected_tokens: int,
                  streams: tuple[int, ...] = ()) -> torch.Tensor | None:
    """The cached features of a prepare output's split: the final hidden state and the residual streams entering the
    `streams` layers, [tokens, (1 + len(streams)) * dim]; None when it has none (online distillation)."""
    parts = sorted((stage_dir / FEATURES_DIR).glob(f"{split}-*.safetensors"))
    if not parts:
        return None
    with safe_open(str(parts[0]), "pt") as f:
        cached = json.loads((f.metadata() or {}).get("streams", "[]"))
    missing = [k for k in streams if k not in cached]
    if missing:
        raise ValueError(f"{stage_dir / FEATURES_DIR}: the cache holds the streams entering layers {cached}, not "
                         f"{missing}; rerun prepare with --force")
    features = torch.cat([load_file(str(p))["features"] for p in parts])
    if streams != tuple(cached):
        chunks = features.chunk(1 + len(cached), -1)
        features = torch.cat([chunks[0]] + [chunks[1 + cached.index(k)] for k in streams], -1)
    if features.shape[0] != expected_tokens:
        raise ValueError(f"{stage_dir / FEATURES_DIR}: {features.shape[0]} cached feature rows for "
                         f"{expected_tokens} {split} tokens; rerun prepare with --force")
    return features
