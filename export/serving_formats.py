"""Write an EAGLE-1/2 drafter in the layouts serving engines load, so a trained drafter can serve outside our runtime.

Both engines run the same EAGLE draft network: fc([embed(x); feature]) -> one Llama decoder layer whose
input_layernorm is skipped (SafeAILab EAGLE cnets.py, layer 0) -> the target's own lm_head. Embedding and lm_head
always come from the target at load time, so neither format stores them. Our runtime fuses q/k/v (wqkv) and
gate/up (w13); both formats store them un-fused, in HF Llama naming.

- speculators (vllm-project/speculators, src/speculators/models/eagle.py: EagleSpeculatorConfig/EagleSpeculator):
  config.json with speculators_model_type "eagle" and speculators_config; model.safetensors with fusion_fc.* and
  transformer.* (src/speculators/convert/eagle/eagle_converter.py maps fc. -> fusion_fc., layers.0. ->
  transformer.). vLLM's speculators loader (vllm/transformers_utils/configs/speculators/algos.py) registers
  eagle3 and later algorithms, not "eagle": today this directory loads with the speculators library, not vllm.
- SGLang (python/sglang/srt/models/llama_eagle.py: LlamaForCausalLMEagle): config.json with that architecture,
  tensors fc.* and layers.0.* (its LlamaForCausalLM.load_weights stacks q/k/v_proj into qkv_proj and
  gate/up_proj into gate_up_proj). A reduced draft vocabulary travels as the hot-token list SGLang reads with
  --speculative-token-map (eagle_worker.py load_token_map: torch.load(weights_only=True)).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from runtime.eagle import EagleModel
from runtime.model import Block, ModelConfig

CONFIG, WEIGHTS = "config.json", "model.safetensors"
HOT_TOKENS = "hot_token_ids.pt"
ENGINES = ("speculators", "sglang")


def check_exportable(model: EagleModel, engine: str) -> None:
    """Refuse a drafter the engine would run as a different function (a served drafter that silently differs
    from the validated one would lose acceptance the gate measured)."""
    if engine not in ENGINES:
        raise ValueError(f"serving format {engine!r} is not one of {ENGINES}")
    cfg = model.cfg
    if not isinstance(model.block.attention_norm, nn.Identity):
        raise ValueError(f"{engine}: this EAGLE drafter applies an RMSNorm to the fused input before attention, but "
                         "the engine skips layer 0's input_layernorm (EAGLE reference layout); export needs a "
                         "drafter trained without that norm (block.attention_norm = nn.Identity())")
    if cfg.qk_norm or cfg.sliding_window is not None:
        raise ValueError(f"{engine}: a {cfg.arch} drafter layer (qk_norm={cfg.qk_norm}, sliding_window="
                         f"{cfg.sliding_window}) has no Llama-layer equivalent; expected a llama-family target")
    if cfg.qkv_bias != cfg.o_bias:  # Llama's attention_bias puts a bias on q, k, v and o alike
        raise ValueError(f"{engine}: q/k/v bias={cfg.qkv_bias} but o bias={cfg.o_bias}; "
                         "a Llama layer needs both or neither")
    if engine == "sglang" and cfg.mlp_bias:  # sglang's LlamaMLP is built with bias=False
        raise ValueError("sglang: the drafter's MLP has biases, which SGLang's LlamaMLP cannot load")
    if engine == "speculators" and model.head.reduced:
        raise ValueError("speculators: the 'eagle' format drafts over the verifier's full lm_head and has no reduced "
                         f"draft vocabulary (this drafter keeps {model.head.weight.shape[0]} tokens); use sglang")


def llama_layer_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """HF LlamaConfig fields for the drafter's one decoder layer (the inverse of ModelConfig.from_hf)."""
    s = cfg.rope_scaling
    rope_scaling = {"linear": {"rope_type": "linear", "factor": s.factor},
                    "llama3": {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                               "high_freq_factor": s.high_freq_factor,
                               "original_max_position_embeddings": s.original_max_position}}.get(s.kind)
    return {"model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_scaling": rope_scaling, "max_position_embeddings": cfg.max_position_embeddings,
            "attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias,
            # the draft's lm_head is the target's (sliced to the hot tokens): never tied to its embedding
            "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch.")}


