"""Serving-engine layouts of an EAGLE drafter: the config fields and tensor names each engine loads, un-fused
weights that re-fuse to ours exactly, and a forward pass built the way the engines build it that reproduces ours."""
import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from export.engine_formats import write_engine_export
from runtime.drafters.eagle import HOT_TOKENS, KIND, EagleModel
from runtime.drafters.shared.draft_head import DraftHead
from runtime.target.loading import from_pretrained
from runtime.target.model import RMSNorm
from support.helpers import perturbed
from train.recipes.eagle import build_eagle


VERIFIER = {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}


def write_speculators_eagle(model: EagleModel, out, verifier: dict = VERIFIER, speculative_tokens: int = 5) -> dict:
    return write_engine_export(KIND.engine_exports(model, verifier, speculative_tokens)["speculators-eagle"], out)


def write_sglang_eagle(model: EagleModel, out) -> dict:
    return write_engine_export(KIND.engine_exports(model, VERIFIER)["sglang-eagle"], out)


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return from_pretrained(tiny_llama_dir, max_seq_len=64)


def reference_layout(model: EagleModel, seed: int = 0) -> EagleModel:
    """The EAGLE reference layout the engines run (no input norm before attention), with every weight perturbed."""
    model.block.attention_norm = nn.Identity()
    return perturbed(model, seed=seed)


def hf_layer(layer_config: dict) -> nn.Module:
    """The decoder layer speculators' EagleSpeculator builds (models/eagle.py, layernorms=False); SGLang's
    llama_eagle.py holds the same parameters under layers.0., with input_layernorm deleted."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cfg = LlamaConfig(**layer_config)
    cfg._attn_implementation = "eager"
    layer = LlamaDecoderLayer(cfg, layer_idx=0)
    layer.input_layernorm = nn.Identity()
    return layer.eval()


def engine_forward(out_dir, embed: torch.Tensor, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """EAGLE's draft step as the engines compute it, from nothing but the exported speculators directory."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = json.loads((out_dir / "config.json").read_text())
    tensors = load_file(str(out_dir / "model.safetensors"))
    dim = config["transformer_layer_config"]["hidden_size"]
    fc = nn.Linear(2 * dim, dim, bias=config["fusion_bias"])
    fc.load_state_dict({k.removeprefix("fusion_fc."): v for k, v in tensors.items() if k.startswith("fusion_fc.")})
    layer = hf_layer(config["transformer_layer_config"])
    layer.load_state_dict({k.removeprefix("transformer."): v for k, v in tensors.items()
                           if k.startswith("transformer.")})
    B, T = ids.shape
    h = fc(torch.cat([F.embedding(ids, embed), feats], -1))
    positions = torch.arange(T).expand(B, T)  # engines start at 0, our runtime at 1: RoPE only sees differences
    cos, sin = LlamaRotaryEmbedding(LlamaConfig(**config["transformer_layer_config"]))(h, positions)
    causal = torch.full((T, T), float("-inf")).triu(1).expand(B, 1, T, T)
    out = layer(h, attention_mask=causal, position_ids=positions, position_embeddings=(cos, sin))
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("biased", [False, True])
def test_speculators_forward_reproduces_the_runtime(target, tmp_path, biased):
    if biased:  # a fresh layer with q/k/v/o and MLP biases, so the bias paths are exported and checked too
        cfg = replace(target.config, qkv_bias=True, o_bias=True, mlp_bias=True)
        model = reference_layout(EagleModel(cfg, target.tok_embeddings, DraftHead(target.output.weight), 64))
    else:
        model = reference_layout(build_eagle(target, None))
    write_speculators_eagle(model, tmp_path)
    g = torch.Generator().manual_seed(1)
    ids, feats = torch.randint(0, 96, (2, 7), generator=g), torch.randn(2, 7, 64, generator=g)
    with torch.no_grad():
        ours = model.causal(ids, feats, model.new_cache(2, 7))
        theirs = engine_forward(tmp_path, target.tok_embeddings.weight, ids, feats)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_the_kind_lists_every_layout_it_answers_for(target):
    # export loads the target only for a kind with engine_formats: a layout missing from them would go unwritten
    assert set(KIND.engine_exports(reference_layout(build_eagle(target, None)), VERIFIER)) == set(KIND.engine_formats)


