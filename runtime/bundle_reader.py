"""The one way the runtime reads a drafter bundle: every file hash and the target fingerprint are checked
before anything is loaded. Bundles hold safetensors and JSON only (no pickle).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from runtime.files import read_tensors, sha256_file
from runtime.speculation.draft_budget import ServedBudget
from runtime.target.attention import SpecAttnConfig

FORMAT = "draftsmith-bundle/1"
MANIFEST = "manifest.json"
CONFIG = "drafter_config.json"
WEIGHTS = "drafter.safetensors"
KV_QUANT = "kv_quant.json"  # calibrate's KV-cache scheme (QuantSpec); absent or "none": full-precision KV
NO_KV_QUANT = "none"
DRAFT_BUDGET = "draft_budget.json"  # calibrate's measured draft tree budget; absent: the one the caller configured
LOOKUP_CORPUS = "lookup_corpus.safetensors"  # the lookup branch's corpus (runtime.drafters.ngram.save_corpus); optional
SPECATTN = "specattn.json"  # calibrate's SpecAttn settings; absent or top_p 1.0 (every key): dense verification


class BundleError(ValueError):
    """A bundle that must not be loaded: tampered, truncated, incomplete, or for another target."""


@dataclass(frozen=True)
class Bundle:
    dir: Path
    manifest: dict

    @property
    def drafter_config(self) -> dict:
        return json.loads(self.path(CONFIG).read_text())

    @property
    def kind(self) -> str:
        return self.drafter_config["kind"]

    def has(self, name: str) -> bool:
        return name in self.manifest["files"]

    def path(self, name: str) -> Path:
        if name not in self.manifest["files"]:
            raise BundleError(f"bundle {self.dir}: no file {name!r} in its manifest")
        return self.dir / name

    def kv_settings(self) -> dict:
        """EngineConfig fields for the calibrated KV-cache quantisation: {} when the bundle has none."""
        return kv_engine_fields(json.loads(self.path(KV_QUANT).read_text())) if self.has(KV_QUANT) else {}

    def sparse_settings(self, top_p: float | None = None) -> dict:
        """EngineConfig fields for calibrate's SpecAttn sparse verification: {} where it chose dense (top_p 1.0).
        `top_p` replaces the calibrated one (`pipeline bench --specattn-top-p`)."""
        if not self.has(SPECATTN):
            if top_p is None:
                return {}
            raise BundleError(f"bundle {self.dir}: no {SPECATTN}, so no SpecAttn layer map to verify sparsely with "
                              f"(calibrate writes one for eagle and lm drafters; this one is {self.kind!r})")
        sparse = SpecAttnConfig.from_json(self.path(SPECATTN).read_text())
        if top_p is not None:
            try:
                sparse = replace(sparse, top_p=top_p)
            except ValueError as e:
                raise BundleError(f"SpecAttn top-p {top_p!r}: {e}") from None
        return {"sparse": sparse} if sparse.top_p < 1.0 else {}

    def served_budget(self, fallback: ServedBudget) -> ServedBudget:
        """The draft budget calibrate measured fastest on this machine; `fallback` for a bundle without one."""
        if not self.has(DRAFT_BUDGET):
            return fallback
        return ServedBudget.from_dict(json.loads(self.path(DRAFT_BUDGET).read_text())["chosen"])

    def device_candidates(self) -> list[tuple[ServedBudget, float]]:
        """The budgets calibrate measured tau for on every prompt, with that tau, for a device to time and choose
        among (runtime.serving.budget_tuner); [] for bundles without them."""
        rows = json.loads(self.path(DRAFT_BUDGET).read_text()).get("device_candidates", []) \
            if self.has(DRAFT_BUDGET) else []
        return [(ServedBudget.from_dict(row), row["tau"]) for row in rows]

    def budget_sweep(self) -> list[dict]:
        """Calibrate's timed budgets (draft_budget.json's sweep: tau, tokens/s); [] for bundles without them."""
        return json.loads(self.path(DRAFT_BUDGET).read_text()).get("sweep", []) if self.has(DRAFT_BUDGET) else []

    def engine_fields(self, budget: ServedBudget, specattn_top_p: float | None = None) -> dict:
        """EngineConfig fields the bundle runs with under `budget`: the calibrated KV scheme and SpecAttn (at
        `specattn_top_p` instead of the calibrated top-p, where given), and the lookup corpus the budget's branch
        drafts from, where the bundle has one."""
        fields = budget.engine_fields() | self.kv_settings() | self.sparse_settings(specattn_top_p)
        corpus = self.lookup_corpus(budget.lookup)
        return fields if corpus is None else fields | {"lookup_corpus": corpus}

    def lookup_corpus(self, lookup: int):
        """The lookup branch's corpus trie for a branch of `lookup` nodes (runtime.drafters.ngram.NgramDrafter); None
        without a branch or a corpus."""
        if not lookup or not self.has(LOOKUP_CORPUS):
            return None
        from runtime.drafters.ngram import load_corpus

        return load_corpus(self.path(LOOKUP_CORPUS), max_depth=lookup)

    def tensors(self, name: str = WEIGHTS) -> dict:
        """The file's tensors in memory of their own (read_tensors): a drafter built from them keeps none of the
        file's pages resident."""
        return read_tensors(self.path(name))


def kv_engine_fields(kv_quant: dict) -> dict:
    """EngineConfig fields for a kv_quant.json report: {} when it chose full precision."""
    chosen = kv_quant["chosen"]
    return {} if chosen == NO_KV_QUANT else {"kv_scheme": chosen, "kv_recent": kv_quant["recent"]}


def _safe_member(root: Path, name: str) -> Path:
    p = Path(name)
    if p.is_absolute() or ".." in p.parts or not name:
        raise BundleError(f"bundle {root}: manifest names {name!r}, a path outside the bundle directory")
    full = (root / p).resolve()
    if root.resolve() not in full.parents:
        raise BundleError(f"bundle {root}: manifest names {name!r}, which resolves outside the bundle directory")
    return full


def read_bundle(path: str | Path, expect_target_fingerprint: str | None = None) -> Bundle:
    root = Path(path)
    mf = root / MANIFEST
    if not mf.is_file():
        raise BundleError(f"bundle {root}: no {MANIFEST} (not a bundle directory?)")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise BundleError(f"bundle {root}: {MANIFEST} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"bundle {root}: {MANIFEST} format is not {FORMAT!r}")
    files = manifest.get("files")
    if not isinstance(files, dict) or CONFIG not in files:
        raise BundleError(f"bundle {root}: {MANIFEST} must list files including {CONFIG}")
    for name, want in files.items():
        full = _safe_member(root, name)
        if not full.is_file():
            raise BundleError(f"bundle {root}: {name} is listed in the manifest but missing")
        got = sha256_file(full)
        if got != want:
            raise BundleError(f"bundle {root}: {name} has sha256 {got[:12]}..., manifest says {str(want)[:12]}... "
                              "(tampered or truncated)")
    fp = manifest.get("target_fingerprint")
    if expect_target_fingerprint is not None and fp != expect_target_fingerprint:
        raise BundleError(f"bundle {root}: built for target {str(fp)[:12]}..., but the target given is "
                          f"{expect_target_fingerprint[:12]}...")
    return Bundle(root, manifest)
