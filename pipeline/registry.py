"""The MLflow model registry: register validated bundles, move the `champion` alias, roll back.

Every model version carries its validation metrics as `metric.<name>` tags and its lineage as plain tags
(run id, target and data fingerprints, config digest, code version, validation set digest), so a promotion
decision needs nothing but the registry. Aliases move in one registry call each: serving, which loads
models:/NAME@champion, sees either the old champion or the new one, never half a move.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import Config
from pipeline.errors import DraftsmithError
from pipeline.home import digest_json, sha256_file
from pipeline.runstore import RunStore
from pipeline.tracking import flatten, tracking_uri

CANDIDATE = "candidate"
CHAMPION = "champion"
METRIC_TAG = "metric."  # prefix of the tags holding validation metrics
# what validate measures beside the champion when prepare read served traffic (champion_*: absent without one)
TRAFFIC_METRICS = ("traffic_tau", "base_tau", "champion_traffic_tau", "champion_base_tau", "compared_with_version")
MODEL_ARTIFACT = "drafter"  # name of the pyfunc model inside its MLflow logged model
SERVING_MODEL = Path(__file__).parent / "serving" / "model_file.py"  # the pyfunc as code: nothing is pickled


def registry_client(cfg: Config):
    """An MlflowClient on the configured tracking URI, which is also the registry URI."""
    import mlflow

    uri = tracking_uri(cfg)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)


def _tag_value(v) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def tag_metric(tags: dict[str, str], metric: str) -> float | None:
    """A validation metric read back from a model version's tags (None if it was not recorded)."""
    raw = tags.get(METRIC_TAG + metric)
    return None if raw is None else float(json.loads(raw))


@dataclass(frozen=True)
class ValidatedBundle:
    """What `register` reads from a run: the verified bundle, its validation report, and the lineage tags."""
    bundle_dir: Path
    report: dict
    tags: dict[str, str]


def read_validated(store: RunStore) -> ValidatedBundle:
    """The run's bundle, if and only if validation finished and its gate passed; otherwise a DraftsmithError."""
    from runtime.bundle_reader import MANIFEST, read_bundle

    rec = store.record("validate")
    if rec is None:
        raise DraftsmithError(f"register refuses run {store.run_id}: it has no finished validate stage "
                              f"({store.stage_dir('validate')}/stage.json is missing)")
    report_path = store.stage_dir("validate") / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else None
    if report is None or "metrics" not in report or "gate" not in report:
        raise DraftsmithError(f"register refuses run {store.run_id}: {report_path} is missing or has no "
                              "metrics/gate (expected the validate stage's report)")
    if rec["status"] != "completed" or not report["gate"].get("passed"):
        reasons = "; ".join(report["gate"].get("reasons") or []) or rec.get("message") or "no reason recorded"
        raise DraftsmithError(f"register refuses run {store.run_id}: the validation gate failed ({reasons})")
    bundle = read_bundle(store.stage_dir("export") / "bundle")  # checks every file hash before we publish it
    m = bundle.manifest
    lineage = {"run_id": store.run_id, "target_fingerprint": m["target_fingerprint"],
               "data_digest": m["data_digest"], "config_digest": digest_json(m["config"]),
               "code_version": m["code_version"], "validation_digest": report["validation_digest"],
               "drafter_kind": bundle.kind, "bundle_sha256": sha256_file(bundle.dir / MANIFEST)}
    metrics = {f"{METRIC_TAG}{k}": _tag_value(v) for k, v in flatten("", report["metrics"]).items()}
    return ValidatedBundle(bundle.dir, report, {**lineage, **metrics})


def _serving_target(spec: str) -> str:
    # A target given as a local path must still resolve when the server runs from another directory.
    p = Path(spec).expanduser()
    return str(p.resolve()) if p.exists() else spec


def served_budget(report: dict) -> dict:
    """The draft budget the bundle serves, as validate ran it (runtime.speculation.draft_budget.ServedBudget's keys)."""
    return {k: report["budget"][k] for k in ("depth", "width", "nodes", "adaptive", "lookup", "max_tree")}


