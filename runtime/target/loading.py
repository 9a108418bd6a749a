"""HF transformers checkpoints <-> our fused layout: q/k/v fused into wqkv and gate/up into w13 at load, split again
for HF, for engines' drafter formats and for HF models built from ours (benchmarks, assisted generation)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Collection

import torch
from torch import Tensor

from runtime.files import SafetensorsReader
from runtime.target.cpu_packing import pack_for_cpu
from runtime.target.model import Transformer
from runtime.target.model_config import ModelConfig

# our fused linears -> the HF linears they hold, in the order they are stacked
LINEARS = {"attention.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "attention.wo": ("self_attn.o_proj",), "feed_forward.w13": ("mlp.gate_proj", "mlp.up_proj"),
           "feed_forward.w2": ("mlp.down_proj",)}
NORMS = {"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
         "attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight"}


def _split_sizes(cfg: ModelConfig, linear: str) -> list[int] | None:
    kv = cfg.n_kv_heads * cfg.head_dim
    return {"attention.wqkv": [cfg.n_heads * cfg.head_dim, kv, kv],
            "feed_forward.w13": [cfg.intermediate_size] * 2}.get(linear)


def hf_layer_tensors(block: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """One decoder block's tensors (our names, without the `layers.i.` prefix) under HF Llama names, fused matrices
    split again; a norm the block does not have (an Identity) is simply absent. Contiguous copies: safetensors
    refuses views that share storage."""
    out = {}
    for name, tensor in block.items():
        linear, _, kind = name.rpartition(".")
        if linear in LINEARS:
            sizes = _split_sizes(cfg, linear)
            for hf_name, part in zip(LINEARS[linear], tensor.split(sizes) if sizes else (tensor,), strict=True):
                out[f"{hf_name}.{kind}"] = part
        elif name in NORMS:
            out[NORMS[name]] = tensor
        else:
            raise ValueError(f"no HF name for block tensor {name!r}")
    return {k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in out.items()}


def _our_layer(cfg: ModelConfig, take) -> dict[str, Tensor]:
    """The inverse of hf_layer_tensors for one layer: `take(hf_name)` pops a tensor or raises."""
    biased = {"attention.wqkv": cfg.qkv_bias, "attention.wo": cfg.o_bias, "feed_forward.w13": cfg.mlp_bias,
              "feed_forward.w2": cfg.mlp_bias}
    norms = [n for n in NORMS if cfg.qk_norm or "q_norm" not in n and "k_norm" not in n]
    sd = {name: take(NORMS[name]) for name in norms}
    for linear, hf_names in LINEARS.items():
        for kind in ("weight", "bias") if biased[linear] else ("weight",):
            sd[f"{linear}.{kind}"] = torch.cat([take(f"{n}.{kind}") for n in hf_names])
    return sd


def load_hf_state_dict(path: Path, cfg: ModelConfig,
                       place_layer: Callable[[int, dict[str, Tensor]], None] | None = None,
                       dtype: torch.dtype | None = None, blocks: Collection[int] | None = None) -> dict[str, Tensor]:
    """Read every *.safetensors shard and rename/fuse HF tensors into this module's layout, each cast to `dtype` as
    it is read where given. `place_layer(i, tensors)`, if given, takes each block's tensors as soon as they are read
    (they are then left out): a lean load packs each block before the next is read. `blocks`: the blocks to read
    (None: all); the others are left unread."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weights")
    reader = SafetensorsReader(files)  # not mapped: the fused-away and lean-packed originals really go
    hf = {k.removeprefix("model."): k for k in reader.names() if not k.endswith("rotary_emb.inv_freq")}

    def take(name: str) -> Tensor:
        if name not in hf:
            raise ValueError(f"{path}: weight {name!r} is missing for a {cfg.arch} model")
        return reader.read(hf.pop(name), dtype)

    sd = {"tok_embeddings.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")}
    if cfg.tie_embeddings:
        hf.pop("lm_head.weight", None)  # some tied checkpoints store a copy
        sd["output.weight"] = sd["tok_embeddings.weight"]
    else:
        sd["output.weight"] = take("lm_head.weight")
    for i in range(cfg.n_layers):
        if blocks is not None and i not in blocks:
            hf = {k: v for k, v in hf.items() if not k.startswith(f"layers.{i}.")}
            continue
        layer = _our_layer(cfg, lambda name, i=i: take(f"layers.{i}.{name}"))
        if place_layer is not None:
            place_layer(i, layer)
        else:
            sd |= {f"layers.{i}.{k}": v for k, v in layer.items()}
    if hf:
        raise ValueError(f"{path}: unexpected weights for a {cfg.arch} model: {sorted(hf)[:5]}")
    return sd


def hf_rope(cfg: ModelConfig) -> dict:
    """transformers >= 5's `rope_parameters` for `cfg`."""
    s = cfg.rope_scaling
    rope = {"rope_type": s.kind, "rope_theta": cfg.rope_theta}
    if s.kind != "default":
        rope["factor"] = s.factor
    if s.kind == "llama3":
        rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position)
    return rope


def hf_config(cfg: ModelConfig) -> dict:
    """config.json fields for HF transformers: the inverse of ModelConfig.from_hf."""
    hf = {"model_type": cfg.arch, "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
          "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
          "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.norm_eps,
          "hidden_act": "silu", "rope_parameters": hf_rope(cfg), "max_position_embeddings": cfg.max_position_embeddings,
          "tie_word_embeddings": cfg.tie_embeddings, "mlp_bias": cfg.mlp_bias}
    if cfg.arch != "qwen2":  # qwen2's q/k/v biases are implied by the architecture
        hf["attention_bias"] = cfg.o_bias
    if cfg.arch == "mistral":
        hf["sliding_window"] = cfg.sliding_window
    return hf


