"""EAGLE-3 drafter: the target's residual streams entering three layers (low, middle, high; by default 2, L/2 and
L-3) fused by fc (3H -> H), one decoder layer whose q/k/v read [norm(token embedding); norm(fused)] (2H), and a
trained head (final norm + lm_head over a reduced draft vocabulary) that predicts tokens, not features. Tree nodes
carry the layer's own output in place of the fused streams (training-time test). The pair layout and the Drafter are
runtime/drafters/shared/eagle_drafting.py's.

Layer ids here are the residual stream *entering* a layer, as vLLM and speculators count; SGLang and SpecForge count
a layer's *output* (id - 1). Each engine format is written in its own convention: off by one, acceptance drops
without an error. The layer's attention residual is the raw fused stream (`norm_before_residual` false), which every
engine computes; speculators' configs say so explicitly, since vLLM assumes true when the key is absent.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.drafters.shared.draft_head import DraftHead
from runtime.drafters.shared.eagle_drafting import EagleBase, EagleFamily, open_circuit, residual, speculators_config
from runtime.speculation.drafter import EngineExport
from runtime.target.cpu_packing import Linear
from runtime.target.loading import hf_layer_tensors, llama_layer_config, llama_layer_names, llama_layer_problem
from runtime.target.model import Block, Embedding, RMSNorm, Transformer
from runtime.target.model_config import ModelConfig

AUX = 3  # low, middle and high streams


def default_aux_layers(n_layers: int) -> tuple[int, ...]:
    return 2, n_layers // 2, n_layers - 3


def aux_layers(requested, n_layers: int) -> tuple[int, ...]:
    """The layers whose entering residual streams an EAGLE-3 drafter of a target `n_layers` deep fuses: `requested`
    (ascending, distinct, each 1..n_layers), or EAGLE-3's default; ValueError in one line otherwise."""
    if requested is None:
        layers = default_aux_layers(n_layers)
        if len(set(layers)) < AUX or min(layers) < 1:
            raise ValueError(f"a target of {n_layers} layers is too shallow for EAGLE-3's three distinct layers "
                             f"(2, L/2, L-3 = {layers}); expected at least 7 layers, or drafter.aux_layers")
        return layers
    layers = tuple(requested)
    if len(layers) != AUX or len(set(layers)) != AUX or list(layers) != sorted(layers):
        raise ValueError(f"drafter.aux_layers={list(layers)}: expected {AUX} distinct ascending layer ids")
    outside = [k for k in layers if not 1 <= k <= n_layers]
    if outside:
        raise ValueError(f"drafter.aux_layers={list(layers)}: {outside} outside the target's layers 1..{n_layers} "
                         "(the residual stream entering layer k)")
    return layers


@dataclass(frozen=True)
class Eagle3Config:
    aux_layers: tuple[int, ...]  # residual streams entering these target layers, ascending
    target_layers: int  # the depth of the target they index
    draft_vocab: int = 0  # 0: the full target vocabulary; else the size of the reduced draft vocabulary

    def to_dict(self) -> dict:
        return {"kind": "eagle3", "aux_layers": list(self.aux_layers), "target_layers": self.target_layers,
                "draft_vocab": self.draft_vocab}

    @staticmethod
    def from_dict(config: dict, target_layers: int) -> "Eagle3Config":
        """A saved config for a target `target_layers` deep; ValueError where its layer ids index another depth."""
        if config["target_layers"] != target_layers:
            raise ValueError(f"eagle3 layer ids {config['aux_layers']} were chosen for a target of "
                             f"{config['target_layers']} layers, this one has {target_layers}")
        return Eagle3Config(aux_layers(config["aux_layers"], target_layers), target_layers,
                            int(config.get("draft_vocab", 0)))


class Eagle3Model(EagleBase):
    def __init__(self, target_cfg: ModelConfig, embedding: Embedding, head: DraftHead, layers: tuple[int, ...],
                 max_seq_len: int):
        super().__init__(target_cfg, embedding, head, max_seq_len)
        c, dim = self.cfg, self.cfg.dim
        self.aux_layers, self.target_layers = layers, target_cfg.n_layers
        self.fc = Linear(AUX * dim, dim, bias=False)
        self.hidden_norm = RMSNorm(dim, c.norm_eps)
        self.block = Block(c)  # attention_norm normalises the token embedding: the layer's input_layernorm
        self.block.attention.wqkv = Linear(2 * dim, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, bias=c.qkv_bias)

    @staticmethod
    def from_target(target: Transformer, keep_ids: Tensor | None, layers: tuple[int, ...]) -> "Eagle3Model":
        """Start as an early exit of the target: fc passes the high stream through, the block is the target's last
        with its q/k/v reading the fused half and its two residual-branch outputs zeroed, and the head is the
        target's final norm and lm_head rows. Training opens the branches from there."""
        c = target.config
        head = DraftHead(target.output, keep_ids, norm=RMSNorm(c.dim, c.norm_eps))
        m = Eagle3Model(c, target.tok_embeddings, head, layers, target.max_seq_len)
        last = target.layers[-1]
        with torch.no_grad():
            m.head.norm.weight.copy_(target.norm.weight)
            m.fc.weight.zero_()
            m.fc.weight[:, (AUX - 1) * c.dim:] = torch.eye(c.dim)
            m.block.load_state_dict({k: v for k, v in last.state_dict().items() if not k.startswith("attention.wqkv")},
                                    strict=False)
            qkv = m.block.attention.wqkv
            qkv.weight.zero_()
            qkv.weight[:, c.dim:] = last.attention.wqkv.weight
            if qkv.bias is not None:
                qkv.bias.copy_(last.attention.wqkv.bias)
            m.hidden_norm.weight.copy_(last.attention_norm.weight)
        open_circuit(m.block)
        return m.to(target.dtype)

    def step(self, tokens, features, positions, cache, slots, n_live, mask, want_weights=False, rows=None):
        # committed pairs carry the target's streams, which fc fuses; tree nodes their parent's output
        g = features.to(self.fc.weight.dtype)
        if g.shape[-1] == self.feature_dim:
            g = self.fc(g)
        b = self.block
        x = torch.cat([b.attention_norm(self.embedding(tokens)), self.hidden_norm(g)], -1)
        h, weights = b.attention(x, 0, cache, slots, n_live, mask, *self.rope(positions), want_weights, rows=rows)
        h = residual(g, rows) + h
        return h + b.feed_forward(b.ffn_norm(h)), weights


