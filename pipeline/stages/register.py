"""The register and promote stages: register the validated bundle as @candidate; move @champion when it wins."""
from __future__ import annotations

from pipeline.registry import CANDIDATE, CHAMPION, promote_candidate, register_bundle
from pipeline.runstore import StageResult
from pipeline.stages.context import StageContext


def run_register(ctx: StageContext) -> StageResult:
    v = register_bundle(ctx.cfg, ctx.store)
    name = ctx.cfg.register.model_name
    return StageResult(outputs={"model_name": name, "version": int(v.version),
                                "model_uri": f"models:/{name}/{v.version}"},
                       metrics={"version": int(v.version)},
                       message=f"registered {name} version {v.version} as @{CANDIDATE}")


def run_promote(ctx: StageContext) -> StageResult:
    version = ctx.store.record("register")["outputs"]["version"]  # this run's own version, not whatever is @candidate
    decision, metrics = promote_candidate(ctx.cfg, version)
    name = ctx.cfg.register.model_name
    verb = f"promoted {name} version {version} to @{CHAMPION}" if decision.promote else \
        f"kept @{CHAMPION} (version {metrics['champion_version']}), did not promote version {version}"
    return StageResult(outputs={"champion_version": metrics["champion_version"]}, metrics=metrics,
                       message=f"{verb}: {decision.reason}")
