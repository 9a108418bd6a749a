"""validate, in the retraining loop: the candidate beside the registry's champion on the held-out recent traffic
prepare kept (pipeline.traffic) and on the base validate prompts, tau for both, each bundle greedy with its own served
budget, as serving runs it. Promote reads the numbers (pipeline.registry.decide_on_traffic).

The champion is `models:/NAME@champion`, its bundle fetched through the registry and read as serving reads it (the
manifest's sha256 against the version's tag, every file's hash, the target's fingerprint).
"""
from __future__ import annotations

from typing import Callable

from pipeline.registry import CHAMPION, RegisteredBundle, alias_ref, aliased, fetch_bundle
from pipeline.stages.context import StageContext


def compared_champion(cfg) -> RegisteredBundle | None:
    """The champion validate compares with: only where prepare read traffic; None without one."""
    return aliased(**alias_ref(cfg, CHAMPION)) if cfg.data.traffic else None


def champion_inputs(cfg) -> dict:
    """What validate's digest covers beyond its sections: where the champion it compares with lives. Not its version:
    promote checks that the champion validate measured is still the champion, and says to rerun validate if not."""
    return {"versus": alias_ref(cfg, CHAMPION)} if cfg.data.traffic else {}


def traffic_prompts(ctx: StageContext, n: int) -> list[list[int]] | None:
    """The prompts of the newest `n` held-out traffic rows; None when prepare read no traffic."""
    from pipeline.traffic import TRAFFIC_VAL
    from train.data import TokenizedSet, prompts_from

    path = ctx.input("prepare") / TRAFFIC_VAL
    if not path.is_file():
        return None
    prompts = prompts_from(TokenizedSet.load(path), 1 << 30)
    return prompts[-n:]


def compare_with_champion(ctx: StageContext, base_prompts: list[list[int]],
                          tau_of: Callable[[object, list[list[int]], str], float]) -> dict | None:
    """{"metrics": traffic_tau, base_tau and, with a champion, champion_traffic_tau, champion_base_tau,
    compared_with_version; "traffic_prompts": how many; "champion": its identity or None}, or None without
    traffic. `tau_of(engine, prompts, label)`: greedy tau, as validate measures it."""
    from pipeline.bench.harness import fitting_context
    from pipeline.sources import target_fingerprint
    from runtime.bundle_reader import read_bundle
    from runtime.serving.served_engine import served_engine

    v = ctx.cfg.validate
    recent = traffic_prompts(ctx, v.num_prompts)
    if recent is None:
        return None
    fingerprint = target_fingerprint(ctx.target_dir)
    champion = compared_champion(ctx.cfg)
    bundles = {"candidate": read_bundle(ctx.input("export") / "bundle", fingerprint)}
    if champion is not None:
        bundles["champion"] = read_bundle(fetch_bundle(champion), fingerprint)
    prompts = {"traffic": recent, "base": base_prompts}
    everything = recent + base_prompts
    configured = ctx.configured_budget()
    longest = max([configured.tree.max_nodes + configured.lookup]
                  + [b.served_budget(configured).tree.max_nodes for b in bundles.values()])
    limit = fitting_context(ctx.target_dir, everything, v.max_new_tokens)
    max_seq_len = min(limit, max(map(len, everything)) + v.max_new_tokens + longest + 1)
    target = ctx.load_target(max_seq_len, v.precision)
    taus = {}
    for who, bundle in bundles.items():
        engine = served_engine(bundle, target, max_seq_len, fallback=configured, speed_check=False).engine
        taus[who] = {name: tau_of(engine, ids, f"validate: {who} on {name} prompts") for name, ids in prompts.items()}
    metrics = {"traffic_tau": taus["candidate"]["traffic"], "base_tau": taus["candidate"]["base"]}
    if champion is not None:
        metrics |= {"champion_traffic_tau": taus["champion"]["traffic"], "champion_base_tau": taus["champion"]["base"],
                    "compared_with_version": int(champion.version)}
    return {"metrics": metrics, "traffic_prompts": len(recent),
            "champion": None if champion is None else champion.identity}
