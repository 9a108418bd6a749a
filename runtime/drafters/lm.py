"""LM drafter: a small independent causal LM sharing the target's tokenizer, with its own KV cache.

It reads tokens only (no target features). Its cache holds the committed sequence up to, not including, the
root; propose() first runs the tokens committed since (ending with the root), then grows an EAGLE-2 dynamic
tree whose expanded nodes keep their KV in slots after the prefix. commit() keeps, by compacting in place, the
KV of the committed tokens the tree had already expanded, so only the rest is recomputed next time.

Its cache slots are the target's key positions, so for SpecAttn every layer's attention of the root and the
expanded nodes over the committed prefix is already in the target's coordinates (draft_attention).
"""
from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass, replace

import torch
from torch import Tensor, nn

from runtime.drafters.shared.draft_head import DraftHead
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.drafter import Drafter, DrafterKind
from runtime.speculation.dynamic_tree import Candidates, TreeSlots, grow_tree, tree_probs
from runtime.speculation.sampling import SamplingParams
from runtime.speculation.tree import DraftTree
from runtime.target.cpu_packing import pack_for_cpu
from runtime.target.model import Taps, Transformer
from runtime.target.model_config import ModelConfig, RopeScaling


@dataclass(frozen=True)
class LMConfig:
    model: ModelConfig  # the small LM's own shape: the bundle reader rebuilds it from this
    draft_vocab: int = 0  # 0: the full vocabulary; else the size of the reduced draft vocabulary

    def to_dict(self) -> dict:
        return {"kind": "lm", "model": asdict(self.model), "draft_vocab": self.draft_vocab}

    @staticmethod
    def from_dict(config: dict) -> "LMConfig":
        model = dict(config["model"])
        model["rope_scaling"] = RopeScaling(**model.get("rope_scaling", {}))
        return LMConfig(ModelConfig(**model), int(config.get("draft_vocab", 0)))


# each module's packed draft heads by draft vocabulary: calibrate and serving build many drafters around one module,
# and a sibling's 151,936-row head packed is 0.5 GB
_HEADS: weakref.WeakKeyDictionary[Transformer, dict[tuple[int, ...] | None, DraftHead]] = weakref.WeakKeyDictionary()


def packed_head(model: Transformer, keep_ids: Tensor | None) -> DraftHead:
    """The LM's own head over `keep_ids` (None: every row), packed for CPU once per module and vocabulary."""
    heads = _HEADS.setdefault(model, {})
    key = None if keep_ids is None else tuple(keep_ids.tolist())
    if key not in heads:
        heads[key] = DraftHead.whole(model.output) if key is None else pack_for_cpu(DraftHead(model.output, keep_ids))
    return heads[key]


class LMDrafter(Drafter):
    owns_cache = True  # False: its cache is the target's (read_target_cache), which propose never advances

    def __init__(self, model: Transformer, max_len: int, keep_ids: Tensor | None = None):
        """`model` runs inference only from here on: its weights are prepacked for CPU decoding in place, lean (one
        copy each). `keep_ids`: a reduced draft vocabulary; the LM's own lm_head rows restricted to it score the
        drafts."""
        self.model = model.eval().requires_grad_(False)
        if model.output.panels is None and model.output.packed is None:  # packed once: its head shares the copy
            model.pack_for_cpu(lean=True)
        self.head = packed_head(model, keep_ids)
        self.vocab: DraftHead | None = self.head  # what the head's rows are over (grow_tree's vocab)
        self.vocab_size = self.head.vocab_size
        self.cache = model.new_cache(1, max_len)
        self.pending: list[Tensor] = []  # committed tokens not yet in the cache; the last one is the root
        self.tree: tuple[Candidates, TreeSlots] | None = None  # the last proposal's nodes and their KV slots
        self.attention: Tensor | None = None  # [layers, heads, prefix] of the last propose, see draft_attention

    def reset(self, tokens: Tensor, features: Tensor | None = None) -> None:
        self.cache.reset()
        self.pending, self.tree, self.attention = [tokens.long()], None, None

    def commit(self, tokens: Tensor, features: Tensor | None = None) -> None:
        """Walk the committed tokens (but the last, which becomes the root) down the expanded tree nodes: their KV
        was computed over the prefix and their ancestors, exactly the committed path, so it stays."""
        keep: list[int] = []
        if self.tree is not None:
            c, slots = self.tree
            expanded = {(c.parents[n], c.tokens[n]): n for n in slots.slot}
            node: int | None = -1
            for tok in tokens[:-1].tolist():
                node = expanded.get((node, tok))
                if node is None:
                    break
                keep.append(slots.slot[node] - slots.prefix)
        self.cache.compact(keep)
        self.pending.append(tokens[len(keep):].long())
        self.tree, self.attention = None, None  # its prefix is the one before this commit

    @torch.inference_mode()
    def propose(self, budget: DraftBudget, params: SamplingParams,
                generator: torch.Generator | None = None) -> DraftTree:
        lm, head, cache = self.model, self.head, self.cache
        toks = torch.cat(self.pending).to(lm.device)
        n = int(cache.lengths[0])
        positions = n + torch.arange(toks.numel(), device=lm.device)
        prefix = n + toks.numel() - 1  # the root's position: the target verifies it after keys 0..prefix-1
        taps = self.attention_taps() if self.track_attention else Taps()
        # the root's forward reads the prompt too: its other rows' weights would be [layers, heads, T, T]
        root_taps = replace(taps, attention_last_row=True)
        out = lm(toks[None], cache, positions[None], taps=root_taps, no_logits=True)
        if self.owns_cache:
            cache.advance(toks.numel())
        self.pending = []
        slots = TreeSlots(prefix_len=prefix + 1, root_position=prefix, device=lm.device)
        # every layer's root row and, below, expanded nodes' rows over the prefix keys (slot s = target key s)
        weights = torch.stack([out.attention[i][0, :, -1, :prefix] for i in taps.attention_layers]) \
            if taps.attention_layers else None

        def expand(c: Candidates, nodes: list[int]) -> Tensor:
            self.tree = (c, slots)
            tokens = torch.tensor([[c.tokens[i] for i in nodes]], device=lm.device)
            s, pos, mask = slots.place(c, nodes)
            o = lm(tokens, cache, pos, slots=s, mask=mask, taps=taps, no_logits=True)
            if weights is not None:
                weights.add_(torch.stack([o.attention[i][0, :, :, :prefix].sum(1) for i in taps.attention_layers]))
            return tree_probs(head(o.hidden[0]), params)

        root = tree_probs(head(out.hidden[0, -1]), params)
        tree = grow_tree(root, expand, budget, params, generator, keep_q=not params.greedy, vocab=self.vocab)
        self.attention = weights
        return tree

    def attention_taps(self) -> Taps:
        """The layers whose attention propose gathers: attention_layers, or every layer."""
        layers = self.attention_layers
        return Taps(attention_layers=tuple(range(self.model.config.n_layers)) if layers is None else layers)

    def draft_attention(self) -> Tensor | None:
        """Per gathered layer and head, the sums of the root's and the expanded nodes' attention rows over the
        prefix."""
        return self.attention


