"""A registered drafter made ready to serve: the one loading path that MLflow's pyfunc and the OpenAI-compatible
server both run. It resolves the target, checks that the bundle was built for exactly these weights (and every file
hash), builds the served engine as validate measured it, batched, and starts the scheduler that owns it."""
from __future__ import annotations

import sys
from dataclasses import dataclass

from pipeline.serving.settings import BatchSettings, budget_source, serving_device


@dataclass(frozen=True)
class ServedModel:
    tokenizer: object  # the target's (transformers) tokenizer
    engine: object  # runtime.serving.batch_engine.BatchEngine
    scheduler: object  # runtime.serving.scheduler.Scheduler, owning `engine`
    stop_ids: tuple[int, ...]  # where a reply ends: the end-of-turn token
    max_new_tokens: int  # a request that names no length gets validate's
    settings: BatchSettings

    @property
    def max_seq_len(self) -> int:
        return self.engine.cfg.max_seq_len

    def chat_ids(self, prompt: str) -> list[int]:
        """One user turn in the chat template: the same encoding validate and the benchmark measure."""
        from pipeline.tokens import encode

        return encode(self.tokenizer, prompt)


def load_served(model_config: dict, bundle_dir: str, batching: BatchSettings | None = None) -> ServedModel:
    """`model_config` as register logs it (target, max_new_tokens, budget, precision); `batching` default: the
    environment's (BatchSettings.from_env)."""
    from transformers import AutoTokenizer

    from pipeline.bench.harness import default_bench_prompts
    from pipeline.serving.policy_cache import kept_policy
    from pipeline.sources import resolve_target, target_fingerprint
    from pipeline.tokens import encode, stop_ids
    from runtime.bundle_reader import read_bundle
    from runtime.host_memory import release_freed_memory
    from runtime.serving.budget_tuner import BATCH_NEW_TOKENS, describe
    from runtime.serving.scheduler import Scheduler
    from runtime.serving.served_engine import served_engine
    from runtime.speculation.draft_budget import ServedBudget
    from runtime.target.loading import from_pretrained
    from runtime.target.precision import float_dtype

    target_dir = resolve_target(model_config["target"])
    # Refuse to serve a drafter against weights other than those it was trained and validated for.
    bundle = read_bundle(bundle_dir, expect_target_fingerprint=target_fingerprint(target_dir))
    device = serving_device()
    # validate's precision, resolved on this device; models registered before it was recorded ran fp32
    dtype = float_dtype(model_config.get("precision", "fp32"), device)
    # lean on a CPU: one copy of each weight, as a bundle's drafter reads only the target's embedding and head
    target = from_pretrained(target_dir, dtype=dtype, device=device, lean=device.type == "cpu")
    release_freed_memory()  # the load's buffers and the plain weights lean packing let go
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    on_device = budget_source(device) == "device"
    batching = batching or BatchSettings.from_env()
    probes = [encode(tokenizer, p) for p in default_bench_prompts()]
    served = served_engine(bundle, target, target.max_seq_len, fallback=ServedBudget.from_dict(model_config["budget"]),
                           device_prompt=probes[0] if on_device else None)
    if served.device_report is not None:
        print(describe(served.device_report), file=sys.stderr)
    policy = None
    if batching.policy == "measured":
        policy, path, kept = kept_policy(bundle, served, batching.max_batch, probes, BATCH_NEW_TOKENS,
                                         lambda: served.measure_policy(batching.max_batch, probes, BATCH_NEW_TOKENS))
        print(f"batch policy {'kept from an earlier start' if kept else 'measured, kept'} in {path}", file=sys.stderr)
    engine, note = served.batched(batching.max_batch, policy, plain=batching.policy == "plain",
                                  learn_tokens=batching.learn_tokens)
    print(f"serving {batching.max_batch} rows at once, a queue of {batching.max_queue}, a "
          f"{batching.timeout_s:g} s timeout; draft budget by batch size: "
          f"{engine.policy.describe() if engine.drafter is not None else 'none (plain decoding)'}"
          + f"; drafting also from the last {batching.learn_tokens} tokens of replies served" * (engine.replies is not None)
          + f"; {note}" * bool(note), file=sys.stderr)
    return ServedModel(tokenizer, engine, Scheduler(engine, batching.max_queue, batching.timeout_s),
                       stop_ids(tokenizer), int(model_config["max_new_tokens"]), batching)
