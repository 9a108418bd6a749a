"""Drafter recipes: how each kind is built from the target and what it is trained to match.

Every loss reads the target's own outputs (features and next-token distributions) under a frozen forward, so
drafters learn the target's behaviour rather than the dataset's. Rows are masked to assistant tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.draft_head import DraftHead
from runtime.eagle import EagleModel
from runtime.medusa import MedusaConfig, MedusaHeads
from runtime.cpu_packing import Linear
from runtime.model import Transformer
from train.losses import KD_DISTANCES, cross_entropy_to, feature_regression, soft_cross_entropy, topk_accuracy
from train.ttt import unroll

LossFn = Callable[[nn.Module, dict], tuple[Tensor, dict]]


@dataclass(frozen=True)
class TargetOutputs:
    features: Tensor  # [B, T, H] last hidden after the final norm
    mask: Tensor  # [B, T] bool, assistant tokens


@torch.no_grad()
def target_features(target: Transformer, batch: dict) -> TargetOutputs:
    """The frozen target's features: read from the batch when prepare cached them (offline), else computed."""
    if "features" in batch:
        return TargetOutputs(batch["features"].to(target.dtype), batch["loss_mask"].bool())
    ids = batch["input_ids"]
    B, T = ids.shape
    cache = target.new_cache(B, T)
    positions = torch.arange(T, device=ids.device).expand(B, T)
    out = target.run(ids, cache, positions, no_logits=True)
    return TargetOutputs(out.hidden, batch["loss_mask"].bool())


def top1(draft_logits: Tensor, target_logits: Tensor, mask: Tensor) -> float:
    return topk_accuracy(draft_logits, target_logits.argmax(-1), mask)[1]


def eagle_loss(target: Transformer, noise: float = 0.1, depth: int = 1, decay: float = 0.7,
               w_feature: float = 1.0, w_token: float = 0.1, candidates: int = 0) -> LossFn:
    """EAGLE: regress the next feature (SmoothL1) and match the target's next-token distribution (soft CE);
    uniform noise on input features trains the drafter to tolerate its own imperfect predictions. With depth > 1
    the drafter is also trained the way it drafts (train.ttt.unroll), depth d weighted decay**(d-1).

    candidates > 0: the soft CE is taken over the (micro-)batch's candidate tokens only, the union of every goal's top
    `candidates` ids (and its argmax), with the target's probabilities there. On the default's batches the top-8
    union is ~1500 of 8192 ids and holds 97-98% of each goal's mass: a step is 17% faster under bf16 (25% in fp32)
    and the drafter trains as well (docs/cpu.md). top1 is then the argmax among the candidates."""

    def loss_fn(model: EagleModel, batch: dict) -> tuple[Tensor, dict]:
        t = target_features(target, batch)
        ids, f = batch["input_ids"], t.features
        T = ids.shape[1]
        depths = min(depth, T - 2)
        inputs = f[:, :-1] + noise * (2 * torch.rand_like(f[:, :-1]) - 1)
        # depth d row j predicts f_{j+d}, a loss row where the token after it, x_{j+d+1}, is an assistant token
        wanted = [F.pad(t.mask[:, d + 1:], (0, d)) for d in range(1, depths + 1)]
        # every depth's goal is the target's distribution at some position p (p >= d) with x_{p+1} assistant:
        # computed once for p = 1..T-2 (the vocab-wide work is most of a step), then narrowed per depth
        goals = t.mask[:, 2:]
        with torch.no_grad():
            goal_logits = model.head(f[:, 1:T - 1][goals]).float()
            goal_probs, goal_ids = goal_logits.softmax(-1), goal_logits.argmax(-1)
            vocab = model.head.weight
            if candidates:
                top = goal_probs.topk(min(candidates, goal_probs.shape[-1]), -1).indices
                kept = torch.unique(torch.cat([top.flatten(), goal_ids]))  # sorted
                vocab, goal_probs, goal_ids = vocab[kept], goal_probs[:, kept], torch.searchsorted(kept, goal_ids)
        p = torch.arange(1, T - 1, device=ids.device).expand_as(goals)[goals]
        total, metrics = 0.0, {}
        for d, pred in enumerate(unroll(model, ids, inputs, depths, wanted), start=1):
            m = wanted[d - 1]
            pred, goal = pred[m], f[:, d:][m[:, :T - d]]
            probs, labels = goal_probs, goal_ids
            if d > 1:  # this depth's goals: those at p >= d, in the order of its loss rows
                keep = (p >= d).nonzero().squeeze(1)
                probs, labels = goal_probs.index_select(0, keep), goal_ids.index_select(0, keep)
            logits = F.linear(pred, vocab).float()  # the loss reads fp32; argmax over bf16 is 6x slower on CPU
            reg = feature_regression(pred, goal, torch.ones(len(pred), dtype=torch.bool, device=pred.device))
            tok = cross_entropy_to(probs, logits)
            total = total + decay ** (d - 1) * (w_feature * reg + w_token * tok)
            metrics[f"top1_d{d}"] = float((logits.argmax(-1) == labels).float().mean()) if len(labels) else 0.0
            if d == 1:
                metrics.update(feature_loss=reg.item(), token_loss=tok.item(), top1=metrics["top1_d1"])
        return total, metrics

    return loss_fn


