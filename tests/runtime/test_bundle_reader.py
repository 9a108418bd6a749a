import json

import pytest
import torch

from export.bundle_writer import write_bundle
from runtime.bundle_reader import BundleError, read_bundle
from runtime.speculation.draft_budget import DraftBudget, ServedBudget
from runtime.speculation.engine import EngineConfig


@pytest.fixture
def bundle(tmp_path):
    out = tmp_path / "bundle"
    write_bundle(out, {"kind": "ngram", "max_ngram": 4}, {"w": torch.arange(6.0).reshape(2, 3)},
                 target_fingerprint="fp-a", data_digest="dd", config={"x": 1}, code_version="test")
    return out


def _rewrite_manifest(bundle, fn):
    m = json.loads((bundle / "manifest.json").read_text())
    fn(m)
    (bundle / "manifest.json").write_text(json.dumps(m))


def test_roundtrip(bundle):
    b = read_bundle(bundle, expect_target_fingerprint="fp-a")
    assert b.kind == "ngram" and b.drafter_config["max_ngram"] == 4
    assert torch.equal(b.tensors()["w"], torch.arange(6.0).reshape(2, 3))
    assert set(b.manifest["files"]) == {"drafter_config.json", "drafter.safetensors"}


def test_tampered_file_refused(bundle):
    data = bytearray((bundle / "drafter.safetensors").read_bytes())
    data[-1] ^= 1
    (bundle / "drafter.safetensors").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="drafter.safetensors has sha256"):
        read_bundle(bundle)


def test_truncated_file_refused(bundle):
    p = bundle / "drafter.safetensors"
    p.write_bytes(p.read_bytes()[:10])
    with pytest.raises(BundleError, match="tampered or truncated"):
        read_bundle(bundle)


def test_wrong_target_refused(bundle):
    with pytest.raises(BundleError, match="built for target"):
        read_bundle(bundle, expect_target_fingerprint="fp-b")


def test_missing_file_refused(bundle):
    (bundle / "drafter.safetensors").unlink()
    with pytest.raises(BundleError, match="listed in the manifest but missing"):
        read_bundle(bundle)


@pytest.mark.parametrize("name", ["../secret", "/etc/passwd", "a/../../x"])
def test_path_traversal_refused(bundle, tmp_path, name):
    (tmp_path / "secret").write_text("s")
    _rewrite_manifest(bundle, lambda m: m["files"].__setitem__(name, "0" * 64))
    with pytest.raises(BundleError, match="outside the bundle"):
        read_bundle(bundle)


def test_symlink_escape_refused(bundle, tmp_path):
    (tmp_path / "outside.json").write_text("{}")
    (bundle / "link.json").symlink_to(tmp_path / "outside.json")
    _rewrite_manifest(bundle, lambda m: m["files"].__setitem__("link.json", "0" * 64))
    with pytest.raises(BundleError, match="outside the bundle"):
        read_bundle(bundle)


def test_not_a_bundle(tmp_path):
    with pytest.raises(BundleError, match="no manifest.json"):
        read_bundle(tmp_path)
    (tmp_path / "manifest.json").write_text("{broken")
    with pytest.raises(BundleError, match="not valid JSON"):
        read_bundle(tmp_path)


@pytest.mark.parametrize("chosen, expected", [("int8", {"kv_scheme": "int8", "kv_recent": 32}), ("none", {}),
                                              (None, {})])
def test_kv_settings_follow_calibrate_choice(tmp_path, chosen, expected):
    extra = {}
    if chosen is not None:
        (tmp_path / "kv_quant.json").write_text(json.dumps({"chosen": chosen, "recent": 32, "candidates": []}))
        extra = {"kv_quant.json": tmp_path / "kv_quant.json"}
    write_bundle(tmp_path / "b", {"kind": "ngram", "max_ngram": 4}, None, target_fingerprint="fp", data_digest="dd",
                 config={}, code_version="test", extra_files=extra)
    settings = read_bundle(tmp_path / "b").kv_settings()
    assert settings == expected
    EngineConfig(**settings)  # what validate and serving build their engines with


