"""The distill stage: train the configured drafter kind against the frozen target, then measure its tau."""
from __future__ import annotations

import json

import torch

from pipeline.stages import StageContext
from pipeline.runstore import StageResult
from runtime.draft_head import frequent_token_ids
from runtime.drafter import DraftBudget
from runtime.drafters import DRAFT_VOCAB
from runtime.engine import Engine, EngineConfig
from runtime.model import Transformer
from runtime.sampling import SamplingParams
from train.batches import Batches
from train.data import TokenizedSet, prompts_from
from train.trainer import TrainSpec, mlflow_logger, train


def load_target(ctx: StageContext, max_seq_len: int = 2048) -> Transformer:
    return Transformer.from_pretrained(ctx.target_dir, max_seq_len=max_seq_len)


def draft_budget(ctx: StageContext) -> DraftBudget:
    d = ctx.cfg.drafter
    return DraftBudget(depth=d.depth, width=d.width, nodes=d.nodes)


def measure_tau(target: Transformer, drafter, prompts: list[list[int]], budget: DraftBudget,
                max_new_tokens: int) -> dict:
    """Real tau: greedy speculative generation in the runtime on held-out prompts (no fallback)."""
    engine = Engine(target, drafter, EngineConfig(max_seq_len=target.max_seq_len, budget=budget, adaptive=False))
    forwards = tokens = 0
    for ids in prompts:
        m = engine.generate(ids, max_new_tokens, SamplingParams()).metrics
        forwards, tokens = forwards + m.target_forwards, tokens + m.new_tokens - 1  # the first token is prefill's
    return {"tau": tokens / max(forwards, 1), "tau_prompts": len(prompts)}


def build(ctx: StageContext, target: Transformer, train_set: TokenizedSet):
    from train import recipes

    d, s = ctx.cfg.drafter, ctx.cfg.distill
    keep = None
    if d.draft_vocab and d.draft_vocab < target.config.vocab_size:
        keep = frequent_token_ids(train_set.input_ids, d.draft_vocab)
    if d.kind == "eagle":
        return recipes.build_eagle(target, keep), recipes.eagle_loss(target, noise=s.noise), keep
    if d.kind == "medusa":
        return recipes.build_medusa(target, d.medusa_heads, keep), recipes.medusa_loss(target), keep
    raise ValueError(f"drafter.kind={d.kind!r} has no training recipe yet")


def run_distill(ctx: StageContext) -> StageResult:
    d, s = ctx.cfg.drafter, ctx.cfg.distill
    prep = ctx.input("prepare")
    if d.kind == "ngram":  # no weights: the trie is built from each prompt at run time
        cfg = {"kind": "ngram", "max_ngram": d.max_ngram}
        (ctx.out / "drafter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        return StageResult(outputs={"config": "drafter_config.json"}, message="ngram drafter: nothing to train")
    target = load_target(ctx)
    train_set = TokenizedSet.load(prep / "train.safetensors")
    model, loss_fn, keep = build(ctx, target, train_set)
    spec = TrainSpec(steps=s.steps, lr=s.lr, warmup=min(s.warmup, s.steps - 1), ckpt_every=s.ckpt_every,
                     seed=ctx.cfg.run.seed, deepspeed=s.deepspeed)
    # Checkpoints live outside the atomic stage dir, keyed by the inputs digest: a killed distill resumes.
    ckpt = ctx.store.dir / f".distill-ckpt-{ctx.digest[:16]}"
    result = train(model, loss_fn, Batches(train_set, s.batch_size, seed=ctx.cfg.run.seed), spec, ckpt,
                   log=mlflow_logger())
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if keep is not None:
        tensors[DRAFT_VOCAB] = keep
    from safetensors.torch import save_file

    save_file(tensors, str(ctx.out / "drafter.safetensors"))
    config = model.cfg.to_dict() if d.kind == "medusa" else {"kind": "eagle", "draft_vocab": int(d.draft_vocab)}
    (ctx.out / "drafter_config.json").write_text(json.dumps(config, indent=2) + "\n")

    from runtime.eagle import EagleDrafter
    from runtime.medusa import MedusaDrafter

    model.eval()
    drafter = EagleDrafter(model, target.max_seq_len + 64) if d.kind == "eagle" else MedusaDrafter(model)
    val = TokenizedSet.load(prep / "val.safetensors")
    tau = measure_tau(target, drafter, prompts_from(val, 4), draft_budget(ctx), 48)
    metrics = {**{k: v for k, v in result["metrics"].items() if isinstance(v, (int, float))}, **tau,
               "steps": result["step"], "train_seconds": round(result["seconds"], 1)}
    return StageResult(outputs={"weights": "drafter.safetensors", "config": "drafter_config.json"},
                       metrics=metrics, message=f"{d.kind}: tau {tau['tau']:.2f} on {tau['tau_prompts']} val prompts")