@torch.no_grad()
def simulated_chain(model: EagleModel, target: Transformer, batches: list[dict], depth: int) -> dict:
    """Greedy chain drafting replayed on rows. From every start j (x_{j+2} an assistant token) the chain accepts
    depth d while the draft equals the target's full-vocabulary argmax and, from depth 2 on, the row's token fed
    at depth d is itself the target's argmax (else the replay feeds what inference never would). Returns the
    acceptance per depth given the previous one was accepted, and the chain's tau = 1 + mean accepted drafts."""
    offered, taken = torch.zeros(depth), torch.zeros(depth)
    accepted = starts = 0
    for batch in batches:
        t = target_features(target, batch)
        ids, f, mask = batch["input_ids"], t.features, t.mask
        # the target's choice for the token after each position, a row at a time: the [B, T, vocab] logits of
        # distill's 16 eval rows would take ~1 GB
        greedy = torch.cat([target.output(row).argmax(-1) for row in f.split(1)])
        alive = mask[:, 2:].clone()
        starts += int(alive.sum())
        depths = min(depth, ids.shape[1] - 2)
        chains = [F.pad(mask[:, 2:], (0, 1))] * depths  # the only rows a chain runs on at any depth: its start's
        for d, pred in enumerate(unroll(model, ids, f[:, :-1], depths, chains), start=1):
            n = min(alive.shape[1], ids.shape[1] - d - 1)
            alive = alive[:, :n]
            chosen = model.head(pred[:, :n][alive]).argmax(-1)  # the head only where the chain is still alive
            draft = torch.full_like(alive, -1, dtype=torch.long)
            draft[alive] = model.head.keep_ids[chosen] if model.head.reduced else chosen
            ok = alive & (draft == greedy[:, d:d + n]) & mask[:, d + 1:d + 1 + n]
            if d > 1:
                ok &= ids[:, d:d + n] == greedy[:, d - 1:d - 1 + n]
            offered[d - 1] += alive.sum()
            taken[d - 1] += ok.sum()
            accepted += int(ok.sum())
            alive = ok
    rates = (taken / offered.clamp(min=1)).tolist()
    return {"sim_tau": 1 + accepted / max(starts, 1), **{f"sim_accept_d{d + 1}": r for d, r in enumerate(rates)}}


def medusa_loss(target: Transformer, decay: float = 0.8) -> LossFn:
    """Medusa: head k on feature f_t matches the target's distribution for token t+k+2 (the target's own
    f_{t+k+1}), weighted decay**k because deeper heads matter less (fewer drafts reach them)."""

    def loss_fn(model: MedusaHeads, batch: dict) -> tuple[Tensor, dict]:
        t = target_features(target, batch)
        f = t.features
        T = f.shape[1]
        total, metrics = 0.0, {}
        logits_all = model(f)  # [B, T, K, Vd]
        for k in range(model.cfg.num_heads):
            span = T - k - 2
            if span <= 0:
                break
            logits = logits_all[:, :span, k]
            goal = model.head(f[:, k + 1: k + 1 + span])
            m = t.mask[:, k + 2: k + 2 + span]
            loss = soft_cross_entropy(goal, logits, m)
            total = total + decay ** k * loss
            metrics[f"head{k}_top1"] = top1(logits, goal, m)
        return total, metrics

    return loss_fn