def test_the_served_budget_is_the_calibrated_one_with_its_engine_fields(tmp_path):
    configured = ServedBudget(DraftBudget(depth=6, width=4, nodes=24), lookup=16)
    report = {"chosen": {"depth": 2, "width": 2, "nodes": 4, "adaptive": False, "lookup": 8}, "sweep": []}
    (tmp_path / "draft_budget.json").write_text(json.dumps(report))
    (tmp_path / "kv_quant.json").write_text(json.dumps({"chosen": "int4", "recent": 16, "candidates": []}))
    for name, extra in (("with", {n: tmp_path / n for n in ("draft_budget.json", "kv_quant.json")}), ("without", {})):
        write_bundle(tmp_path / name, {"kind": "ngram", "max_ngram": 4}, None, target_fingerprint="fp",
                     data_digest="dd", config={}, code_version="test", extra_files=extra)
    calibrated = read_bundle(tmp_path / "with")
    budget = calibrated.served_budget(configured)
    assert budget == ServedBudget(DraftBudget(depth=2, width=2, nodes=4), lookup=8)  # max_tree: none (older)
    assert calibrated.engine_fields(budget) == {"budget": DraftBudget(2, 2, 4), "adaptive": False, "lookup": 8,
                                                "max_tree": 0, "kv_scheme": "int4", "kv_recent": 16}
    assert read_bundle(tmp_path / "without").served_budget(configured) == configured
    assert read_bundle(tmp_path / "without").engine_fields(configured) == configured.engine_fields()
    assert EngineConfig(**calibrated.engine_fields(budget)).budget.max_nodes == 4  # what the served engine runs


def test_engine_settings_verify_sparsely_only_where_calibrate_chose_a_top_p_below_one(tmp_path):
    from runtime.target.attention import SpecAttnConfig

    for top_p in (0.7, 1.0):
        (tmp_path / "specattn.json").write_text(SpecAttnConfig((-1, 0, 0), top_p, dense_first=1).to_json())
        write_bundle(tmp_path / f"p{top_p}", {"kind": "eagle"}, None, target_fingerprint="fp", data_digest="dd",
                     config={}, code_version="test", extra_files={"specattn.json": tmp_path / "specattn.json"})
    assert read_bundle(tmp_path / "p0.7").engine_fields(ServedBudget())["sparse"] == SpecAttnConfig(
        (-1, 0, 0), 0.7, dense_first=1)
    assert "sparse" not in read_bundle(tmp_path / "p1.0").engine_fields(ServedBudget())  # every key: dense
    # pipeline bench --specattn-top-p: the bundle's layer map at another top-p
    assert read_bundle(tmp_path / "p1.0").sparse_settings(0.5)["sparse"] == SpecAttnConfig((-1, 0, 0), 0.5, 1)
    assert read_bundle(tmp_path / "p0.7").sparse_settings(1.0) == {}
    with pytest.raises(BundleError, match="SpecAttn top-p 0.0: .*expected a number in"):
        read_bundle(tmp_path / "p0.7").sparse_settings(0.0)
    write_bundle(tmp_path / "ngram", {"kind": "ngram"}, None, target_fingerprint="fp", data_digest="dd", config={},
                 code_version="test")
    assert read_bundle(tmp_path / "ngram").sparse_settings() == {}
    with pytest.raises(BundleError, match="no specattn.json, so no SpecAttn layer map.*'ngram'"):
        read_bundle(tmp_path / "ngram").sparse_settings(0.5)


