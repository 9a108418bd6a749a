"""Register, promote and roll back against a real `mlflow server` (sqlite backend) on 127.0.0.1."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.mlflow_server import mlflow_server, run_stage, validated_run

from pipeline.config import load_config
from pipeline.errors import DraftsmithError
from pipeline.home import digest_json
from pipeline.registry import CANDIDATE, CHAMPION, Decision, decide, promote_to, registry_client
from pipeline.stages.register import run_promote, run_register


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as url:
        yield url


@pytest.fixture
def cfg(tmp_path, server_url, request):
    return load_config(None, [f"run.dir={tmp_path / 'runs'}", f"register.tracking_uri={server_url}",
                              f"register.model_name=drafter-{request.node.name}"])


def test_register_tags_alias_and_retry(cfg):
    store = validated_run(cfg, "r1", speedup=1.6)
    rec = run_stage(cfg, store, "register", run_register)
    client = registry_client(cfg)
    name = cfg.register.model_name
    v = client.get_model_version_by_alias(name, CANDIDATE)
    assert rec["outputs"]["version"] == int(v.version) == 1
    manifest = json.loads((store.stage_dir("export") / "bundle/manifest.json").read_text())
    assert v.tags["metric.speedup"] == "1.6" and v.tags["metric.lossless"] == "true"
    assert json.loads(v.tags["metric.acceptance.depth1"]) == 0.7  # nested metrics are flattened
    assert v.tags["validation_digest"] == "prompts-a" and v.tags["run_id"] == "r1"
    assert v.tags["target_fingerprint"] == "target-fp" and v.tags["data_digest"] == "data-r1"
    assert v.tags["config_digest"] == digest_json(manifest["config"]) and v.tags["code_version"] == "test-code"

    import mlflow

    local = mlflow.artifacts.download_artifacts(f"models:/{name}/{v.version}")
    served_manifest = json.loads(next(Path(local).rglob("manifest.json")).read_text())
    assert served_manifest == manifest  # the bundle itself travels with the model version
    files = {f.name for f in Path(local).rglob("*") if f.is_file()}
    assert "model_file.py" in files and not any(f.endswith((".pkl", ".pickle")) for f in files)  # no pickle

    again = run_stage(cfg, store, "register", run_register)  # an Airflow retry
    assert again["outputs"]["version"] == 1
    assert len(client.search_model_versions(f"name = '{name}'")) == 1


def test_register_refuses_failed_gate(cfg):
    store = validated_run(cfg, "bad", speedup=0.9, passed=False)
    with pytest.raises(DraftsmithError, match=r"validation gate failed \(speedup 0.9 < min_speedup 1.0\)"):
        run_stage(cfg, store, "register", run_register)
    assert not store.stage_dir("register").exists()
    client = registry_client(cfg)
    assert client.search_model_versions(f"name = '{cfg.register.model_name}'") == []


def test_promote_first_then_refuse_worse_then_accept_better(cfg):
    client, name = registry_client(cfg), cfg.register.model_name

    def register_and_promote(run_id: str, speedup: float, digest: str = "prompts-a") -> dict:
        store = validated_run(cfg, run_id, speedup, validation_digest=digest)
        run_stage(cfg, store, "register", run_register)
        return run_stage(cfg, store, "promote", run_promote)

    first = register_and_promote("r1", 1.5)
    assert first["metrics"]["promoted"] and "no champion yet" in first["message"]
    assert client.get_model_version_by_alias(name, CHAMPION).version == "1"

    worse = register_and_promote("r2", 1.2)
    assert not worse["metrics"]["promoted"] and "does not beat the champion's 1.5" in worse["message"]
    assert client.get_model_version_by_alias(name, CHAMPION).version == "1"
    assert client.get_model_version_by_alias(name, CANDIDATE).version == "2"

    elsewhere = register_and_promote("r3", 3.0, digest="prompts-b")
    assert not elsewhere["metrics"]["promoted"] and "different prompt set" in elsewhere["message"]
    assert client.get_model_version_by_alias(name, CHAMPION).version == "1"

    better = register_and_promote("r4", 1.8)
    assert better["metrics"]["promoted"] and better["metrics"]["previous_champion_speedup"] == 1.5
    assert client.get_model_version_by_alias(name, CHAMPION).version == "4"


def test_rollback_with_promote_to(cfg):
    client, name = registry_client(cfg), cfg.register.model_name
    for i, speedup in enumerate((1.5, 2.0), start=1):
        store = validated_run(cfg, f"r{i}", speedup)
        run_stage(cfg, store, "register", run_register)
        run_stage(cfg, store, "promote", run_promote)
    assert client.get_model_version_by_alias(name, CHAMPION).version == "2"
    assert promote_to(cfg, 1) == f"@champion of {name} moved from version 2 to version 1"
    assert client.get_model_version_by_alias(name, CHAMPION).version == "1"
    with pytest.raises(DraftsmithError, match="has no version '7'"):
        promote_to(cfg, "7")
    assert client.get_model_version_by_alias(name, CHAMPION).version == "1"


# ---------------------------------------------------------------- the decision alone (no server)

def tags(speedup: float, lossless: bool = True, digest: str = "prompts-a") -> dict[str, str]:
    return {"metric.speedup": json.dumps(speedup), "metric.lossless": json.dumps(lossless),
            "validation_digest": digest}


def test_decide_rules():
    assert decide(tags(1.1), None, "speedup") == Decision(True, "there is no champion yet")
    assert not decide(tags(9.0, lossless=False), None, "speedup").promote
    assert decide(tags(1.3), tags(1.2), "speedup").promote
    assert not decide(tags(1.2), tags(1.2), "speedup").promote  # a tie keeps the champion
    assert not decide(tags(2.0, digest="b"), tags(1.2), "speedup").promote
    with pytest.raises(DraftsmithError, match="promote.metric 'latency'.*expected one of lossless, speedup"):
        decide(tags(1.3), tags(1.2), "latency")