def register_bundle(cfg: Config, store: RunStore):
    """Log the run's validated bundle as a pyfunc model, register it, point `candidate` at it.

    Idempotent: a retry of the same run, bundle and report finds the version it registered before.
    Runs inside the register stage's MLflow run (pipeline.tracking.stage_run), which the model is logged under.
    """
    import mlflow

    from pipeline.serving.pyfunc import pyfunc_signature

    validated = read_validated(store)
    if mlflow.active_run() is None:
        raise DraftsmithError("register_bundle logs the model under the register stage's MLflow run: call it "
                              "inside pipeline.tracking.stage_run (as `pipeline run --stage register` does)")
    name = cfg.register.model_name
    client = registry_client(cfg)
    tags = {**validated.tags, "registration": digest_json({"tags": validated.tags, "report": validated.report})}
    found = client.search_model_versions(f"name = '{name}' and tags.registration = '{tags['registration']}'")
    if found:
        version = found[0]
    else:
        # Explicit requirements skip MLflow's inference (which imports the model); `pipeline serve` uses
        # --env-manager local, i.e. this installation.
        info = mlflow.pyfunc.log_model(
            name=MODEL_ARTIFACT, python_model=str(SERVING_MODEL), artifacts={"bundle": str(validated.bundle_dir)},
            model_config={"target": _serving_target(cfg.target), "max_new_tokens": cfg.validate.max_new_tokens,
                          "budget": served_budget(validated.report),  # the draft budget validate measured
                          "precision": cfg.validate.precision},  # and the precision it measured in
            signature=pyfunc_signature(), pip_requirements=[f"mlflow=={mlflow.__version__}"])
        version = mlflow.register_model(info.model_uri, name, tags=tags)
    client.set_registered_model_alias(name, CANDIDATE, version.version)
    return version


# ---------------------------------------------------------------- promotion

@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str


def decide(candidate: dict[str, str], champion: dict[str, str] | None, metric: str) -> Decision:
    """Should `candidate` (version tags) replace `champion`? Higher `metric` is better, on the same prompts."""
    key = METRIC_TAG + metric
    if key not in candidate:
        known = sorted(k.removeprefix(METRIC_TAG) for k in candidate if k.startswith(METRIC_TAG))
        raise DraftsmithError(f"promote.metric {metric!r}: the candidate has no such validation metric "
                              f"(expected one of {', '.join(known)})")
    if json.loads(candidate.get(METRIC_TAG + "lossless", "false")) is not True:
        return Decision(False, "the candidate is not lossless")
    if champion is None:
        return Decision(True, "there is no champion yet")
    if candidate.get("validation_digest") != champion.get("validation_digest"):
        return Decision(False, "the champion was validated on a different prompt set "
                               f"({str(champion.get('validation_digest'))[:12]} vs "
                               f"{str(candidate.get('validation_digest'))[:12]}); the numbers do not compare")
    new, old = tag_metric(candidate, metric), tag_metric(champion, metric)
    if old is None:
        return Decision(True, f"the champion has no {metric} recorded")
    if new > old:
        return Decision(True, f"{metric} {new:.4g} beats the champion's {old:.4g}")
    return Decision(False, f"{metric} {new:.4g} does not beat the champion's {old:.4g}")


def decide_on_traffic(candidate: dict[str, str], champion_version: str | None, margin: float) -> Decision:
    """The loop's rule, for a candidate validate measured beside the champion on held-out served traffic and on the
    base prompts: promote only when it wins on traffic and loses at most `margin` tau on the base prompts. The
    champion it was measured against must still be the champion."""
    if json.loads(candidate.get(METRIC_TAG + "lossless", "false")) is not True:
        return Decision(False, "the candidate is not lossless")
    measured = tag_metric(candidate, "compared_with_version")
    if champion_version is None:
        return Decision(True, "there is no champion yet")
    if measured is None or int(measured) != int(champion_version):
        was = "no champion" if measured is None else f"version {int(measured)}"
        return Decision(False, f"validate compared it with {was}, but version {champion_version} is the champion "
                               "now; rerun validate to compare with it")
    new, old = tag_metric(candidate, "traffic_tau"), tag_metric(candidate, "champion_traffic_tau")
    base, base_old = tag_metric(candidate, "base_tau"), tag_metric(candidate, "champion_base_tau")
    if not new > old:
        return Decision(False, f"traffic tau {new:.3f} does not beat the champion's {old:.3f}")
    if base < base_old - margin:
        return Decision(False, f"traffic tau {new:.3f} beats the champion's {old:.3f}, but base tau {base:.3f} is "
                               f"more than promote.base_margin {margin:g} below the champion's {base_old:.3f}")
    return Decision(True, f"traffic tau {new:.3f} beats the champion's {old:.3f}, base tau {base:.3f} against its "
                          f"{base_old:.3f} (promote.base_margin {margin:g})")