def test_engine_settings_carry_the_lookup_corpus_where_the_calibrated_budget_drafts_with_the_branch(tmp_path):
    from runtime.drafters.ngram import save_corpus

    save_corpus(tmp_path / "lookup_corpus.safetensors", [torch.tensor([5, 6, 7, 8])], vocab_size=100)
    for lookup in (8, 0):
        report = {"chosen": {"depth": 2, "width": 2, "nodes": 4, "adaptive": False, "lookup": lookup}, "sweep": []}
        (tmp_path / "draft_budget.json").write_text(json.dumps(report))
        extra = {n: tmp_path / n for n in ("draft_budget.json", "lookup_corpus.safetensors")}
        write_bundle(tmp_path / f"b{lookup}", {"kind": "ngram", "max_ngram": 4}, None, target_fingerprint="fp",
                     data_digest="dd", config={}, code_version="test", extra_files=extra)
    b8, b0 = read_bundle(tmp_path / "b8"), read_bundle(tmp_path / "b0")
    corpus = b8.engine_fields(b8.served_budget(ServedBudget()))["lookup_corpus"]
    assert corpus.vocab_size == 100 and corpus.max_depth == 8 and corpus.match_of([5, 6]) is not None
    assert "lookup_corpus" not in b0.engine_fields(b0.served_budget(ServedBudget()))  # no branch
    bench = ServedBudget.parse("2x1/2+4")  # pipeline bench --budget
    assert b0.engine_fields(bench)["lookup_corpus"].max_depth == 4
    assert "lookup_corpus" not in b8.engine_fields(ServedBudget.parse("2x1/2"))


def test_device_candidates_are_the_budgets_calibrate_measured_tau_for(tmp_path):
    from runtime.drafters.ngram import save_corpus

    save_corpus(tmp_path / "lookup_corpus.safetensors", [torch.tensor([5, 6, 7, 8])], vocab_size=100)
    (tmp_path / "kv_quant.json").write_text(json.dumps({"chosen": "int8", "recent": 16, "candidates": []}))
    chosen = {"depth": 1, "width": 3, "nodes": 3, "adaptive": True, "lookup": 0, "max_tree": 0}
    wide = {"depth": 4, "width": 2, "nodes": 8, "adaptive": False, "lookup": 8, "max_tree": 15}
    report = {"chosen": chosen, "sweep": [], "device_candidates": [chosen | {"tau": 2.1}, wide | {"tau": 3.4}]}
    (tmp_path / "draft_budget.json").write_text(json.dumps(report))
    extra = {n: tmp_path / n for n in ("draft_budget.json", "kv_quant.json", "lookup_corpus.safetensors")}
    write_bundle(tmp_path / "b", {"kind": "ngram", "max_ngram": 4}, None, target_fingerprint="fp", data_digest="dd",
                 config={}, code_version="test", extra_files=extra)
    bundle = read_bundle(tmp_path / "b")
    (first, tau1), (second, tau2) = bundle.device_candidates()
    assert (first, tau1) == (ServedBudget(DraftBudget(1, 3, 3), adaptive=True), 2.1)
    assert (second, tau2) == (ServedBudget(DraftBudget(4, 2, 8), False, 8, 15), 3.4)
    fields = bundle.engine_fields(second)  # each candidate served with the bundle's other settings
    assert {k: v for k, v in fields.items() if k != "lookup_corpus"} == {
        "budget": DraftBudget(4, 2, 8), "adaptive": False, "lookup": 8, "max_tree": 15, "kv_scheme": "int8",
        "kv_recent": 16}
    assert fields["lookup_corpus"].max_depth == 8 and "lookup_corpus" not in bundle.engine_fields(first)
    (tmp_path / "draft_budget.json").write_text(json.dumps({"chosen": chosen, "sweep": []}))  # calibrated before
    write_bundle(tmp_path / "old", {"kind": "ngram", "max_ngram": 4}, None, target_fingerprint="fp", data_digest="dd",
                 config={}, code_version="test", extra_files={"draft_budget.json": tmp_path / "draft_budget.json"})
    assert read_bundle(tmp_path / "old").device_candidates() == []
