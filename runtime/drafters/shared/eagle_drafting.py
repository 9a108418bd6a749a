"""What the EAGLE drafters (runtime/drafters/eagle.py, eagle3.py) share: pairs of a token and a feature over a
one-block KV cache, the Drafter the engine drives around them, and their cache-free step for ONNX.

Pair j = (x_{j+1}, f_j) sits at position j+1 and predicts the hidden state from which the head draws x_{j+2}.
Committed pairs carry what the drafter reads of the target (its final hidden state for EAGLE-1/2, three residual
streams for EAGLE-3); tree nodes carry the hidden state the drafter itself predicted for their parents.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.drafters.shared.draft_head import DraftHead
from runtime.drafters.shared.eagle_batch import BatchEagle
from runtime.drafters.shared.eagle_static import StaticEagleTree
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.drafter import Drafter, DrafterKind
from runtime.speculation.dynamic_tree import TreeSlots, grow_tree, tree_probs
from runtime.speculation.sampling import SamplingParams
from runtime.speculation.tree import DraftTree
from runtime.target.attention import attention_mask, causal_mask, head_groups
from runtime.target.cpu_packing import pack_for_cpu
from runtime.target.kv_cache import KVCache
from runtime.target.model import Embedding, ForwardOutput, NoCache, rope_tables
from runtime.target.model_config import ModelConfig


class EagleBase(nn.Module):
    """An EAGLE model: subclasses build `block` (and what feeds it) and define `step`."""

    aux_layers: tuple[int, ...] = ()  # the target layers whose entering residual streams it reads; (): final hidden

    def __init__(self, target_cfg: ModelConfig, embedding: Embedding, head: DraftHead, max_seq_len: int):
        super().__init__()
        self.cfg = replace(target_cfg, n_layers=1)
        self.head = head
        # the target's, shared and frozen: not a submodule, so never trained, cast or saved with the drafter
        object.__setattr__(self, "embedding", embedding)
        cos, sin = rope_tables(self.cfg, max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def feature_dim(self) -> int:
        """Width of a committed pair's feature: what it reads of the target."""
        return self.cfg.dim * max(1, len(self.aux_layers))

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c, w = self.cfg, self.fc.weight
        return KVCache(1, batch, c.n_kv_heads, max_len, c.head_dim, w.dtype, w.device)

    def forward(self, tokens: Tensor, features: Tensor, positions: Tensor, cache: KVCache, slots: Tensor,
                n_live: int, mask: Tensor | None) -> Tensor:
        """tokens, positions [B, T], features [B, T, feature_dim or H] -> predicted hidden states [B, T, H]."""
        return self.step(tokens, features, positions, cache, slots, n_live, mask)[0]

    def step(self, tokens: Tensor, features: Tensor, positions: Tensor, cache: KVCache, slots: Tensor | None,
             n_live: int, mask: Tensor | None, want_weights: bool = False,
             rows: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """forward, plus the block's attention weights [B, heads, T, n_live] over cache slots if `want_weights`.
        rows: indices into the B*T pairs whose prediction is wanted, returned as [len(rows), H]; every pair still
        writes its keys and values, but only those rows pay for the output projection and the MLP."""
        raise NotImplementedError

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.rope_cos[positions].unsqueeze(2), self.rope_sin[positions].unsqueeze(2)

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


@torch.no_grad()
def open_circuit(block: nn.Module) -> None:
    """Zero the block's two residual-branch outputs (wo, w2): it starts as the identity, and training opens the
    branches gradually while their inner weights keep what they were initialised with."""
    for out_proj in (block.attention.wo, block.feed_forward.w2):
        out_proj.weight.zero_()
        if out_proj.bias is not None:
            out_proj.bias.zero_()


def residual(x: Tensor, rows: Tensor | None) -> Tensor:
    """The residual stream of the pairs `step` was asked for (all of them when rows is None)."""
    return x if rows is None else x.flatten(0, 1).index_select(0, rows)


def on_target_keys(draft_weights: Tensor) -> Tensor:
    """Draft attention over cache slots [..., S] -> over target key positions [..., S + 1]. Slot s holds the pair
    (x_{s+1}, f_s), i.e. stands for target key s+1; target key 0 has no pair and gets weight 0."""
    return F.pad(draft_weights, (1, 0))


class EagleDrafter(Drafter):
    needs_features = True

    def __init__(self, model: EagleBase, max_len: int):
        self.model = pack_for_cpu(model)
        self.vocab_size = model.head.vocab_size
        self.feature_layers = model.aux_layers
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
        self._check_width(features)
        self.cache.reset()
        self.cached = 0
        self.pending = [(tokens[1:], features)]
        self.attention = None

    def commit(self, tokens: Tensor, features: Tensor | None) -> None:
        if features is None or features.shape[0] != tokens.numel():
            raise ValueError("EagleDrafter.commit needs one target feature per committed token")
        self._check_width(features)
        self.pending.append((tokens, features))
        self.attention = None  # its prefix is the one before this commit

    def _check_width(self, features: Tensor) -> None:
        # eagle3 also reads its own dim-wide states at depth: target features of the wrong width would run unnoticed
        if features.shape[-1] != self.model.feature_dim:
            raise ValueError(f"EagleDrafter: target features {features.shape[-1]} wide, expected "
                             f"{self.model.feature_dim} (the streams entering layers {self.feature_layers})")

    def batched(self, rows: int) -> BatchEagle:
        return BatchEagle(self.model, rows, self.cache.max_len)

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

    def __init__(self, model: EagleBase):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
        B, T = input_ids.shape
        positions = torch.arange(1, T + 1, device=input_ids.device).expand(B, T)
        empty = torch.zeros(B, dtype=torch.long, device=input_ids.device)
        mask = attention_mask(empty, positions, T, None)
        next_features = self.model(input_ids, features, positions, NoCache(), None, T, mask)
        return next_features, self.model.head(next_features)


class EagleFamily(DrafterKind):
    """What the EAGLE kinds share: the Drafter, the ONNX step, the attention SpecAttn calibrates on."""

    attends = True

    def drafter(self, module, config, target, max_len, keep_ids):
        return EagleDrafter(module, max_len)

    def onnx_step(self, module):
        return EagleStep(module)

    def onnx_example(self, module: EagleBase, batch, seq, generator):
        return {"input_ids": torch.randint(0, module.cfg.vocab_size, (batch, seq), generator=generator),
                "features": torch.randn(batch, seq, module.feature_dim, generator=generator)}

    def draft_attention(self, module: EagleBase, target_out: ForwardOutput, ids: Tensor,
                        kv_heads: int = 0) -> Tensor:
        """[1, H, T, T] over the target's keys; query 0 has no pair."""
        T = ids.numel()
        features = target_out.features(module.aux_layers)[:, :-1]
        _, att = module.causal_step(ids[None, 1:], features, module.new_cache(1, T - 1), want_weights=True)
        return head_groups(F.pad(on_target_keys(att), (0, 0, 1, 0))[0][None], kv_heads)


def speculators_config(algorithm: str, verifier: dict, speculative_tokens: int) -> dict:
    """The `speculators_config` block of a speculators-format config.json (vLLM reads its proposal's
    speculative_tokens and the verifier's name_or_path)."""
    if isinstance(speculative_tokens, bool) or not isinstance(speculative_tokens, int) or speculative_tokens < 1:
        raise ValueError(f"speculative_tokens={speculative_tokens!r}, expected an int >= 1")
    return {"algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier["name_or_path"], "architectures": list(verifier["architectures"])}}
