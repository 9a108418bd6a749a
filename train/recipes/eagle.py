"""EAGLE-1/2: regress the next feature and match the target's next-token distribution, trained the way it drafts
(train.ttt.unroll)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.drafters.eagle import EagleModel
from runtime.drafters.shared.draft_head import DraftHead
from runtime.drafters.shared.eagle_drafting import EagleBase
from runtime.target.model import Transformer
from train.losses import cross_entropy_to, feature_regression
from train.recipes import LossFn, Recipe
from train.target_outputs import target_features
from train.ttt import unroll


def eagle_loss(target: Transformer, noise: float = 0.1, depth: int = 1, decay: float = 0.7,
               w_feature: float = 1.0, w_token: float = 0.1, candidates: int = 0,
               goal_head: DraftHead | None = None) -> LossFn:
    """EAGLE: regress the next feature (SmoothL1, weight w_feature; 0 for EAGLE-3, which predicts tokens only) and
    match the target's next-token distribution over the draft vocabulary (soft CE); uniform noise on input features
    trains the drafter to tolerate its own imperfect predictions. With depth > 1 the drafter is also trained the way
    it drafts (train.ttt.unroll), depth d weighted decay**(d-1). The goals come from `goal_head` (the target's
    lm_head rows of the draft vocabulary), by default the model's own head, which for EAGLE-1/2 is exactly that.

    candidates > 0: the soft CE is taken over the (micro-)batch's candidate tokens only, the union of every goal's top
    `candidates` ids (and its argmax), with the target's probabilities there: nearly all of each goal's mass for a
    fraction of the vocabulary-wide work (docs/logs/cpu-2026-11.md,
    "The token loss over the batch's candidate ids (2026-11-27, later)"). top1 is then the argmax among the
    candidates."""

    def loss_fn(model: EagleBase, batch: dict) -> tuple[Tensor, dict]:
        t = target_features(target, batch, model.aux_layers)
        ids, f, head = batch["input_ids"], t.features, model.head
        T = ids.shape[1]
        depths = min(depth, T - 2)
        inputs = t.drafter_input[:, :-1]
        if noise:
            inputs = inputs + noise * (2 * torch.rand_like(inputs) - 1)
        # depth d row j predicts f_{j+d}, a loss row where the token after it, x_{j+d+1}, is an assistant token
        wanted = [F.pad(t.mask[:, d + 1:], (0, d)) for d in range(1, depths + 1)]
        # every depth's goal is the target's distribution at some position p (p >= d) with x_{p+1} assistant:
        # computed once for p = 1..T-2 (the vocab-wide work is most of a step), then narrowed per depth
        goals = t.mask[:, 2:]
        with torch.no_grad():
            goal_logits = (goal_head or head)(f[:, 1:T - 1][goals]).float()
            goal_probs, goal_ids = goal_logits.softmax(-1), goal_logits.argmax(-1)
            if candidates:
                top = goal_probs.topk(min(candidates, goal_probs.shape[-1]), -1).indices
                kept = torch.unique(torch.cat([top.flatten(), goal_ids]))  # sorted
                goal_probs, goal_ids = goal_probs[:, kept], torch.searchsorted(kept, goal_ids)
        vocab = head.weight[kept] if candidates else head.weight  # a trained head learns the rows it scores
        p = torch.arange(1, T - 1, device=ids.device).expand_as(goals)[goals]
        total, metrics = 0.0, {}
        for d, pred in enumerate(unroll(model, ids, inputs, depths, wanted), start=1):
            m = wanted[d - 1]
            pred, goal = pred[m], f[:, d:][m[:, :T - d]]
            probs, labels = goal_probs, goal_ids
            if d > 1:  # this depth's goals: those at p >= d, in the order of its loss rows
                keep = (p >= d).nonzero().squeeze(1)
                probs, labels = goal_probs.index_select(0, keep), goal_ids.index_select(0, keep)
            # the loss reads fp32; argmax over bf16 is slower on the CPU
            logits = F.linear(pred if head.norm is None else head.norm(pred), vocab).float()
            tok = cross_entropy_to(probs, logits)
            reg = feature_regression(pred, goal, torch.ones(len(pred), dtype=torch.bool, device=pred.device)) \
                if w_feature else torch.zeros(())
            total = total + decay ** (d - 1) * (w_feature * reg + w_token * tok)
            metrics[f"top1_d{d}"] = float((logits.argmax(-1) == labels).float().mean()) if len(labels) else 0.0
            if d == 1:
                metrics.update(feature_loss=reg.item(), token_loss=tok.item(), top1=metrics["top1_d1"])
        return total, metrics

    return loss_fn


@torch.no_grad()
def simulated_chain(model: EagleBase, target: Transformer, batches: list[dict], depth: int) -> dict:
    """Greedy chain drafting replayed on rows. From every start j (x_{j+2} an assistant token) the chain accepts
    depth d while the draft equals the target's full-vocabulary argmax and, from depth 2 on, the row's token fed
    at depth d is itself the target's argmax (else the replay feeds what inference never would). Returns the
    acceptance per depth given the previous one was accepted, and the chain's tau = 1 + mean accepted drafts."""
    offered, taken = torch.zeros(depth), torch.zeros(depth)
    accepted = starts = 0
    for batch in batches:
        t = target_features(target, batch, model.aux_layers)
        ids, f, mask = batch["input_ids"], t.features, t.mask
        # the target's choice for the token after each position, a row at a time: the [B, T, vocab] logits of
        # distill's 16 eval rows would take ~1 GB
        greedy = torch.cat([target.output(row).argmax(-1) for row in f.split(1)])
        alive = mask[:, 2:].clone()
        starts += int(alive.sum())
        depths = min(depth, ids.shape[1] - 2)
        chains = [F.pad(mask[:, 2:], (0, 1))] * depths  # the only rows a chain runs on at any depth: its start's
        for d, pred in enumerate(unroll(model, ids, t.drafter_input[:, :-1], depths, chains), start=1):
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


def build_eagle(target: Transformer, keep_ids: Tensor | None, from_target: bool = True) -> EagleModel:
    head = DraftHead(target.output, keep_ids)
    if from_target:
        model = EagleModel.from_target(target, head)
    else:
        model = EagleModel(target.config, target.tok_embeddings, head, target.max_seq_len).to(target.dtype)
    return model.requires_grad_(True).train()


class EagleRecipe(Recipe):
    ttt_depth, ttt_decay = 2, 0.7  # where distill.ttt_depth / ttt_decay are None

    def build(self, target, drafter, distill, keep_ids):
        return build_eagle(target, keep_ids)

    def target_blocks(self, drafter, n_layers):
        return (n_layers - 1,)  # EagleModel.from_target starts from the last block

    def loss(self, target, drafter, distill, keep_ids):
        return eagle_loss(target, distill.noise, distill.ttt_depth or self.ttt_depth, distill.ttt_decay or self.ttt_decay,
                          candidates=distill.token_candidates)

    def evaluator(self, target, val_batch, drafter):
        return lambda model: simulated_chain(model, target, [val_batch], drafter.depth)


RECIPE = EagleRecipe()