class Eagle3Kind(EagleFamily):
    """Serving layouts: speculators' `eagle3` (src/speculators/models/eagle3: config.json with speculators_config,
    transformer_layer_config, draft_vocab_size, eagle_aux_hidden_state_layer_ids; tensors layers.0.*, fc, norm,
    lm_head, embed_tokens, d2t, t2d), which vLLM loads; SGLang's LlamaForCausalLMEagle3
    (python/sglang/srt/models/llama_eagle3.py: midlayer.*, fc, norm, lm_head, d2t, t2d; eagle_config's layer ids)."""

    name = "eagle3"
    module_type = Eagle3Model
    onnx_inputs, onnx_outputs = ("input_ids", "features"), ("next_hidden", "logits")
    engine_formats = ("speculators-eagle3", "sglang-eagle3")

    def streams(self, settings, n_layers):
        return aux_layers(settings.aux_layers, n_layers)

    def reads(self, module):
        return module.aux_layers

    def config(self, module, draft_vocab, settings):
        return Eagle3Config(module.aux_layers, module.target_layers, draft_vocab).to_dict()

    def module(self, config, target, max_len, keep_ids):
        c = target.config
        layers = Eagle3Config.from_dict(config, c.n_layers).aux_layers
        head = DraftHead(target.output, keep_ids, norm=RMSNorm(c.dim, c.norm_eps))
        return Eagle3Model(c, target.tok_embeddings, head, layers, max_len)

    def engine_exports(self, module, verifier, speculative_tokens=5):
        speculators = speculators_config("eagle3", verifier, speculative_tokens)
        cfg = module.cfg
        problem = llama_layer_problem(cfg)
        if problem:
            return dict.fromkeys(self.engine_formats, problem)
        layer = hf_layer_tensors(module.block.state_dict(), cfg) | {"hidden_norm.weight": module.hidden_norm.weight}
        names = llama_layer_names(cfg) + ("hidden_norm.weight",)
        vocab = _vocab_maps(module.head)
        shared = {"fc.weight": module.fc.weight, "norm.weight": module.head.norm.weight,
                  "lm_head.weight": module.head.weight} | vocab
        shared = {k: v.detach().clone() for k, v in shared.items()}
        hf_layer = llama_layer_config(cfg, module.fc.weight.dtype)
        draft_vocab = module.head.weight.shape[0]
        speculators_names = ("embed_tokens.weight", *shared, *(f"layers.0.{n}" for n in names))
        out: dict[str, EngineExport | str] = {"speculators-eagle3": EngineExport(
            "speculators-eagle3",
            {"speculators_model_type": "eagle3", "architectures": ["Eagle3DraftModel"], "draft_vocab_size": draft_vocab,
             "transformer_layer_config": hf_layer, "eagle_aux_hidden_state_layer_ids": list(module.aux_layers),
             "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
             "embed_requires_grad": False, "tie_word_embeddings": False, "dtype": hf_layer["torch_dtype"],
             "speculators_config": speculators},
            shared | {"embed_tokens.weight": module.embedding.table().clone()}
            | {f"layers.0.{k}": v.detach().clone() for k, v in layer.items()}, speculators_names)}
        biased = cfg.qkv_bias or cfg.mlp_bias
        out["sglang-eagle3"] = "SGLang's EAGLE-3 layer has no q/k/v or MLP biases" if biased else EngineExport(
            "sglang-eagle3",
            {**hf_layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab,
             # SGLang captures the output of each layer id: one below the stream entering it
             "eagle_config": {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in module.aux_layers],
                              "use_aux_hidden_state": True}},
            shared | {f"midlayer.{k}": v.detach().clone() for k, v in layer.items()},
            (*shared, *(f"midlayer.{n}" for n in names)),
            launch_flags=("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "{dir}"))
        return out


def _vocab_maps(head: DraftHead) -> dict[str, Tensor]:
    """d2t (the target id of draft id i is i + d2t[i]) and t2d (whether a target id is in the draft vocabulary);
    none for a full vocabulary, where the engines keep neither."""
    if not head.reduced:
        return {}
    ids = head.keep_ids  # ascending
    t2d = torch.zeros(head.vocab_size, dtype=torch.bool, device=ids.device)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(ids.numel(), device=ids.device), "t2d": t2d}


KIND = Eagle3Kind()
