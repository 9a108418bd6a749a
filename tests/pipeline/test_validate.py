"""export + validate stages on the tiny target: a verified bundle, measured numbers, the gate, tamper refusal."""
import json
import weakref

import pytest
import torch

from pipeline.cli import _bench_prompts
from pipeline.config import Config
from pipeline.errors import DraftsmithError
from pipeline.home import digest_json, sha256_file
from pipeline.runstore import RunStore, StageResult
from pipeline.sources import target_fingerprint
from pipeline.stages.export import run_export
from pipeline.stages.validate import (ACCEPTANCE_PNG, PROMPTS_JSONL, REPORT_JSON, REPORT_MD, SPEEDUP_PNG, run_validate,
                               time_methods)
from runtime.bundle_reader import MANIFEST, BundleError
from support.helpers import run_stage_on
from train.data import TokenizedSet

PROMPT_TOKENS = 12


def _config(**sections) -> Config:
    base = {"drafter": {"kind": "ngram", "depth": 3, "width": 2, "nodes": 6}, "export": {"onnx": False},
            "validate": {"num_prompts": 2, "max_new_tokens": 12, "temperatures": [0.0, 0.8],
                         "gate": {"min_tau": 1.0, "min_speedup": 0.0}}}
    return Config.model_validate({**base, **sections})