def test_speculators_config_and_tensor_names(target, tmp_path):
    model = reference_layout(build_eagle(target, None))
    verifier = {"name_or_path": "HuggingFaceTB/SmolLM2-135M", "architectures": ["LlamaForCausalLM"]}
    record = write_speculators_eagle(model, tmp_path / "spec", verifier, speculative_tokens=4)
    assert record["files"] == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle" and config["layernorms"] is False
    assert config["fusion_bias"] is True and config["transformer_layer_architecture"] == "LlamaDecoderLayer"
    assert config["architectures"] == ["EagleSpeculator", "LlamaDecoderLayer"]
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle"
    assert spec["default_proposal_method"] in [m["proposal_type"] for m in spec["proposal_methods"]]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4
    assert spec["verifier"] == {"name_or_path": "HuggingFaceTB/SmolLM2-135M", "architectures": ["LlamaForCausalLM"]}
    layer = config["transformer_layer_config"]
    c = target.config
    assert (layer["num_hidden_layers"], layer["hidden_size"], layer["num_attention_heads"],
            layer["num_key_value_heads"], layer["vocab_size"]) == (1, c.dim, c.n_heads, c.n_kv_heads, c.vocab_size)
    tensors = load_file(str(tmp_path / "spec" / "model.safetensors"))
    want = {"fusion_fc.weight": (c.dim, 2 * c.dim), "fusion_fc.bias": (c.dim,)}
    want.update({f"transformer.{k}": tuple(v.shape) for k, v in hf_layer(layer).state_dict().items()})
    assert {k: tuple(v.shape) for k, v in tensors.items()} == want


def test_sglang_config_tensors_and_exact_refusion(target, tmp_path):
    model = reference_layout(build_eagle(target, None))
    record = write_sglang_eagle(model, tmp_path / "sglang")
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["num_hidden_layers"] == 1
    assert config["tie_word_embeddings"] is False and record["launch_flags"][:2] == ["--speculative-algorithm", "EAGLE"]
    tensors = load_file(str(tmp_path / "sglang" / "model.safetensors"))
    layer_names = {f"layers.0.{k}" for k in hf_layer(config).state_dict()}
    assert set(tensors) == {"fc.weight", "fc.bias"} | layer_names
    assert "layers.0.input_layernorm.weight" not in tensors  # llama_eagle.py deletes it for layer 0
    p, b = "layers.0.", model.block
    assert torch.equal(torch.cat([tensors[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]), b.attention.wqkv.weight)
    assert torch.equal(torch.cat([tensors[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")]),
                       b.feed_forward.w13.weight)
    assert torch.equal(tensors[p + "self_attn.o_proj.weight"], b.attention.wo.weight)
    assert torch.equal(tensors[p + "mlp.down_proj.weight"], b.feed_forward.w2.weight)
    assert torch.equal(tensors[p + "post_attention_layernorm.weight"], b.ffn_norm.weight)
    assert torch.equal(tensors["fc.weight"], model.fc.weight) and torch.equal(tensors["fc.bias"], model.fc.bias)


def test_reduced_vocabulary_travels_as_sglang_hot_tokens(target, tmp_path):
    keep = torch.tensor([90, 3, 17, 3, 40])
    model = reference_layout(build_eagle(target, keep))
    record = write_sglang_eagle(model, tmp_path / "sglang")
    assert record["launch_flags"][-2:] == ["--speculative-token-map", f"sglang/{HOT_TOKENS}"]
    hot = torch.load(tmp_path / "sglang" / HOT_TOKENS, weights_only=True)  # as eagle_worker.load_token_map does
    assert hot == [3, 17, 40, 90]
    assert torch.equal(target.output.weight[torch.tensor(hot)], model.head.weight)  # SGLang's head.data[hot]
    with pytest.raises(ValueError, match="no reduced draft vocabulary"):
        write_speculators_eagle(model, tmp_path / "spec")


def test_drafters_the_engines_would_run_differently_are_refused(target, tmp_path):
    with_norm = build_eagle(target, None).eval()
    with_norm.block.attention_norm = RMSNorm(target.config.dim, target.config.norm_eps)  # not what engines run
    with pytest.raises(ValueError, match="input_layernorm"):
        write_sglang_eagle(with_norm, tmp_path / "a")
    embed, head = target.tok_embeddings, DraftHead(target.output.weight)
    for change, match in [({"qk_norm": True}, "no Llama equivalent"), ({"sliding_window": 8}, "no Llama"),
                          ({"qkv_bias": True}, "both or neither")]:
        model = reference_layout(EagleModel(replace(target.config, **change), embed, head, 64))
        for write in (write_sglang_eagle, write_speculators_eagle):
            with pytest.raises(ValueError, match=match):
                write(model, tmp_path / "b")
    biased_mlp = reference_layout(EagleModel(replace(target.config, mlp_bias=True), embed, head, 64))
    with pytest.raises(ValueError, match="LlamaMLP"):
        write_sglang_eagle(biased_mlp, tmp_path / "c")
    with pytest.raises(ValueError, match="speculative_tokens"):
        write_speculators_eagle(reference_layout(build_eagle(target, None)), tmp_path / "d", speculative_tokens=0)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before writing anything