def build_eagle(target: Transformer, keep_ids: Tensor | None, from_target: bool = True) -> EagleModel:
    head = DraftHead(target.output.weight, keep_ids)
    if from_target:
        model = EagleModel.from_target(target, head)
    else:
        model = EagleModel(target.config, target.tok_embeddings.weight, head, target.max_seq_len).to(target.dtype)
    return model.requires_grad_(True).train()


def build_medusa(target: Transformer, num_heads: int, keep_ids: Tensor | None) -> MedusaHeads:
    head = DraftHead(target.output.weight, keep_ids)
    cfg = MedusaConfig(hidden_size=target.config.dim, num_heads=num_heads)
    return MedusaHeads(cfg, head).to(target.dtype).requires_grad_(True).train()


def build_lm(target: Transformer, layers: int, init: str) -> Transformer:
    """A small LM of the target's width and vocabulary with `layers` blocks. init "target": the target's
    embeddings, first `layers` blocks, final norm and lm_head (it starts as an early exit of the target);
    "random": the same shape, initialised as HF initialises Llama (normal, std 0.02)."""
    if not 1 <= layers <= target.config.n_layers:
        raise ValueError(f"drafter.lm_layers={layers}: expected 1..{target.config.n_layers} (the target's depth)")
    model = Transformer(replace(target.config, n_layers=layers), target.max_seq_len)
    if init == "target":
        model.load_state_dict({k: v for k, v in target.state_dict().items()
                               if not k.startswith("layers.") or int(k.split(".")[1]) < layers})
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

    model = Transformer.from_pretrained(base, dtype=target.dtype, max_seq_len=target.max_seq_len)
    if model.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"drafter.lm_base={str(base)!r} has vocab_size {model.config.vocab_size}, the target "
                         f"{target.config.vocab_size}: the drafter must share the target's tokenizer")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear) and m is not model.output}
    for m in linears.values():
        m.unpack()  # train on the plain weights: prepacked copies would go stale when the adapters merge
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                      target_modules=sorted({name.rsplit(".", 1)[-1] for name in linears}))
    return get_peft_model(model, lora).train()


def merge_lora(model: nn.Module) -> nn.Module:
    """A LoRA-tuned model as its plain base module with the adapters merged in; any other module unchanged."""
    from peft import PeftModel

    return model.merge_and_unload() if isinstance(model, PeftModel) else model


def lm_kd_loss(target: Transformer, kind: str, keep_ids: Tensor | None = None) -> LossFn:
    """Knowledge distillation of an LM drafter: `kind` (forward_kl | tv) between the target's and the drafter's
    next-token distributions at every position whose next token is an assistant token. With `keep_ids` both are
    over the reduced draft vocabulary, the one the drafter proposes from."""
    if kind not in KD_DISTANCES:
        raise ValueError(f"distill.kd_loss={kind!r}: expected one of {sorted(KD_DISTANCES)}")
    distance, target_head = KD_DISTANCES[kind], DraftHead(target.output.weight, keep_ids)

    def loss_fn(model: Transformer, batch: dict) -> tuple[Tensor, dict]:
        t = target_features(target, batch)
        goal = target_head(t.features[:, :-1])  # row j: the distribution of token j+1
        hidden = model.run_uncached(batch["input_ids"], no_logits=True).hidden[:, :-1]
        weight = model.output.weight
        logits = F.linear(hidden, weight if target_head.keep_ids is None else weight[target_head.keep_ids])
        m = t.mask[:, 1:]
        return distance(goal, logits, m), {"top1": top1(logits, goal, m)}

    return loss_fn
