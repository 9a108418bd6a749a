"""The distill stage: train the configured drafter kind against the frozen target (its recipe in train/recipes),
write its config and weights, and the lookup branch's corpus; then measure its real tau."""
from __future__ import annotations

import json

from pipeline.errors import DraftsmithError
from pipeline.runstore import StageResult
from pipeline.stages.context import StageContext
from pipeline.stages.warm_start import load_warm_start, warm_start_bundle, warm_start_source, warm_start_weights
from runtime.bundle_reader import LOOKUP_CORPUS


def write_lookup_corpus(ctx: StageContext, vocab_size: int, inherited=None) -> int:
    """The lookup branch's corpus: the target's answers in the training rows (with their turn headers), then the
    corpus of the bundle warm started from (`inherited`), where a weighted drafter drafts with the branch and
    `drafter.lookup_corpus` is on. Returns its tokens (0: none)."""
    from runtime.drafters import get_kind
    from runtime.drafters.ngram import answer_spans, corpus_spans, merged_spans, save_corpus
    from train.data import TokenizedSet

    d = ctx.cfg.drafter
    if not (get_kind(d.kind).weighted and d.lookup and d.lookup_corpus):
        return 0
    ts = TokenizedSet.load(ctx.input("prepare") / "train.safetensors")
    spans = answer_spans(ts.input_ids, ts.loss_mask, ts.offsets)
    if inherited is not None and inherited.has(LOOKUP_CORPUS):
        spans = merged_spans(spans, corpus_spans(inherited.path(LOOKUP_CORPUS))[0])
    save_corpus(ctx.out / LOOKUP_CORPUS, spans, vocab_size)
    return sum(s.numel() for s in spans)


def recipe_settings(ctx: StageContext):
    """The drafter section as recipes read it: an `lm_base` preset or hub id resolved to its local directory."""
    from pipeline.sources import resolve_target

    d = ctx.cfg.drafter
    return d.model_copy(update={"lm_base": str(resolve_target(d.lm_base))}) if d.lm_base else d


def build(ctx: StageContext, target, keep_ids):
    """(recipe, untrained module, loss) of the configured kind, its random initial weights (LoRA's, a random init)
    drawn from the run's seed; settings that do not fit the target are a config error, in one line."""
    import torch

    from train.recipes import get_recipe

    recipe, settings, s = get_recipe(ctx.cfg.drafter.kind), recipe_settings(ctx), ctx.cfg.distill
    torch.manual_seed(ctx.cfg.run.seed)  # not from whatever the process drew before
    try:
        return recipe, recipe.build(target, settings, s, keep_ids), recipe.loss(target, settings, s, keep_ids)
    except ValueError as e:
        raise DraftsmithError(str(e)) from None


def distill_target(ctx: StageContext, teacher: bool = False):
    """The target as distill holds it: fp32 where the drafter starts as part of the target and trains in its dtype
    (under bf16 autocast where distill.precision asks), else in bf16 where training runs in bf16 (a base LM only
    learns from it, and an AVX512_BF16 CPU trains in bf16 though it infers in fp32); lean but for the blocks the
    recipe's initialisation copies. `teacher`: training reads prepare's cached features, so only those blocks are
    read, the rest left unread: training never runs them."""
    import torch

    from runtime.target.model_config import ModelConfig
    from runtime.target.precision import use_bf16
    from train.recipes import get_recipe

    d, recipe = ctx.cfg.drafter, get_recipe(ctx.cfg.drafter.kind)
    n_layers = ModelConfig.from_dir(ctx.target_dir).n_layers
    teaches = not recipe.copies_target(d) and use_bf16(ctx.cfg.distill.precision, torch.device("cpu"), training=True)
    plain = recipe.target_blocks(d, n_layers)
    return ctx.load_target(precision="bf16" if teaches else "fp32", plain_blocks=plain,
                           blocks=plain if teacher else None)