def unfused_layer(block: Block, cfg: ModelConfig) -> dict[str, Tensor]:
    """Our fused block as HF Llama decoder-layer tensors, without input_layernorm (the engines skip it)."""
    kv = cfg.n_kv_heads * cfg.head_dim
    parts = [  # (our linear, row split, HF names in split order)
        (block.attention.wqkv, [cfg.n_heads * cfg.head_dim, kv, kv],
         ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
        (block.attention.wo, None, ["self_attn.o_proj"]),
        (block.feed_forward.w13, [cfg.intermediate_size] * 2, ["mlp.gate_proj", "mlp.up_proj"]),
        (block.feed_forward.w2, None, ["mlp.down_proj"]),
    ]
    out = {"post_attention_layernorm.weight": block.ffn_norm.weight}
    for linear, split, names in parts:
        for kind in ("weight", "bias"):
            tensor = getattr(linear, kind)
            if tensor is not None:
                for name, chunk in zip(names, tensor.split(split) if split else (tensor,), strict=True):
                    out[f"{name}.{kind}"] = chunk
    # clone: safetensors refuses tensors that share storage, and split() returns views
    return {k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in out.items()}


def _fc(model: EagleModel) -> dict[str, Tensor]:
    """fc as nn.Linear names (weight [out, in], bias), whatever storage layout the runtime's Linear uses."""
    fc = {"fc.weight": model.fc.weight, "fc.bias": model.fc.bias}
    return {k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in fc.items() if v is not None}


def _write(out: Path, config: dict, tensors: dict[str, Tensor]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(out / WEIGHTS))


def write_speculators_eagle(model: EagleModel, out: str | Path, *, verifier_name_or_path: str,
                            verifier_architectures: Sequence[str], speculative_tokens: int = 5) -> dict:
    """The speculators-library EAGLE directory: config.json + model.safetensors. Returns a manifest record."""
    check_exportable(model, "speculators")
    if isinstance(speculative_tokens, bool) or not isinstance(speculative_tokens, int) or speculative_tokens < 1:
        raise ValueError(f"speculators: speculative_tokens={speculative_tokens!r}, expected an int >= 1")
    out = Path(out)
    layer = llama_layer_config(model.cfg, model.fc.weight.dtype)
    config = {
        "speculators_model_type": "eagle",
        "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
        "transformer_layer_architecture": "LlamaDecoderLayer",
        "transformer_layer_config": layer,
        "layernorms": False,  # no embedding / pre-lm-head norms, and the layer's input_layernorm is an Identity
        "fusion_bias": model.fc.bias is not None,
        "torch_dtype": layer["torch_dtype"],
        "speculators_config": {
            "algorithm": "eagle",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(verifier_architectures)},
        },
    }
    tensors = {f"fusion_{k}": v for k, v in _fc(model).items()}  # fc.* -> fusion_fc.*
    tensors.update({f"transformer.{k}": v for k, v in unfused_layer(model.block, model.cfg).items()})
    _write(out, config, tensors)
    return {"format": "speculators-eagle", "dir": out.name, "files": sorted(p.name for p in out.iterdir())}


def write_sglang_eagle(model: EagleModel, out: str | Path) -> dict:
    """SGLang's EAGLE draft directory, plus the hot-token list when the drafter has a reduced vocabulary.
    Returns a manifest record with the launch flags (paths relative to out's parent)."""
    check_exportable(model, "sglang")
    out = Path(out)
    config = {**llama_layer_config(model.cfg, model.fc.weight.dtype), "architectures": ["LlamaForCausalLMEagle"]}
    tensors = _fc(model)
    tensors.update({f"layers.0.{k}": v for k, v in unfused_layer(model.block, model.cfg).items()})
    _write(out, config, tensors)
    # paths relative to out's parent: the stage renames its temp dir, so absolute paths would go stale
    flags = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", out.name]
    if model.head.reduced:  # SGLang slices the target's lm_head to these rows, as DraftHead does
        torch.save(model.head.keep_ids.tolist(), out / HOT_TOKENS)
        flags += ["--speculative-token-map", f"{out.name}/{HOT_TOKENS}"]
    return {"format": "sglang-eagle", "dir": out.name, "files": sorted(p.name for p in out.iterdir()),
            "launch_flags": flags}
