"""The distill stage: train the configured drafter kind against the frozen target, then measure its tau."""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from pipeline.errors import DraftsmithError
from pipeline.stages import StageContext
from pipeline.runstore import StageResult
from runtime.draft_head import frequent_token_ids
from runtime.attention import SpecAttnConfig
from runtime.drafter import DraftBudget
from runtime.drafters import drafter_config, drafter_module, drafter_tensors, served_drafter
from runtime.engine import Engine, EngineConfig
from runtime.precision import float_dtype, use_bf16
from runtime.model import Transformer
from runtime.ngram import NgramDrafter, answer_spans
from runtime.quant_kv_cache import KVQuant
from runtime.sampling import SamplingParams
from train.batches import Batches
from train.data import TokenizedSet, prompts_from
from train.shards import load_features
from train.trainer import TrainSpec, mlflow_logger, train


def load_target(ctx: StageContext, max_seq_len: int = 2048, precision: str = "fp32") -> Transformer:
    """The target on CPU; precision auto|fp32|bf16 (runtime.precision: auto is bf16 where bf16 is fast)."""
    return Transformer.from_pretrained(ctx.target_dir, max_seq_len=max_seq_len,
                                       dtype=float_dtype(precision, torch.device("cpu")))


def draft_budget(ctx: StageContext) -> DraftBudget:
    d = ctx.cfg.drafter
    return DraftBudget(depth=d.depth, width=d.width, nodes=d.nodes)


@dataclass(frozen=True)
class TauProbe:
    """How distill and calibrate measure real tau: greedy speculative generation in the runtime (no fallback) of
    up to `new_tokens` per held-out prompt, with the draft budget, ending at end of turn as serving does."""
    prompts: list[list[int]]
    budget: DraftBudget
    new_tokens: int
    stop_ids: tuple[int, ...] = ()

    def measure(self, target: Transformer, drafter, sparse: SpecAttnConfig | None = None, kv: KVQuant | None = None,
                lookup: int = 0, corpus: NgramDrafter | None = None) -> dict:
        """With `sparse` the target verifies with SpecAttn, and the KV reads it saved (mean over prompts) are
        reported too; with `kv` the target's and the drafter's KV histories are quantised; with `lookup` the n-gram
        lookup branch joins the drafter's trees, drafting from `corpus` where a reply has no match."""
        engine = Engine(target, drafter, EngineConfig(
            max_seq_len=target.max_seq_len, budget=self.budget, adaptive=False, sparse=sparse,
            kv_scheme=kv and kv.scheme, kv_recent=kv.recent if kv else EngineConfig.kv_recent, lookup=lookup,
            lookup_corpus=corpus))
        forwards = tokens = 0
        saved = []
        for ids in self.prompts:
            m = engine.generate(ids, self.new_tokens, SamplingParams(), None, self.stop_ids).metrics
            forwards, tokens = forwards + m.target_forwards, tokens + m.new_tokens - 1  # the first is prefill's
            saved.append(m.kv_saved)
        tau = {"tau": tokens / max(forwards, 1), "tau_prompts": len(self.prompts), "tau_tokens": tokens}
        return tau if sparse is None else {**tau, "kv_saved": sum(saved) / max(len(saved), 1)}


def tau_probe(ctx: StageContext, prompts: list[list[int]], new_tokens: int) -> TauProbe:
    """The run's TauProbe: the configured draft budget, the target's end-of-turn ids."""
    from runtime.bench import generation_stop_ids

    return TauProbe(prompts, draft_budget(ctx), new_tokens, generation_stop_ids(ctx.target_dir))


def corpus_spans(ctx: StageContext) -> list[torch.Tensor] | None:
    """The lookup branch's corpus: the target's answers in the training rows (with their turn headers), when the
    drafter drafts with the branch (an ngram drafter has none) and `drafter.lookup_corpus` is on; None otherwise."""
    d = ctx.cfg.drafter
    if d.kind == "ngram" or not (d.lookup and d.lookup_corpus):
        return None
    ts = TokenizedSet.load(ctx.input("prepare") / "train.safetensors")
    return answer_spans(ts.input_ids, ts.loss_mask, ts.offsets)


def lookup_corpus(ctx: StageContext, vocab_size: int) -> NgramDrafter | None:
    """corpus_spans as the trie the engine drafts from, as a bundle's reader builds it (runtime.ngram.load_corpus)."""
    spans = corpus_spans(ctx)
    return None if spans is None else NgramDrafter.corpus(vocab_size, spans, max_depth=ctx.cfg.drafter.lookup)