def attention_slice(module: Transformer, ids: Tensor, cache, start: int, end: int, taps: Taps) -> Tensor:
    """[layers, heads, end - start, end]: queries start..end-1 over the cache, each tapped layer's weights moved into
    one tensor as they are let go (beside all of them, the stack would hold the slice twice)."""
    o = module(ids[None, start:end], cache, torch.arange(start, end)[None], taps=taps, no_logits=True)
    cache.advance(end - start)
    first = o.attention[taps.attention_layers[0]][0]
    att = first.new_empty(len(taps.attention_layers), *first.shape)
    for j, i in enumerate(taps.attention_layers):
        att[j] = o.attention.pop(i)[0]
    return att


class LMStep(nn.Module):
    """The LM drafter's forward over whole sequences without a KV cache (Transformer.forward_uncached); its reduced
    draft vocabulary, if any, is a row selection the caller applies."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model.forward_uncached(input_ids).logits


class LMKind(DrafterKind):
    name = "lm"
    module_type = Transformer
    attends = True
    onnx_inputs, onnx_outputs = ("input_ids",), ("logits",)

    def config(self, module, draft_vocab, settings):
        return LMConfig(module.config, draft_vocab).to_dict()

    def module(self, config, target, max_len, keep_ids):
        return Transformer.empty(LMConfig.from_dict(config).model, max_len)  # drafter_module assigns every weight

    def drafter(self, module, config, target, max_len, keep_ids):
        return LMDrafter(module, max_len, keep_ids)

    def onnx_step(self, module):
        return LMStep(module)

    def onnx_example(self, module, batch, seq, generator):
        return {"input_ids": torch.randint(0, module.config.vocab_size, (batch, seq), generator=generator)}

    def draft_attention(self, module, target_out, ids, kv_heads=0):
        return next(self.draft_attention_slices(module, target_out, ids, kv_heads, ids.numel()))

    def draft_attention_slices(self, module, target_out, ids, kv_heads, rows, layers=None):
        """Its own forward a slice of queries at a time over a growing cache (it reads the tokens alone), tapping
        only `layers`: an untapped layer's attention is never materialised."""
        T = ids.numel()
        layers = tuple(range(module.config.n_layers)) if layers is None else tuple(layers)
        taps = Taps(attention_layers=layers, attention_groups=kv_heads)
        cache = module.new_cache(1, T)
        for start in range(0, T, rows):  # yielded from a call, so this frame keeps no slice while the caller reads
            yield attention_slice(module, ids, cache, start, min(start + rows, T), taps)

    def hf_assistant(self, config):
        return Transformer(LMConfig.from_dict(config).model, 1)  # HF's model has its own rotary tables: ours go unused

    def hf_causal_lm(self, module):
        from runtime.target.loading import hf_causal_lm

        return hf_causal_lm(module)


KIND = LMKind()
