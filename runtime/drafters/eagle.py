"""EAGLE-1/2 drafter: one decoder block over [token embedding; target feature], predicting the next feature;
the target's frozen lm_head (optionally a reduced draft vocabulary) turns features into tokens.

Pair j = (x_{j+1}, f_j) sits at position j+1 and predicts f_{j+1}, whose head gives x_{j+2}. Committed pairs use
the target's true features; tree nodes use the features the drafter itself predicted for their parents.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.attention import attention_mask, causal_mask
from runtime.budget import DraftBudget
from runtime.cpu_packing import Linear, pack_for_cpu
from runtime.draft_head import DraftHead
from runtime.drafter import Drafter, DrafterKind, EngineExport
from runtime.dynamic_tree import TreeSlots, grow_tree, tree_probs
from runtime.hf_weights import hf_layer_tensors, llama_layer_config, llama_layer_names, llama_layer_problem
from runtime.kv_cache import KVCache
from runtime.model import Block, ForwardOutput, ModelConfig, NoCache, Transformer, rope_tables
from runtime.sampling import SamplingParams
from runtime.static_draft import StaticEagleTree
from runtime.tree import DraftTree


@dataclass(frozen=True)
class EagleConfig:
    draft_vocab: int = 0  # 0: the full target vocabulary; else the size of the reduced draft vocabulary

    def to_dict(self) -> dict:
        return {"kind": "eagle", **asdict(self)}


class EagleModel(nn.Module):
    def __init__(self, target_cfg: ModelConfig, embed_weight: Tensor, head: DraftHead, max_seq_len: int):
        super().__init__()
        self.cfg = replace(target_cfg, n_layers=1)
        dim = self.cfg.dim
        self.fc = Linear(2 * dim, dim, bias=True)
        self.block = Block(self.cfg)
        # EAGLE, SGLang's LlamaForCausalLMEagle and vLLM speculators all skip the block's input norm (the fc
        # output feeds attention directly); keeping it would make every served copy compute something else.
        self.block.attention_norm = nn.Identity()
        self.head = head
        # Frozen and shared with the target: never trained, never saved with the drafter.
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        cos, sin = rope_tables(self.cfg, max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @staticmethod
    def from_target(target: Transformer, head: DraftHead) -> "EagleModel":
        """Start from the target's last block and an fc that passes the feature through, with the block's two
        residual-branch outputs (wo, w2) zeroed: the untrained drafter is exactly the identity on the feature.
        The target's last block fed its own final-norm output instead of its residual stream returns values in
        the hundreds, which the training-time unroll would feed back into itself; from the identity the
        branches open gradually, and their inner weights keep the target's head start."""
        m = EagleModel(target.config, target.tok_embeddings.weight, head, target.max_seq_len)
        last = {k: v for k, v in target.layers[-1].state_dict().items() if not k.startswith("attention_norm.")}
        m.block.load_state_dict(last)
        dim = target.config.dim
        with torch.no_grad():
            m.fc.weight.zero_()
            m.fc.weight[:, dim:] = torch.eye(dim)
            m.fc.bias.zero_()
            for out_proj in (m.block.attention.wo, m.block.feed_forward.w2):
                out_proj.weight.zero_()
                if out_proj.bias is not None:
                    out_proj.bias.zero_()
        return m.to(target.dtype)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.cfg
        return KVCache(1, batch, c.n_kv_heads, max_len, c.head_dim, self.fc.weight.dtype, self.fc.weight.device)

    def forward(self, tokens: Tensor, features: Tensor, positions: Tensor, cache: KVCache, slots: Tensor,
                n_live: int, mask: Tensor | None) -> Tensor:
        """tokens, positions [B, T], features [B, T, H] -> predicted next features [B, T, H]."""
        return self.step(tokens, features, positions, cache, slots, n_live, mask)[0]

    def step(self, tokens: Tensor, features: Tensor, positions: Tensor, cache: KVCache, slots: Tensor | None,
             n_live: int, mask: Tensor | None, want_weights: bool = False,
             rows: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """forward, plus the block's attention weights [B, heads, T, n_live] over cache slots if `want_weights`.
        rows: indices into the B*T pairs whose prediction is wanted, returned as [len(rows), H]; every pair still
        writes its keys and values, but only those rows pay for the output projection and the MLP."""
        x = self.fc(torch.cat([F.embedding(tokens, self.embed_weight), features.to(self.fc.weight.dtype)], -1))
        cos, sin = self.rope_cos[positions].unsqueeze(2), self.rope_sin[positions].unsqueeze(2)
        b = self.block
        h, weights = b.attention(b.attention_norm(x), 0, cache, slots, n_live, mask, cos, sin, want_weights,
                                 rows=rows)
        x = (x if rows is None else x.flatten(0, 1).index_select(0, rows)) + h
        return x + b.feed_forward(b.ffn_norm(x)), weights

    def causal(self, tokens: Tensor, features: Tensor, cache: KVCache) -> Tensor:
        """Append pairs after each sequence's committed length (causal among themselves); no advance."""
        return self.causal_step(tokens, features, cache)[0]

    def causal_step(self, tokens: Tensor, features: Tensor, cache: KVCache,
                    want_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        T = tokens.shape[1]
        positions = cache.lengths[:, None] + 1 + torch.arange(T, device=tokens.device)
        n_live = int(cache.lengths.max()) + T
        mask = causal_mask(cache.lengths, T, n_live, None) or attention_mask(cache.lengths, positions, n_live, None)
        return self.step(tokens, features, positions, cache, cache.slots(T), n_live, mask, want_weights)


def on_target_keys(draft_weights: Tensor) -> Tensor:
    """Draft attention over cache slots [..., S] -> over target key positions [..., S + 1]. Slot s holds the pair
    (x_{s+1}, f_s), i.e. stands for target key s+1; target key 0 has no pair and gets weight 0."""
    return F.pad(draft_weights, (1, 0))


class EagleDrafter(Drafter):
    needs_features = True

    def __init__(self, model: EagleModel, max_len: int):
        self.model = pack_for_cpu(model)
        self.vocab_size = model.head.vocab_size
        self.cache = model.new_cache(1, max_len)
        self.pending: list[tuple[Tensor, Tensor]] = []  # committed pairs not yet in the drafter cache
        self.cached = 0  # pairs in the drafter cache, kept on the host: reading cache.lengths waits for a GPU
        self.attention: Tensor | None = None  # [1, heads, prefix] of the last propose, see draft_attention
        self.static: StaticEagleTree | None = None  # greedy trees at static shapes, see use_static

    def use_static(self, use_graph: bool, compile: bool = False) -> None:
        """Propose greedy trees at static shapes, as CUDA graphs where `use_graph`."""
        self.static = StaticEagleTree(self.model, self.cache, use_graph=use_graph, compile=compile)

    def reset(self, tokens: Tensor, features: Tensor | None) -> None:
        if features is None or features.shape[0] != tokens.numel() - 1:
            raise ValueError("EagleDrafter.reset needs one target feature per token but the last")
        self.cache.reset()
        self.cached = 0
        self.pending = [(tokens[1:], features)]
        self.attention = None

    def commit(self, tokens: Tensor, features: Tensor | None) -> None:
        if features is None or features.shape[0] != tokens.numel():
            raise ValueError("EagleDrafter.commit needs one target feature per committed token")
        self.pending.append((tokens, features))
        self.attention = None  # its prefix is the one before this commit

    @torch.inference_mode()
    def propose(self, budget: DraftBudget, params: SamplingParams,
                generator: torch.Generator | None = None) -> DraftTree:
        m, head = self.model, self.model.head
        toks = torch.cat([t for t, _ in self.pending]).long()
        feats = torch.cat([f for _, f in self.pending])
        self.pending = []
        T, track = toks.numel(), self.track_attention
        if self.static is not None and params.greedy and not track and self.static.fits(T, budget, self.cached):
            tree = self.static(toks, feats, budget, self.cached)
            self.cache.lengths += T  # fits() checked the room: no host read, unlike KVCache.advance
            self.cached += T
            self.attention = None
            return tree
        out, weights = m.causal_step(toks[None], feats[None], self.cache, want_weights=track)
        out = out[0]
        self.cache.advance(T)
        self.cached += T
        n = self.cached  # pairs in the cache == position of the root token
        # the root's and every expanded node's attention on slots 0..n-2: the target's prefix keys 1..n-1 (slot n-1
        # is the root itself, a token the target verifies rather than reads from its cache)
        prefix_weights = weights[0, :, -1, : n - 1].clone() if track else None
        row_feature = {0: out[-1]}
        slots = TreeSlots(prefix_len=n, root_position=n, device=toks.device)

        def expand(c, nodes: list[int]) -> Tensor:
            tokens = torch.tensor([[c.tokens[i] for i in nodes]], device=toks.device)
            parent_feats = torch.stack([row_feature[c.parents[i] + 1] for i in nodes])[None]
            s, pos, mask = slots.place(c, nodes)
            f, w = m.step(tokens, parent_feats, pos, self.cache, s, mask.shape[-1], mask, want_weights=track)
            if track:
                prefix_weights.add_(w[0, :, :, : n - 1].sum(1))
            f = f[0]
            for i, node in enumerate(nodes):
                row_feature[node + 1] = f[i]
            return tree_probs(head(f), params)

        root = tree_probs(head(out[-1]), params)
        tree = grow_tree(root, expand, budget, params, generator, keep_q=not params.greedy, vocab=head)
        self.attention = on_target_keys(prefix_weights)[None] if track else None
        return tree

    def draft_attention(self) -> Tensor | None:
        """Sums of the root's and the expanded nodes' attention rows (one draft layer, per head)."""
        return self.attention


class EagleStep(nn.Module):
    """EagleModel.causal on an empty cache, plus the draft head: the same forward, minus the KV bookkeeping."""

    def __init__(self, model: EagleModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
        B, T = input_ids.shape
        positions = torch.arange(1, T + 1, device=input_ids.device).expand(B, T)
        empty = torch.zeros(B, dtype=torch.long, device=input_ids.device)
        mask = attention_mask(empty, positions, T, None)
        next_features = self.model(input_ids, features, positions, NoCache(), None, T, mask)
        return next_features, self.model.head(next_features)


class EagleKind(DrafterKind):
    """Engines run the same EAGLE network: fc([embed(x); feature]) -> one Llama decoder layer without its
    input_layernorm -> the target's lm_head; embedding and lm_head come from the target at load time, so neither
    format stores them. speculators' `eagle` (src/speculators/models/eagle.py) loads with the speculators library;
    vLLM registers only eagle3 and later. SGLang's LlamaForCausalLMEagle (python/sglang/srt/models/llama_eagle.py)
    reads fc.* and layers.0.*, and a reduced draft vocabulary as the hot-token list of --speculative-token-map."""

    name = "eagle"
    module_type = EagleModel
    attends = True
    onnx_inputs, onnx_outputs = ("input_ids", "features"), ("next_features", "logits")

    def config(self, module, draft_vocab, settings):
        return EagleConfig(draft_vocab).to_dict()

    def module(self, config, target, max_len, keep_ids):
        return EagleModel(target.config, target.tok_embeddings.weight, DraftHead(target.output.weight, keep_ids),
                          max_len)

    def drafter(self, module, config, target, max_len, keep_ids):
        return EagleDrafter(module, max_len)

    def onnx_step(self, module):
        return EagleStep(module)

    def onnx_example(self, module, batch, seq, generator):
        return {"input_ids": torch.randint(0, module.embed_weight.shape[0], (batch, seq), generator=generator),
                "features": torch.randn(batch, seq, module.cfg.dim, generator=generator)}

    def draft_attention(self, module, target_out: ForwardOutput, ids):
        T = ids.numel()
        _, att = module.causal_step(ids[None, 1:], target_out.hidden[:, :-1], module.new_cache(1, T - 1),
                                    want_weights=True)
        return F.pad(on_target_keys(att), (0, 0, 1, 0))[0][None]  # query 0 has no pair

    def engine_exports(self, module, verifier, speculative_tokens=5):
        if isinstance(speculative_tokens, bool) or not isinstance(speculative_tokens, int) or speculative_tokens < 1:
            raise ValueError(f"speculative_tokens={speculative_tokens!r}, expected an int >= 1")
        cfg = module.cfg
        problem = llama_layer_problem(cfg) or (None if isinstance(module.block.attention_norm, nn.Identity) else
                                               "its block applies input_layernorm to the fused input, which the "
                                               "engines skip for layer 0 (EAGLE's reference layout)")
        if problem:
            return dict.fromkeys(("sglang-eagle", "speculators-eagle"), problem)
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
            EngineExport("speculators-eagle", _speculators_eagle_config(hf_layer, module, verifier, speculative_tokens),
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


def _speculators_eagle_config(layer: dict, module: EagleModel, verifier: dict, speculative_tokens: int) -> dict:
    return {"speculators_model_type": "eagle", "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
            "transformer_layer_architecture": "LlamaDecoderLayer", "transformer_layer_config": layer,
            "layernorms": False,  # no embedding or pre-lm-head norms, and the layer's input_layernorm is skipped
            "fusion_bias": module.fc.bias is not None, "torch_dtype": layer["torch_dtype"],
            "speculators_config": {
                "algorithm": "eagle", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                      "verifier_accept_k": 1,
                                      "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": verifier["name_or_path"],
                             "architectures": list(verifier["architectures"])}}}


KIND = EagleKind()