def _prepared_store(tmp_path, target_dir, drafter_files) -> RunStore:
    """A run with prepare (val rows: prompt then assistant tokens) and distill (`drafter_files`) finished."""
    store = RunStore(tmp_path / "runs", "r1")
    g = torch.Generator().manual_seed(0)

    def prepare(ctx):
        # repeated n-grams in the prompts give the ngram drafter something to match
        rows = [((torch.randint(0, 96, (4,), generator=g).repeat(PROMPT_TOKENS // 4 + 2)).tolist(),
                 [0] * PROMPT_TOKENS + [1] * 8) for _ in range(3)]
        TokenizedSet.from_rows(rows).save(ctx.out / "val.safetensors")
        return StageResult(outputs={"val": "val.safetensors"})

    def distill(ctx):
        for name, write in drafter_files.items():
            write(ctx.out / name)
        return StageResult(outputs={"config": "drafter_config.json"})

    cfg = _config()
    run_stage_on(store, "prepare", cfg, target_dir, prepare)
    run_stage_on(store, "distill", cfg, target_dir, distill)
    return store


def _ngram_files():
    return {"drafter_config.json": lambda p: p.write_text(json.dumps({"kind": "ngram", "max_ngram": 3}))}


@pytest.fixture
def exported(tmp_path, tiny_llama_dir):
    store = _prepared_store(tmp_path, tiny_llama_dir, _ngram_files())
    run_stage_on(store, "export", _config(), tiny_llama_dir, run_export)
    return store


def test_export_writes_a_manifest_covering_every_file(exported, tiny_llama_dir):
    bundle = exported.stage_dir("export") / "bundle"
    manifest = json.loads((bundle / MANIFEST).read_text())
    on_disk = {p.name for p in bundle.iterdir() if p.name != MANIFEST}
    assert set(manifest["files"]) == on_disk == {"drafter_config.json"}  # ngram: no weights
    assert all(sha256_file(bundle / n) == h for n, h in manifest["files"].items())
    assert manifest["target_fingerprint"] == target_fingerprint(tiny_llama_dir)
    assert manifest["data_digest"] == exported.record("prepare")["inputs_digest"]
    assert manifest["config"]["drafter"]["kind"] == "ngram"
    assert manifest["draft_budget"] == {"depth": 3, "width": 2, "nodes": 6, "adaptive": False, "lookup": 16,
                                        "max_tree": 0}  # the largest the run allows
    assert manifest["code_version"]


def _medusa_files(target_dir):
    from safetensors.torch import save_file

    from runtime.target.loading import from_pretrained
    from train.recipes.medusa import build_medusa

    heads = build_medusa(from_pretrained(target_dir, max_seq_len=64), num_heads=2, keep_ids=None)
    return {"drafter_config.json": lambda p: p.write_text(json.dumps(heads.cfg.to_dict())),
            "drafter.safetensors": lambda p: save_file({k: v.contiguous() for k, v in heads.state_dict().items()},
                                                        str(p))}


def test_export_copies_calibration_reports_and_checks_onnx(tmp_path, tiny_llama_dir):
    store = _prepared_store(tmp_path, tiny_llama_dir, _medusa_files(tiny_llama_dir))

    def calibrate(ctx):
        (ctx.out / "layer_map.json").write_text('{"map": [0, 0]}')
        (ctx.out / "unlisted.json").write_text("{}")
        return StageResult(outputs={"layer_map": "layer_map.json"})

    run_stage_on(store, "calibrate", _config(), tiny_llama_dir, calibrate)
    run_stage_on(store, "export", _config(export={"onnx": True}), tiny_llama_dir, run_export)
    bundle = store.stage_dir("export") / "bundle"
    manifest = json.loads((bundle / MANIFEST).read_text())
    assert set(manifest["files"]) == {"drafter_config.json", "drafter.safetensors", "layer_map.json", "drafter.onnx"}
    assert all(sha256_file(bundle / n) == h for n, h in manifest["files"].items())
    assert manifest["onnx"]["parity"]["passed"] and manifest["onnx"]["kind"] == "medusa"
    assert not (store.stage_dir("export") / "drafter.onnx").exists()  # the scratch export was moved in


def test_export_ships_the_calibrated_int8_weights_and_the_reader_restores_them(tmp_path, tiny_llama_dir):
    from safetensors.torch import load_file, save_file

    from runtime.bundle_reader import read_bundle
    from runtime.drafters import build_drafter
    from runtime.target.loading import from_pretrained
    from runtime.weight_quant import dequantize_state_dict, quantize_state_dict

    store = _prepared_store(tmp_path, tiny_llama_dir, _medusa_files(tiny_llama_dir))
    plain = load_file(str(store.stage_dir("distill") / "drafter.safetensors"))
    # other weights than distill's (untrained medusa heads are zeros, which int8 stores exactly)
    g = torch.Generator().manual_seed(0)
    packed = quantize_state_dict({k: torch.randn(v.shape, generator=g) if v.dim() == 2 else v
                                  for k, v in plain.items()}, "int8")

    def calibrate(ctx):  # what export.calibrate writes when int8 is chosen
        (ctx.out / "quant.json").write_text('{"chosen": "int8"}')
        save_file(packed, str(ctx.out / "quant.safetensors"), metadata={"scheme": "int8"})
        return StageResult(outputs={"quant": "quant.json", "quant_weights": "quant.safetensors"})

    run_stage_on(store, "calibrate", _config(), tiny_llama_dir, calibrate)
    run_stage_on(store, "export", _config(export={"onnx": True}), tiny_llama_dir, run_export)
    bundle = read_bundle(store.stage_dir("export") / "bundle", target_fingerprint(tiny_llama_dir))
    assert bundle.drafter_config["weight_quant"] == "int8" and bundle.manifest["onnx"]["parity"]["passed"]
    stored = bundle.tensors()
    assert any(k.endswith(".qweight") for k in stored) and all(torch.equal(stored[k], packed[k]) for k in packed)
    drafter = build_drafter(bundle, from_pretrained(tiny_llama_dir, max_seq_len=64), 64)
    restored = dequantize_state_dict(packed, "int8")
    served = drafter.heads.state_dict()
    assert all(torch.equal(served[k], restored[k]) for k in restored)  # the bundle's codes, not distill's weights
    assert not all(torch.equal(restored[k], plain[k]) for k in plain)


def test_export_fails_when_onnx_parity_fails(tmp_path, tiny_llama_dir, monkeypatch):
    import export.onnx_export as onnx_export

    real_check = onnx_export.check_onnx_parity

    def disagreeing(*args, **kwargs):  # the real measurement, judged against an impossible tolerance
        return real_check(*args, **{**kwargs, "tolerance": -1.0})

    monkeypatch.setattr(onnx_export, "check_onnx_parity", disagreeing)
    store = _prepared_store(tmp_path, tiny_llama_dir, _medusa_files(tiny_llama_dir))
    with pytest.raises(DraftsmithError, match="drafter.onnx disagrees with the torch drafter"):
        run_stage_on(store, "export", _config(export={"onnx": True}), tiny_llama_dir, run_export)
    assert store.record("export") is None and not store.stage_dir("export").exists()


def test_validate_measures_and_passes_the_gate(exported, tiny_llama_dir, capfd):
    rec = run_stage_on(exported, "validate", _config(), tiny_llama_dir, run_validate)
    shown = capfd.readouterr().err
    assert all(f"{bar}: 100%" in shown for bar in ("validate: warm-up", "validate: T=0", "validate: T=0.8",
                                                   "validate: the configured tree"))
    out = exported.stage_dir("validate")
    assert rec["status"] == "completed"
    for name in (REPORT_JSON, REPORT_MD, PROMPTS_JSONL, ACCEPTANCE_PNG, SPEEDUP_PNG):
        assert (out / name).stat().st_size > 0
    assert (out / ACCEPTANCE_PNG).read_bytes()[:4] == b"\x89PNG"
    report = json.loads((out / REPORT_JSON).read_text())
    m = report["metrics"]
    assert m["lossless"] is True and m["tau"] >= 1.0
    assert m["tokens_per_s"] > 0 and m["tokens_per_s_ar"] > 0 and m["tokens_per_s_hf"] > 0
    assert [r["temperature"] for r in report["temperatures"]] == [0.0, 0.8]
    assert report["gate"]["passed"] and report["gate"]["reasons"] == []
    assert len(report["validation_digest"]) == 64
    assert "| 0.8 |" in (out / REPORT_MD).read_text()
    prompts = _bench_prompts(out / PROMPTS_JSONL)  # what `pipeline bench --prompts` reads: validate's own prompts
    assert len(prompts) == report["prompts"] == 2 and report["validation_digest"] == digest_json(
        {"prompt_ids": prompts, "temperatures": [0.0, 0.8], "max_new_tokens": 12})


def test_validate_never_holds_hfs_model_and_ours_together(exported, tiny_llama_dir, monkeypatch):
    """HF's rows are timed in a phase of their own: when our target loads, no HF model is alive, and when an HF
    model loads, no target of ours is; ours is loaded lean."""
    from transformers import AutoModelForCausalLM

    from pipeline.stages.context import StageContext

    hf, ours, load_hf, load_ours = [], [], AutoModelForCausalLM.from_pretrained, StageContext.load_target

    def hf_loaded(*args, **kwargs):
        assert not [t for t in ours if t() is not None], "HF's model loaded while ours is resident"
        hf.append(weakref.ref(model := load_hf(*args, **kwargs)))
        return model

    def ours_loaded(self, *args, **kwargs):
        assert not [m for m in hf if m() is not None], "our target loaded while HF's model is resident"
        ours.append(weakref.ref(target := load_ours(self, *args, **kwargs)))
        assert target.layers[0].attention.wqkv.lean
        return target

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", hf_loaded)
    monkeypatch.setattr(StageContext, "load_target", ours_loaded)
    rec = run_stage_on(exported, "validate", _config(), tiny_llama_dir, run_validate)
    assert rec["status"] == "completed" and len(hf) == 1 and len(ours) == 1
    assert rec["metrics"]["tokens_per_s_hf"] > 0


def test_validate_refuses_a_prompt_beyond_the_models_context_in_one_line(exported, tiny_llama_dir):
    # the validation prompts are PROMPT_TOKENS long; the tiny model's context is 256 positions
    cfg = _config(validate={"num_prompts": 2, "max_new_tokens": 250, "temperatures": [0.0]})
    with pytest.raises(DraftsmithError, match=f"^prompt 1 of 2: prompt of {PROMPT_TOKENS} tokens \\+ "
                                              "max_new_tokens=250 does not fit the model's context of "
                                              "max_position_embeddings=256$"):
        run_stage_on(exported, "validate", cfg, tiny_llama_dir, run_validate)
    assert exported.record("validate") is None

    """A slow spell of the machine must hit every method, not whichever ran then: methods interleave per prompt."""
    calls = []

    class Metrics:
        target_forwards, acceptance_by_depth, kv_saved = 2, [0.5], 0.0

    def method(name, n_tokens):
        def run(ids, params, gen):
            calls.append((ids[0], name))
            return [int(torch.randint(100, (1,), generator=gen))] * n_tokens, None if name == "hf" else Metrics()
        return run

    timed = time_methods({"spec": method("spec", 3), "hf": method("hf", 1)}, [[7], [8]], None, seed=5)
    assert calls == [(7, "spec"), (7, "hf"), (8, "spec"), (8, "hf")]
    assert timed["spec"].new_tokens == 6 and timed["spec"].target_forwards == 4 and timed["hf"].target_forwards == 0
    assert timed["spec"].acceptance_by_depth == [0.5] and timed["hf"].acceptance_by_depth == []
    assert timed["spec"].tokens[0][0] == timed["hf"].tokens[0][0]  # each method's own generator, same seed


def test_repeats_keep_each_methods_fastest_run_from_the_same_generator_state(monkeypatch):
    """With repeats the methods take turns on a prompt; each repeat starts from the same generator state (the same
    tokens, sampled or not) and the fastest counts."""
    import pipeline.bench.harness

    clock, durations, calls = [0.0], {"spec": [5.0, 1.0, 2.0, 3.0], "hf": [4.0, 6.0, 1.5, 0.5]}, []
    monkeypatch.setattr(pipeline.bench.harness.time, "perf_counter", lambda: clock[0])

    def method(name):
        def run(ids, params, gen):
            calls.append((ids[0], name))
            clock[0] += durations[name].pop(0)
            return [int(torch.randint(1000, (1,), generator=gen)) for _ in range(3)], None
        return run

    once = time_methods({"spec": method("spec"), "hf": method("hf")}, [[7], [8]], None, seed=5)
    durations.update(spec=[5.0, 1.0, 2.0, 3.0], hf=[4.0, 6.0, 1.5, 0.5])
    calls.clear()
    timed = time_methods({"spec": method("spec"), "hf": method("hf")}, [[7], [8]], None, seed=5, repeats=2)
    assert calls == [(7, "spec"), (7, "hf"), (7, "spec"), (7, "hf"), (8, "spec"), (8, "hf"), (8, "spec"), (8, "hf")]
    assert timed["spec"].seconds == 1.0 + 2.0 and timed["hf"].seconds == 4.0 + 0.5
    assert timed["spec"].tokens == once["spec"].tokens and timed["hf"].tokens == once["hf"].tokens
    assert timed["spec"].tokens[0] != timed["spec"].tokens[1]  # the generator still moves on from prompt to prompt


def test_validate_gate_failure_names_tau(exported, tiny_llama_dir):
    cfg = _config(validate={"num_prompts": 1, "max_new_tokens": 8, "gate": {"min_tau": 100}})
    rec = run_stage_on(exported, "validate", cfg, tiny_llama_dir, run_validate)
    assert rec["status"] == "gate_failed" and "tau" in rec["message"]
    report = json.loads((exported.stage_dir("validate") / REPORT_JSON).read_text())
    assert not report["gate"]["passed"] and any("min_tau" in r for r in report["gate"]["reasons"])


def test_validate_refuses_a_tampered_bundle(exported, tiny_llama_dir):
    config = exported.stage_dir("export") / "bundle" / "drafter_config.json"
    config.write_text(json.dumps({"kind": "ngram", "max_ngram": 1}))
    with pytest.raises(BundleError, match="tampered"):
        run_stage_on(exported, "validate", _config(), tiny_llama_dir, run_validate)
    assert exported.record("validate") is None  # nothing half-written for register to find


def test_validate_also_measures_the_configured_tree_beside_the_served_budget(tmp_path, tiny_llama_dir):
    """Calibrate chose a one-node chain; validate serves it and also reports the drafter with the whole configured
    tree (3x2/6), which is what the drafter can reach."""
    store = _prepared_store(tmp_path, tiny_llama_dir, _ngram_files())

    def calibrate(ctx):
        chosen = {"depth": 1, "width": 1, "nodes": 1, "adaptive": False, "lookup": 0, "max_tree": 0}
        (ctx.out / "draft_budget.json").write_text(json.dumps({"chosen": chosen}))
        return StageResult(outputs={"draft_budget": "draft_budget.json"})

    run_stage_on(store, "calibrate", _config(), tiny_llama_dir, calibrate)
    run_stage_on(store, "export", _config(), tiny_llama_dir, run_export)
    rec = run_stage_on(store, "validate", _config(), tiny_llama_dir, run_validate)
    out = store.stage_dir("validate")
    report = json.loads((out / REPORT_JSON).read_text())
    full = report["configured_tree"]
    assert report["budget"]["nodes"] == 1 and len(report["temperatures"][0]["acceptance_by_depth"]) <= 1
    assert full["budget"] == {"depth": 3, "width": 2, "nodes": 6, "adaptive": False, "lookup": 0, "max_tree": 0,
                              "lookup_corpus": False}
    assert full["lossy_prompts"] == 0 and len(full["acceptance_by_depth"]) == 3
    assert rec["metrics"]["tau_configured"] == full["tau"] >= 1.0
    assert "With the configured tree (3x2/6)" in (out / REPORT_MD).read_text()
    assert "tau" in rec["message"] and "configured tree (3x2/6)" in rec["message"]


def test_validate_fails_the_gate_when_speculation_changes_greedy_output(exported, tiny_llama_dir, monkeypatch):
    import runtime.speculation.engine as engine_module
    from runtime.speculation.verify import Verdict
    verify = engine_module.verify

    def bonus_from_the_row_before(tree, logits, params, generator=None):
        """WRONG (off by one): after an accepted draft, the bonus token is the argmax of the row before its own."""
        verdict = verify(tree, logits, params, generator)
        if params.greedy and verdict.accepted:
            return Verdict(verdict.accepted, int(logits[verdict.accepted[-1]].argmax()))
        return verdict

    monkeypatch.setattr(engine_module, "verify", bonus_from_the_row_before)
    rec = run_stage_on(exported, "validate", _config(), tiny_llama_dir, run_validate)
    assert rec["status"] == "gate_failed" and "require_lossless" in rec["message"]
    m = json.loads((exported.stage_dir("validate") / REPORT_JSON).read_text())["metrics"]
    assert m["lossless"] is False and m["lossy_prompts"] >= 1


def test_a_quantspec_bundle_holds_no_weights_and_validates_lossless(tmp_path, tiny_llama_dir):
    from runtime.drafters import get_kind

    config = get_kind("quantspec").config(None, 0, None)
    store = _prepared_store(tmp_path, tiny_llama_dir,
                            {"drafter_config.json": lambda p: p.write_text(json.dumps(config))})
    cfg = _config(drafter={"kind": "quantspec", "depth": 3, "width": 1, "nodes": 3})
    run_stage_on(store, "export", cfg, tiny_llama_dir, run_export)
    bundle = store.stage_dir("export") / "bundle"
    assert {p.name for p in bundle.iterdir()} == {"drafter_config.json", MANIFEST}
    rec = run_stage_on(store, "validate", cfg, tiny_llama_dir, run_validate)
    m = json.loads((store.stage_dir("validate") / REPORT_JSON).read_text())["metrics"]
    assert rec["status"] == "completed" and m["lossless"] is True and m["tau"] > 1.0
