"""distill's warm start (`distill.warm_start`, e.g. champion): the drafter starts from a registered version's
weights instead of its kind's initialisation, and trains for `distill.warm_steps`.

The version's bundle is fetched through the registry and read as serving reads it (the manifest's sha256 against the
version's tag, every file's hash, the target's fingerprint); calibrate's packed weights are restored first. The draft
vocabulary is chosen afresh from the new data, and the slots it leaves (a retraining set is small) keep the
champion's tokens; a trained head's rows (EAGLE-3's) are carried over for the tokens both vocabularies hold, the
others start from the target's lm_head as a cold start's do. The lookup corpus keeps the champion's spans after the
new answers: a retraining set holds a slice of the base data, and the branch would forget the rest.
"""
from __future__ import annotations

import torch
from torch import nn

from pipeline.errors import DraftsmithError
from pipeline.registry import RegisteredBundle, alias_ref, aliased, fetch_bundle
from pipeline.stages.context import StageContext


def warm_start_source(cfg) -> RegisteredBundle | None:
    """The registered version distill starts from; None when not asked, or when the alias names no version yet."""
    return aliased(**alias_ref(cfg, cfg.distill.warm_start)) if cfg.distill.warm_start else None


def warm_start_inputs(cfg) -> dict:
    """What distill's digest covers beyond its sections: the registry and alias it starts from. Not the version: a
    finished run is not retrained because the alias moved since (its own promotion, say); a new run reads it anew."""
    return {"warm_start": alias_ref(cfg, cfg.distill.warm_start)} if cfg.distill.warm_start else {}


def warm_start_bundle(ctx: StageContext, source: RegisteredBundle):
    """`source`'s bundle, read as serving reads it, of the configured drafter kind."""
    from pipeline.sources import target_fingerprint
    from runtime.bundle_reader import BundleError, read_bundle

    try:
        bundle = read_bundle(fetch_bundle(source), target_fingerprint(ctx.target_dir))
    except BundleError as e:
        raise DraftsmithError(f"{source_label(ctx, source)}: {e}") from None
    if bundle.kind != ctx.cfg.drafter.kind:
        raise DraftsmithError(f"{source_label(ctx, source)} is a {bundle.kind} drafter, drafter.kind is "
                              f"{ctx.cfg.drafter.kind}: warm start continues training the same kind")
    return bundle


def warm_start_weights(bundle) -> dict[str, torch.Tensor]:
    """The bundle's drafter tensors in fp32, its draft vocabulary among them if it has one."""
    from runtime.drafters import bundle_weights

    return bundle_weights(bundle, torch.float32)[1]


def load_warm_start(ctx: StageContext, source: RegisteredBundle, model: nn.Module, target,
                    tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Load `source`'s drafter weights (`tensors`, when already read) into `model` (built by the recipe, for this
    run's draft vocabulary)."""
    from runtime.drafters import DRAFT_VOCAB

    tensors = dict(warm_start_weights(warm_start_bundle(ctx, source)) if tensors is None else tensors)
    old_vocab = tensors.pop(DRAFT_VOCAB, None)
    tensors |= carried_head_rows(model, tensors, old_vocab, target.config.vocab_size)
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False)
    except RuntimeError as e:  # a shape that differs: another drafter.* setting
        raise DraftsmithError(f"{source_label(ctx, source)}: its weights do not fit the configured drafter "
                              f"({str(e).splitlines()[1].strip()}); are drafter.* the champion's?") from None
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [m for m in missing if not any(params.get(m) is params.get(w) for w in tensors)]  # tied: loaded once
    if missing or unexpected:
        raise DraftsmithError(f"{source_label(ctx, source)}: its weights do not fit the configured drafter (missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}); are drafter.* the champion's?")


def source_label(ctx: StageContext, source: RegisteredBundle) -> str:
    return f"distill.warm_start={ctx.cfg.distill.warm_start}: models:/{source.name}/{source.version}"


def carried_head_rows(model: nn.Module, tensors: dict, old_vocab: torch.Tensor | None,
                      vocab_size: int) -> dict[str, torch.Tensor]:
    """Each trained DraftHead's weight for the new draft vocabulary: the saved row of a token both vocabularies hold,
    the model's fresh row (the target's) for the others."""
    from runtime.drafters.shared.draft_head import DraftHead

    old_ids = torch.arange(vocab_size) if old_vocab is None else torch.unique(old_vocab.long())
    where_old = torch.full((vocab_size,), -1, dtype=torch.long)
    where_old[old_ids] = torch.arange(old_ids.numel())
    out = {}
    for prefix, head in model.named_modules():
        name = f"{prefix}.weight" if prefix else "weight"
        if not isinstance(head, DraftHead) or not isinstance(head.weight, nn.Parameter) or name not in tensors:
            continue
        new_ids = torch.arange(vocab_size) if head.keep_ids is None else head.keep_ids.cpu()
        rows, saved = head.weight.detach().cpu().float().clone(), tensors[name]
        found = where_old[new_ids]
        rows[found >= 0] = saved[found[found >= 0]].float()
        out[name] = rows
    return out