def build(ctx: StageContext, target: Transformer, train_set: TokenizedSet):
    from pipeline.sources import resolve_target
    from train import recipes

    d, s = ctx.cfg.drafter, ctx.cfg.distill
    keep = None
    if d.draft_vocab and d.draft_vocab < target.config.vocab_size:
        keep = frequent_token_ids(train_set.input_ids, d.draft_vocab)
    if d.kind == "eagle":
        loss = recipes.eagle_loss(target, s.noise, s.ttt_depth, candidates=s.token_candidates)
        return recipes.build_eagle(target, keep), loss, keep
    if d.kind == "medusa":
        return recipes.build_medusa(target, d.medusa_heads, keep), recipes.medusa_loss(target), keep
    if d.kind == "lm":
        try:
            model = (recipes.build_lm_lora(target, resolve_target(d.lm_base), d.lora_rank) if d.lm_base
                     else recipes.build_lm(target, d.lm_layers, d.lm_init))
        except ValueError as e:  # drafter.lm_* settings that do not fit this target: a config error
            raise DraftsmithError(str(e)) from None
        return model, recipes.lm_kd_loss(target, s.kd_loss, keep), keep
    raise ValueError(f"drafter.kind={d.kind!r} has no training recipe yet")


def simulated_tau(ctx: StageContext, target: Transformer, val: TokenizedSet):
    """eval_fn for the trainer: greedy chain drafting replayed on validation rows (train.recipes.simulated_chain)."""
    from train import recipes

    rows = min(ctx.cfg.distill.eval_rows, len(val))
    features = load_features(ctx.input("prepare"), "val", val.input_ids.numel())
    batch = Batches(val, rows, seed=ctx.cfg.run.seed, features=features).batch_at(0)
    return lambda model: recipes.simulated_chain(model, target, [batch], ctx.cfg.drafter.depth)


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
    spec = TrainSpec(steps=s.steps, lr=s.lr, warmup=min(s.warmup, s.steps - 1), weight_decay=s.weight_decay,
                     ckpt_every=s.ckpt_every, eval_every=s.eval_every, seed=ctx.cfg.run.seed, deepspeed=s.deepspeed,
                     bf16_autocast=use_bf16(s.precision, target.device, training=True))
    # Checkpoints live outside the atomic stage dir, keyed by the inputs digest: a killed distill resumes.
    ckpt = ctx.store.dir / f".distill-ckpt-{ctx.digest[:16]}"
    features = load_features(prep, "train", train_set.input_ids.numel())  # None: the target runs in training
    batches = Batches(train_set, s.batch_size, seed=ctx.cfg.run.seed, features=features)
    val = TokenizedSet.load(prep / "val.safetensors")
    result = train(model, loss_fn, batches, spec, ckpt, log=mlflow_logger(),
                   eval_fn=simulated_tau(ctx, target, val) if d.kind == "eagle" else None)
    from safetensors.torch import save_file

    from train.recipes import merge_lora

    model = merge_lora(model)  # an lm_base drafter ships as its base LM with the adapters folded in
    tensors = drafter_tensors(model, keep)
    save_file(tensors, str(ctx.out / "drafter.safetensors"))
    config = drafter_config(d.kind, model, 0 if keep is None else keep.numel())
    (ctx.out / "drafter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    # measured exactly as the bundle reader will build it: from the saved config and tensors
    drafter = served_drafter(d.kind, drafter_module(config, target, tensors), target, tensors)
    probe = tau_probe(ctx, prompts_from(val, 4), 48)
    tau = probe.measure(target, drafter)
    if d.lookup:  # what serving's trees can reach when calibrate keeps the branch
        corpus = lookup_corpus(ctx, target.config.vocab_size)
        tau["tau_lookup"] = probe.measure(target, drafter, lookup=d.lookup, corpus=corpus)["tau"]
    metrics = {**{k: v for k, v in result["metrics"].items() if isinstance(v, (int, float))}, **tau,
               "steps": result["step"], "train_seconds": round(result["seconds"], 1),
               "offline_features": int(features is not None)}
    return StageResult(outputs={"weights": "drafter.safetensors", "config": "drafter_config.json"},
                       metrics=metrics, message=f"{d.kind}: tau {tau['tau']:.2f} on {tau['tau_prompts']} val prompts"
                       + (f" ({tau['tau_lookup']:.2f} with the lookup branch)" if d.lookup else ""))
