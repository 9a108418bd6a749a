"""An independent small LM: the target's first layers or an existing small LM (LoRA-tuned), distilled on the
target's next-token distributions."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from runtime.drafters.shared.draft_head import DraftHead
from runtime.target.cpu_packing import Linear
from runtime.target.loading import from_pretrained
from runtime.target.model import Transformer
from train.losses import KD_DISTANCES
from train.recipes import LossFn, Recipe
from train.target_outputs import target_features


def build_lm(target: Transformer, layers: int, init: str) -> Transformer:
    """A small LM of the target's width and vocabulary with `layers` blocks. init "target": the target's
    embeddings, first `layers` blocks, final norm and lm_head (it starts as an early exit of the target);
    "random": the same shape, initialised as HF initialises Llama (normal, std 0.02)."""
    if not 1 <= layers <= target.config.n_layers:
        raise ValueError(f"drafter.lm_layers={layers}: expected 1..{target.config.n_layers} (the target's depth)")
    model = Transformer(replace(target.config, n_layers=layers), target.max_seq_len)
    if init == "target":
        table = target.tok_embeddings.table()  # lean: read from the head's panels, its one copy, once when tied
        head = table if target.config.tie_embeddings else target.output.weight_rows()
        model.load_state_dict({k: v for k, v in target.state_dict().items()
                               if not k.startswith("layers.") or int(k.split(".")[1]) < layers}
                              | {"tok_embeddings.weight": table, "output.weight": head})
    elif init == "random":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)
                elif name.endswith("bias"):
                    p.zero_()
    else:
        raise ValueError(f"drafter.lm_init={init!r}: expected 'target' or 'random'")
    return model.to(target.dtype).requires_grad_(True).train()


def build_lm_lora(target: Transformer, base: str | Path, rank: int) -> nn.Module:
    """An existing small causal LM (HF directory) with peft LoRA adapters of `rank` on every matmul but the
    lm_head; only the adapters train. merge_lora() folds them back into a plain Transformer."""
    from peft import LoraConfig, get_peft_model

    # trains in fp32, on the plain weights alone: packed copies (two of them in fp32) would go stale as it learns
    model = from_pretrained(base, dtype=torch.float32, max_seq_len=target.max_seq_len, packed=False)
    if model.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"drafter.lm_base={str(base)!r} has vocab_size {model.config.vocab_size}, the target "
                         f"{target.config.vocab_size}: the drafter must share the target's tokenizer")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear) and m is not model.output}
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                      target_modules=sorted({name.rsplit(".", 1)[-1] for name in linears}))
    return get_peft_model(model, lora).train()


def merge_lora(model: nn.Module) -> nn.Module:
    """A LoRA-tuned model as its plain base module with the adapters merged in; any other module unchanged."""
    from peft import PeftModel

    return model.merge_and_unload() if isinstance(model, PeftModel) else model


KD_CHUNK_ROWS = 64  # positions whose [rows, vocab] float32 intermediates live at once: 39 MB each at Qwen's 151,936


def lm_kd_loss(target: Transformer, kind: str, keep_ids: Tensor | None = None,
               chunk_rows: int = KD_CHUNK_ROWS) -> LossFn:
    """Knowledge distillation of an LM drafter: `kind` (forward_kl | tv) between the target's and the drafter's
    next-token distributions at every position whose next token is an assistant token. With `keep_ids` both are
    over the reduced draft vocabulary, the one the drafter proposes from. Both heads run `chunk_rows` positions at
    a time, recomputed in backward (checkpoint): over a full vocabulary the whole batch's logits, softmaxes and
    their gradients held at once were gigabytes."""
    if kind not in KD_DISTANCES:
        raise ValueError(f"distill.kd_loss={kind!r}: expected one of {sorted(KD_DISTANCES)}")
    # the whole head shared, not read back: a lean target's tied table lives only in its panels
    target_head = DraftHead.whole(target.output) if keep_ids is None else DraftHead(target.output, keep_ids)
    distance = KD_DISTANCES[kind]

    def chunk_loss(hidden: Tensor, features: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        """The distance summed over these rows, and how many rows' argmaxes agree."""
        with torch.no_grad():
            goal = target_head(features)
        logits = F.linear(hidden, weight)
        everywhere = torch.ones(len(hidden), dtype=torch.bool, device=hidden.device)
        return distance(goal, logits, everywhere) * len(hidden), (logits.argmax(-1) == goal.argmax(-1)).sum()

    def loss_fn(model: Transformer, batch: dict) -> tuple[Tensor, dict]:
        t = target_features(target, batch)
        m = t.mask[:, 1:]  # row j predicts token j+1
        hidden = model.forward_uncached(batch["input_ids"], no_logits=True).hidden[:, :-1][m]
        features = t.features[:, :-1][m]
        weight = model.output.weight
        weight = weight if target_head.keep_ids is None else weight[target_head.keep_ids]
        total, hits = hidden.new_zeros((), dtype=torch.float32), 0
        for start in range(0, len(hidden), chunk_rows):
            rows = slice(start, start + chunk_rows)
            loss, agree = checkpoint(chunk_loss, hidden[rows], features[rows], weight, use_reentrant=False)
            total, hits = total + loss, hits + int(agree)
        n = max(len(hidden), 1)  # 0 when no position is masked in
        return total / n, {"top1": hits / n}

    return loss_fn


class LMRecipe(Recipe):
    def build(self, target, drafter, distill, keep_ids):
        """`drafter.lm_base`: an HF directory (distill resolves presets and hub ids first), else None."""
        if drafter.lm_base:
            return build_lm_lora(target, drafter.lm_base, drafter.lora_rank)
        return build_lm(target, drafter.lm_layers, drafter.lm_init)

    def target_blocks(self, drafter, n_layers):
        # build_lm's init "target" copies the first lm_layers blocks; a LoRA base or a random init reads none
        return tuple(range(min(drafter.lm_layers, n_layers))) if drafter.lm_init == "target" and not drafter.lm_base \
            else ()

    def copies_target(self, drafter):
        return not drafter.lm_base  # a base LM brings its own weights: the target only teaches

    def loss(self, target, drafter, distill, keep_ids):
        return lm_kd_loss(target, distill.kd_loss, keep_ids)

    def finish(self, module):
        return merge_lora(module)


RECIPE = LMRecipe()