def run_distill(ctx: StageContext) -> StageResult:
    import torch
    from safetensors.torch import save_file

    from runtime.drafters import DRAFT_VOCAB, drafter_config, drafter_module, drafter_tensors, get_kind, served_drafter
    from runtime.drafters.ngram import load_corpus
    from runtime.drafters.shared.draft_head import frequent_token_ids
    from runtime.host_memory import release_freed_memory, returning_large_blocks
    from runtime.target.model_config import ModelConfig
    from runtime.target.precision import use_bf16
    from train.batches import Batches
    from train.data import TokenizedSet, prompts_from
    from train.shards import load_features
    from train.spec import TrainSpec
    from train.trainer import mlflow_logger, train

    d, s = ctx.cfg.drafter, ctx.cfg.distill
    kind = get_kind(d.kind)
    if not kind.weighted:  # built from its config alone, at run time
        (ctx.out / "drafter_config.json").write_text(json.dumps(kind.config(None, 0, d), indent=2) + "\n")
        return StageResult(outputs={"config": "drafter_config.json"}, message=f"{d.kind} drafter: nothing to train")
    prep = ctx.input("prepare")
    train_set = TokenizedSet.load(prep / "train.safetensors")
    streams = kind.streams(d, ModelConfig.from_dir(ctx.target_dir).n_layers)
    features = load_features(prep, "train", train_set.input_ids.numel(), streams)  # None: the target runs in training
    target = distill_target(ctx, teacher=features is not None)
    source = warm_start_source(ctx.cfg)
    inherited = warm_start_bundle(ctx, source) if source is not None else None
    warm = warm_start_weights(inherited) if inherited is not None else {}
    keep = None
    if d.draft_vocab and d.draft_vocab < target.config.vocab_size:
        # the champion's tokens fill what the data leaves; a champion without a draft vocabulary drafted every id
        champions = None if inherited is None else warm.get(DRAFT_VOCAB, torch.arange(target.config.vocab_size))
        keep = frequent_token_ids(train_set.input_ids, d.draft_vocab, fill=champions)
    recipe, model, loss_fn = build(ctx, target, keep)
    if source is not None:
        load_warm_start(ctx, source, model, target, warm)
    steps = s.warm_steps if source is not None else s.steps
    val = TokenizedSet.load(prep / "val.safetensors")
    result = {"step": 0, "metrics": {}, "seconds": 0.0}  # distill.steps 0: the drafter as built (an lm_base as it is)
    if steps:
        spec = TrainSpec(steps=steps, lr=s.lr, warmup=min(s.warmup, steps - 1), weight_decay=s.weight_decay,
                         ckpt_every=s.ckpt_every, eval_every=s.eval_every, seed=ctx.cfg.run.seed,
                         deepspeed=s.deepspeed, bf16_autocast=use_bf16(s.precision, target.device, training=True))
        # Checkpoints live outside the atomic stage dir, keyed by the inputs digest (and by the version a warm start
        # began from, which the digest does not hold): a killed distill resumes.
        ckpt = ctx.store.dir / (f".distill-ckpt-{ctx.digest[:16]}" + (f"-from-v{source.version}" if source else ""))
        batches = Batches(train_set, s.batch_size, seed=ctx.cfg.run.seed, features=features)
        val_features = load_features(prep, "val", val.input_ids.numel(), streams)
        val_batch = Batches(val, min(s.eval_rows, len(val)), seed=ctx.cfg.run.seed, features=val_features).batch_at(0)
        result = train(model, loss_fn, batches, spec, ckpt, log=mlflow_logger(),
                       eval_fn=recipe.evaluator(target, val_batch, d))
    model = recipe.finish(model)
    tensors = drafter_tensors(model, keep)
    save_file(tensors, str(ctx.out / "drafter.safetensors"))
    config = drafter_config(d.kind, model, 0 if keep is None else keep.numel(), d)
    (ctx.out / "drafter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    outputs = {"weights": "drafter.safetensors", "config": "drafter_config.json"}
    corpus_tokens = write_lookup_corpus(ctx, target.config.vocab_size, inherited)
    if corpus_tokens:
        outputs["lookup_corpus"] = LOOKUP_CORPUS
    del model, loss_fn  # the trained module: packed lean, the saved tensors are the drafter's one copy
    if features is not None:
        del target  # the teacher; the tau runs the target whole
    # measured exactly as the bundle reader will build it: from the saved config and tensors; the load's and the
    # packing's freed buffers handed back as they go (training kept them in the heap for its steps to reuse)
    with torch.inference_mode():
        with returning_large_blocks():
            if features is not None:
                target = distill_target(ctx)
            module = drafter_module(config, target, tensors)  # it holds the saved tensors: packed lean, they go
            vocab = {k: v for k, v in tensors.items() if k == DRAFT_VOCAB}
            del tensors
            release_freed_memory()  # the saved tensors, allocated in training's heap
            drafter = served_drafter(config, module, target, vocab)
        probe = ctx.tau_probe(prompts_from(val, 4), 48)
        tau = probe.measure(target, drafter)
        if d.lookup:  # what serving's trees can reach when calibrate keeps the branch
            corpus = load_corpus(ctx.out / LOOKUP_CORPUS, d.lookup) if corpus_tokens else None
            tau["tau_lookup"] = probe.measure(target, drafter, lookup=d.lookup, corpus=corpus)["tau"]
    metrics = {**{k: v for k, v in result["metrics"].items() if isinstance(v, (int, float))}, **tau,
               "steps": result["step"], "train_seconds": round(result["seconds"], 1),
               "offline_features": int(features is not None), "lookup_corpus_tokens": corpus_tokens}
    if source is not None:
        outputs["warm_start"] = f"models:/{source.name}/{source.version}"
        metrics["warm_start_version"] = int(source.version)
    return StageResult(outputs=outputs, metrics=metrics,
                       message=f"{d.kind}: tau {tau['tau']:.2f} on {tau['tau_prompts']} val prompts"
                       + (f" ({tau['tau_lookup']:.2f} with the lookup branch)" if d.lookup else "")
                       + ("" if steps else ", untrained (distill.steps 0)")
                       + warm_start_note(ctx, source, steps))


def warm_start_note(ctx: StageContext, source, steps: int) -> str:
    if source is not None:
        return f"; {steps} steps from models:/{source.name}/{source.version} (@{ctx.cfg.distill.warm_start})"
    if ctx.cfg.distill.warm_start:
        return f"; distill.warm_start={ctx.cfg.distill.warm_start}: no such version yet, trained from scratch"
    return ""
