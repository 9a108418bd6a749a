"""EAGLE-1/2 drafter: one decoder block over fc([token embedding; feature]), predicting the next feature (the
target's final hidden state); the target's frozen lm_head (optionally a reduced draft vocabulary) turns features into
tokens. The pair layout, the Drafter and the ONNX step are runtime/drafters/shared/eagle_drafting.py's.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from runtime.drafters.shared.draft_head import DraftHead
from runtime.drafters.shared.eagle_drafting import EagleBase, EagleFamily, open_circuit, residual, speculators_config
from runtime.speculation.drafter import EngineExport
from runtime.target.cpu_packing import Linear
from runtime.target.loading import hf_layer_tensors, llama_layer_config, llama_layer_names, llama_layer_problem
from runtime.target.model import Block, Embedding, Transformer
from runtime.target.model_config import ModelConfig


@dataclass(frozen=True)
class EagleConfig:
    draft_vocab: int = 0  # 0: the full target vocabulary; else the size of the reduced draft vocabulary

    def to_dict(self) -> dict:
        return {"kind": "eagle", **asdict(self)}


class EagleModel(EagleBase):
    def __init__(self, target_cfg: ModelConfig, embedding: Embedding, head: DraftHead, max_seq_len: int):
        super().__init__(target_cfg, embedding, head, max_seq_len)
        dim = self.cfg.dim
        self.fc = Linear(2 * dim, dim, bias=True)
        self.block = Block(self.cfg)
        # EAGLE, SGLang's LlamaForCausalLMEagle and vLLM speculators all skip the block's input norm (the fc
        # output feeds attention directly); keeping it would make every served copy compute something else.
        self.block.attention_norm = nn.Identity()

    @staticmethod
    def from_target(target: Transformer, head: DraftHead) -> "EagleModel":
        """Start from the target's last block and an fc that passes the feature through, with the block's two
        residual-branch outputs (wo, w2) zeroed: the untrained drafter is exactly the identity on the feature.
        The target's last block fed its own final-norm output instead of its residual stream returns values in
        the hundreds, which the training-time unroll would feed back into itself; from the identity the
        branches open gradually, and their inner weights keep the target's head start."""
        m = EagleModel(target.config, target.tok_embeddings, head, target.max_seq_len)
        last = {k: v for k, v in target.layers[-1].state_dict().items() if not k.startswith("attention_norm.")}
        m.block.load_state_dict(last)
        dim = target.config.dim
        with torch.no_grad():
            m.fc.weight.zero_()
            m.fc.weight[:, dim:] = torch.eye(dim)
            m.fc.bias.zero_()
        open_circuit(m.block)
        return m.to(target.dtype)

    def step(self, tokens, features, positions, cache, slots, n_live, mask, want_weights=False, rows=None):
        x = self.fc(torch.cat([self.embedding(tokens), features.to(self.fc.weight.dtype)], -1))
        b = self.block
        h, weights = b.attention(b.attention_norm(x), 0, cache, slots, n_live, mask, *self.rope(positions),
                                 want_weights, rows=rows)
        x = residual(x, rows) + h
        return x + b.feed_forward(b.ffn_norm(x)), weights


class EagleKind(EagleFamily):
    """Engines run the same EAGLE network: fc([embed(x); feature]) -> one Llama decoder layer without its
    input_layernorm -> the target's lm_head; embedding and lm_head come from the target at load time, so neither
    format stores them. speculators' `eagle` (src/speculators/models/eagle.py) loads with the speculators library;
    vLLM registers only eagle3 and later. SGLang's LlamaForCausalLMEagle (python/sglang/srt/models/llama_eagle.py)
    reads fc.* and layers.0.*, and a reduced draft vocabulary as the hot-token list of --speculative-token-map."""

    name = "eagle"
    module_type = EagleModel
    onnx_inputs, onnx_outputs = ("input_ids", "features"), ("next_features", "logits")
    engine_formats = ("sglang-eagle", "speculators-eagle")

    def config(self, module, draft_vocab, settings):
        return EagleConfig(draft_vocab).to_dict()

    def module(self, config, target, max_len, keep_ids):
        return EagleModel(target.config, target.tok_embeddings, DraftHead(target.output, keep_ids),
                          max_len)

    def engine_exports(self, module, verifier, speculative_tokens=5):
        speculators = speculators_config("eagle", verifier, speculative_tokens)
        cfg = module.cfg
        problem = llama_layer_problem(cfg) or (None if isinstance(module.block.attention_norm, nn.Identity) else
                                               "its block applies input_layernorm to the fused input, which the "
                                               "engines skip for layer 0 (EAGLE's reference layout)")
        if problem:
            return dict.fromkeys(self.engine_formats, problem)
        layer = hf_layer_tensors(module.block.state_dict(), cfg)
        fc = {k: v.detach().clone() for k, v in module.fc.state_dict().items()}
        names = llama_layer_names(cfg, input_norm=False)
        fc_names = ("weight", "bias")[:1 + (module.fc.bias is not None)]
        hf_layer = llama_layer_config(cfg, module.fc.weight.dtype)
        out: dict[str, EngineExport | str] = {}
        out["sglang-eagle"] = "SGLang's LlamaMLP has no biases" if cfg.mlp_bias else EngineExport(
            "sglang-eagle", {**hf_layer, "architectures": ["LlamaForCausalLMEagle"]},
            {f"fc.{k}": v for k, v in fc.items()} | {f"layers.0.{k}": v for k, v in layer.items()},
            tuple(f"fc.{n}" for n in fc_names) + tuple(f"layers.0.{n}" for n in names),
            files=_hot_tokens(module.head),
            launch_flags=("--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "{dir}")
            + ("--speculative-token-map", f"{{dir}}/{HOT_TOKENS}") * module.head.reduced)
        out["speculators-eagle"] = (
            f"the speculators `eagle` format drafts over the verifier's whole lm_head: it has no reduced draft "
            f"vocabulary (this drafter keeps {module.head.weight.shape[0]} tokens)") if module.head.reduced else \
            EngineExport("speculators-eagle", _speculators_eagle_config(hf_layer, module, speculators),
                         {f"fusion_fc.{k}": v for k, v in fc.items()} | {f"transformer.{k}": v for k, v in layer.items()},
                         tuple(f"fusion_fc.{n}" for n in fc_names) + tuple(f"transformer.{n}" for n in names))
        return out


HOT_TOKENS = "hot_token_ids.pt"  # SGLang's --speculative-token-map: torch.load(weights_only=True) of a list


def _hot_tokens(head: DraftHead) -> dict[str, bytes]:
    if not head.reduced:
        return {}
    import io

    buffer = io.BytesIO()
    torch.save(head.keep_ids.tolist(), buffer)
    return {HOT_TOKENS: buffer.getvalue()}


def _speculators_eagle_config(layer: dict, module: EagleModel, speculators: dict) -> dict:
    return {"speculators_model_type": "eagle", "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
            "transformer_layer_architecture": "LlamaDecoderLayer", "transformer_layer_config": layer,
            "layernorms": False,  # no embedding or pre-lm-head norms, and the layer's input_layernorm is skipped
            "fusion_bias": module.fc.bias is not None, "torch_dtype": layer["torch_dtype"],
            "speculators_config": speculators}


KIND = EagleKind()
