"""A decoder's shape, read from an HF config.json: the families supported and the one-line errors for those that are not."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
# config.json fields a model of any family needs; the rest have defaults
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                   "rms_norm_eps")


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
    def from_dir(path: str | Path) -> "ModelConfig":
        """The config of an HF model directory."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: no config.json (expected an HF model directory)")
        try:
            hf = json.loads((path / "config.json").read_text())
        except ValueError as e:
            raise ValueError(f"{path / 'config.json'} is not valid JSON ({e})") from None
        if not isinstance(hf, dict):
            raise ValueError(f"{path / 'config.json'} is not a JSON object")
        return ModelConfig.from_hf(hf)

    @staticmethod
    def from_hf(hf: dict) -> "ModelConfig":
        arch = hf.get("model_type")
        if arch is None:
            raise ValueError("config.json has no model_type (expected a causal LM's HF config)")
        if arch not in ARCHITECTURES:
            raise ValueError(f"model_type {arch!r} is not supported; expected one of {ARCHITECTURES}")
        missing = [k for k in REQUIRED_FIELDS if hf.get(k) is None]
        if missing:
            raise ValueError(f"config.json of a {arch} model lacks {', '.join(missing)}")
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


def context_error(prompt_tokens: int, max_new_tokens: int, limit: int, what: str) -> str | None:
    """None where a prompt and max_new_tokens new tokens fit `limit` positions (every token but the last generated
    one passes through the cache), else the one-line error; `what` names the limit."""
    if prompt_tokens + max_new_tokens - 1 <= limit:
        return None
    return f"prompt of {prompt_tokens} tokens + max_new_tokens={max_new_tokens} does not fit {what}={limit}"