def _version(client, name: str, version: int | str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version(name, str(version))
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise DraftsmithError(f"model {name!r} has no version {version!r} in the registry") from None
        raise


def _champion(client, name: str):
    """The model version behind @champion, or None. (Call once the model exists: a version was found.)"""
    version = client.get_registered_model(name).aliases.get(CHAMPION)
    return None if version is None else client.get_model_version(name, version)


def promote_candidate(cfg: Config, version: int | str) -> tuple[Decision, dict]:
    """Make registered `version` the champion if `decide` says so; return the decision and its metrics."""
    name, metric = cfg.register.model_name, cfg.promote.metric
    client = registry_client(cfg)
    cand = _version(client, name, version)
    champ = _champion(client, name)
    on_traffic = METRIC_TAG + "traffic_tau" in cand.tags  # validated beside the champion on served traffic
    if champ is not None and champ.version == cand.version:
        decision = Decision(False, f"version {cand.version} is already the champion")
    elif on_traffic:
        decision = decide_on_traffic(cand.tags, champ.version if champ else None, cfg.promote.base_margin)
    else:
        decision = decide(cand.tags, champ.tags if champ else None, metric)
    if decision.promote:
        client.set_registered_model_alias(name, CHAMPION, cand.version)  # one atomic registry write
    now = cand if decision.promote else champ
    metrics = {"promoted": decision.promote, "candidate_version": int(cand.version),
               "champion_version": int(now.version) if now else None,
               f"candidate_{metric}": tag_metric(cand.tags, metric),
               f"previous_champion_{metric}": tag_metric(champ.tags, metric) if champ else None}
    if on_traffic:
        metrics |= {k: tag_metric(cand.tags, k) for k in TRAFFIC_METRICS}
    return decision, metrics


def promote_to(cfg: Config, version: int | str) -> str:
    """Rollback or manual promotion: point `champion` at `version` unconditionally; return what changed."""
    name = cfg.register.model_name
    client = registry_client(cfg)
    target = _version(client, name, version)
    before = _champion(client, name)
    client.set_registered_model_alias(name, CHAMPION, target.version)
    was = f"version {before.version}" if before else "no champion"
    return f"@{CHAMPION} of {name} moved from {was} to version {target.version}"


# ---------------------------------------------------------------- a registered bundle, fetched

@dataclass(frozen=True)
class RegisteredBundle:
    """A model version as the loop reads it: where it is, and the sha256 of its bundle's manifest (lineage)."""
    name: str
    version: str
    registry_uri: str
    bundle_sha256: str

    @property
    def identity(self) -> dict:
        """What a report records of it."""
        return {"name": self.name, "version": self.version, "bundle_sha256": self.bundle_sha256}


def alias_ref(cfg: Config, alias: str) -> dict:
    """Where `alias` of the configured model lives: what a stage's digest holds of a version it reads by alias (the
    alias moving later does not rerun a finished stage)."""
    return {"name": cfg.register.model_name, "alias": alias, "registry_uri": tracking_uri(cfg)}


def aliased(name: str, alias: str, registry_uri: str) -> RegisteredBundle | None:
    """The version of model `name` behind `alias` (alias_ref's fields), or None when there is none."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient(tracking_uri=registry_uri, registry_uri=registry_uri)
    try:
        v = client.get_model_version_by_alias(name, alias)
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise
    return registered_bundle(v, registry_uri, f"models:/{name}@{alias} (version {v.version})")


def registered_bundle(version, registry_uri: str, label: str) -> RegisteredBundle:
    """An MLflow ModelVersion as the loop reads it; one without the lineage tag register writes is a one-line error
    naming `label`."""
    if "bundle_sha256" not in version.tags:
        raise DraftsmithError(f"{label} has no bundle_sha256 tag: not a version `pipeline run --stage register` made")
    return RegisteredBundle(version.name, str(version.version), registry_uri, version.tags["bundle_sha256"])


def fetch_bundle(ref: RegisteredBundle) -> Path:
    """The version's bundle directory, downloaded once into draftsmith's cache (atomically), its manifest's sha256
    checked against the version's lineage tag. The caller reads it with runtime.bundle_reader.read_bundle and the
    target's fingerprint, as serving does, which checks every file's hash."""
    import mlflow

    from pipeline.home import atomic_dir, home
    from runtime.bundle_reader import MANIFEST

    where = home() / "registry" / f"{ref.name}-v{ref.version}-{ref.bundle_sha256[:16]}"
    if not where.is_dir():
        mlflow.set_tracking_uri(ref.registry_uri)
        mlflow.set_registry_uri(ref.registry_uri)
        with atomic_dir(where) as tmp:
            mlflow.artifacts.download_artifacts(f"models:/{ref.name}/{ref.version}", dst_path=str(tmp))
    manifests = sorted(where.rglob(MANIFEST))
    if len(manifests) != 1 or sha256_file(manifests[0]) != ref.bundle_sha256:
        raise DraftsmithError(f"models:/{ref.name}/{ref.version}: the downloaded bundle's {MANIFEST} does not match "
                              f"the version's bundle_sha256 tag {ref.bundle_sha256[:12]}... (tampered or incomplete: "
                              f"remove {where} to download it again)")
    return manifests[0].parent