def hf_state_dict(model: Transformer) -> dict[str, Tensor]:
    """The inverse of load_hf_state_dict: this module's weights under HF names. A tied lm_head is left out, as HF
    checkpoints store it once (as the embedding)."""
    cfg, sd = model.config, model.state_dict()
    hf = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"]}
    if not cfg.tie_embeddings:
        hf["lm_head.weight"] = sd["output.weight"]
    for i in range(cfg.n_layers):
        prefix = f"layers.{i}."
        block = {k.removeprefix(prefix): v for k, v in sd.items() if k.startswith(prefix)}
        hf |= {f"model.layers.{i}.{k}": v for k, v in hf_layer_tensors(block, cfg).items()}
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


def llama_layer_problem(cfg: ModelConfig) -> str | None:
    """Why one of our decoder blocks of `cfg` cannot be written as an HF Llama decoder layer; None if it can."""
    if cfg.qk_norm or cfg.sliding_window is not None:
        return (f"a {cfg.arch} layer (qk_norm={cfg.qk_norm}, sliding_window={cfg.sliding_window}) has no Llama "
                "equivalent; expected a llama-family target")
    if cfg.qkv_bias != cfg.o_bias:  # Llama's attention_bias puts a bias on q, k, v and o alike
        return f"q/k/v bias={cfg.qkv_bias} but o bias={cfg.o_bias}; a Llama layer has both or neither"
    return None


def llama_layer_names(cfg: ModelConfig, input_norm: bool = True) -> tuple[str, ...]:
    """The tensor names of one HF Llama decoder layer of `cfg`, as an engine's loader maps them."""
    names = ["post_attention_layernorm.weight"] + ["input_layernorm.weight"] * input_norm
    for linear, hf_names in LINEARS.items():
        biased = cfg.mlp_bias if linear.startswith("feed_forward") else cfg.qkv_bias
        names += [f"{n}.{kind}" for n in hf_names for kind in ("weight", "bias")[:1 + biased]]
    return tuple(sorted(names))


def llama_layer_config(cfg: ModelConfig, dtype: torch.dtype, n_layers: int = 1) -> dict:
    """HF LlamaConfig fields of a drafter's decoder layers, with the rope settings spelled as serving engines
    (on transformers 4) read them: rope_theta and rope_scaling."""
    s = cfg.rope_scaling
    rope_scaling = None if s.kind == "default" else {k: v for k, v in hf_rope(cfg).items() if k != "rope_theta"}
    return {"model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_scaling": rope_scaling, "max_position_embeddings": cfg.max_position_embeddings,
            "attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias,
            # a drafter's lm_head is the target's (or its rows of the draft vocabulary): never tied to an embedding
            "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch.")}


def from_pretrained(path: str | Path, dtype: torch.dtype = torch.float32, max_seq_len: int | None = None,
                    device: torch.device | str = "cpu", lean: bool = False,
                    plain_blocks: tuple[int, ...] = (), packed: bool = True,
                    blocks: Collection[int] | None = None) -> Transformer:
    """The target from an HF checkpoint directory, in `dtype` on `device`, packed for the CPU's kernels (not where
    `packed` is False: a model to train, whose packed copies would go stale); `lean`: for inference only, one copy of
    each weight (Transformer.pack_for_cpu) but in `plain_blocks`, which keep their plain weights beside it (a
    drafter initialised from those blocks reads them). `blocks` (lean only): the blocks to read, None all; the
    others stay unread on the meta device (a teacher whose features prepare cached reads its head alone), so that
    running them forward fails."""
    path = Path(path)
    if blocks is not None and not lean:
        raise ValueError("from_pretrained: blocks= leaves blocks unread, which only a lean load allows")
    cfg = ModelConfig.from_dir(path)
    max_seq_len = max_seq_len or min(cfg.max_position_embeddings, 4096)
    if max_seq_len > cfg.max_position_embeddings:
        raise ValueError(f"{path}: max_seq_len {max_seq_len} exceeds the model's context of "
                         f"max_position_embeddings={cfg.max_position_embeddings}")
    model = Transformer.empty(cfg, max_seq_len)

    def place(i: int, layer: dict[str, Tensor]) -> None:  # lean: one block's plain weights at a time
        block = model.layers[i]
        block.load_state_dict(layer, assign=True)
        block.to(device=device, dtype=dtype).requires_grad_(False)
        if i not in plain_blocks:  # a plain block is packed with the rest, at the end
            pack_for_cpu(block, lean=True)

    rest = load_hf_state_dict(path, cfg, place if lean else None, dtype, blocks)
    model.load_state_dict(rest, assign=True, strict=not lean)
    if cfg.tie_embeddings:  # assign=True made two parameters; re-tie so the table exists (and casts) once
        model.output.weight = model.tok_embeddings.weight
    # lean, the blocks are in place already: their plain weights are meta tensors, which .to() cannot copy
    for part in (model.tok_embeddings, model.norm, model.output) if lean else (model,):
        part.to(device=device, dtype=dtype)
    if lean:
        model.rope_cos, model.rope_sin = (t.to(device=device, dtype=dtype) for t in (model.rope_cos, model.rope_sin))
    plain = tuple(m for i in plain_blocks if lean for m in model.layers[i].modules())
    model.eval().requires_grad_(False)
    return model.pack_for_cpu(lean, keep_plain=plain) if packed else model
