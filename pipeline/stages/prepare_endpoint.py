"""prepare's regeneration through an OpenAI-compatible server (`data.regen_url`): the settings and the one-line
errors.

With `data.cache_hidden` the features pass still runs here, on the target loaded locally, over the re-tokenised rows:
the features then belong to exactly the ids distill trains on. Without it prepare never loads the target.
"""
from __future__ import annotations

import os
from pathlib import Path

from pipeline.config import Config, DataCfg
from pipeline.errors import DraftsmithError


def check_regen_url(d: DataCfg) -> None:
    if d.regen_url is not None and not d.regenerate:
        raise DraftsmithError(f"data.regen_url={d.regen_url} is set but data.regenerate is false: nothing would be "
                              "regenerated; unset data.regen_url or set data.regenerate=true")


def needs_local_target(d: DataCfg) -> bool:
    return d.cache_hidden or (d.regenerate and d.regen_url is None)


def regenerate_split(cfg: Config, tokenizer, conversations: list[list[dict]], work: Path) -> str:
    """Regenerate one split through the endpoint into shards under `work`; returns the model id asked."""
    from pipeline.tokens import stop_ids
    from runtime.speculation.sampling import SamplingParams
    from train.regenerate import RegenSettings
    from train.regenerate_endpoint import Endpoint, EndpointError, regenerate_via_endpoint

    d = cfg.data
    endpoint = Endpoint(url=d.regen_url, model=d.regen_model, api_key=os.environ.get(d.regen_api_key_env) or None,
                        concurrency=d.regen_concurrency, retries=d.regen_retries, timeout_s=d.regen_timeout_s)
    settings = RegenSettings(max_length=d.max_length, max_new_tokens=d.regen_max_new_tokens,
                             min_assistant_tokens=d.min_assistant_tokens, batch_size=d.regen_batch_size,
                             params=SamplingParams(temperature=d.regen_temperature), keep_hidden=False,
                             seed=cfg.run.seed)
    eos = stop_ids(tokenizer)
    try:
        return regenerate_via_endpoint(endpoint, tokenizer, conversations, work, settings, eos[0] if eos else None)
    except EndpointError as e:
        raise DraftsmithError(f"prepare: data.regen_url {e}; finished conversations are kept, a rerun continues "
                              "from them") from None


def endpoint_pass(cfg: Config, target, tokenizer, conversations: list[list[dict]], work: Path,
                  streams: tuple[int, ...]):
    """prepare.target_pass with the endpoint regenerating: (rows, features or None, dropped counts by reason); the
    features from the local `target` over the re-tokenised rows, when it is loaded (data.cache_hidden)."""
    from train.regenerate import cache_features
    from train.shards import merge_shards

    regenerate_split(cfg, tokenizer, conversations, work)
    rows, _, dropped = merge_shards(work)
    if target is None:
        return rows, None, dropped
    cache_features(target, rows, work / "features", cfg.data.regen_batch_size, streams)
    return rows, merge_shards(work / "features")[1], dropped
