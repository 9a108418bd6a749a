"""ONNX export of drafter steps: the exported function is the runtime's, axes are dynamic, and onnxruntime agrees."""
import pytest
import torch

from export.onnx_export import ONNX_FILE, check_onnx_parity, example_inputs, export_onnx
from runtime.drafters.shared.eagle_drafting import EagleStep
from runtime.target.loading import from_pretrained
from support.helpers import perturbed
from train.recipes.eagle import build_eagle
from train.recipes.medusa import build_medusa


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return from_pretrained(tiny_llama_dir, max_seq_len=64)


def _drafter(target, kind):
    if kind == "eagle":  # a reduced draft vocabulary, so the head's row selection is exported too
        return perturbed(build_eagle(target, torch.arange(0, 96, 3)))
    return perturbed(build_medusa(target, num_heads=3, keep_ids=None))


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_export_matches_onnxruntime_at_other_shapes(target, kind, tmp_path):
    drafter = _drafter(target, kind)
    path = tmp_path / ONNX_FILE
    record = export_onnx(drafter, kind, example_inputs(drafter, kind, batch=2, seq=5), path)
    assert path.is_file() and not list(tmp_path.glob("*.data"))  # one self-contained file for the manifest
    for name, dims in record["inputs"].items():
        assert dims[:2] == ["batch", "seq"], (name, dims)
    draft_vocab = drafter.head.weight.shape[0]
    want_logits = ["batch", "seq", draft_vocab] if kind == "eagle" else ["batch", "seq", 3, draft_vocab]
    assert record["outputs"]["logits"] == want_logits
    for batch, seq in [(3, 7), (1, 1)]:  # neither is the export example: the axes must really be dynamic
        parity = check_onnx_parity(drafter, kind, path, example_inputs(drafter, kind, batch, seq, seed=batch))
        assert parity["passed"] and parity["max_rel_diff"] <= parity["tolerance"], parity
        assert set(parity) == {"onnxruntime", "max_abs_diff", "max_rel_diff", "tolerance", "passed"}


def test_parity_check_catches_a_different_model(target, tmp_path):
    drafter = _drafter(target, "medusa")
    path = tmp_path / ONNX_FILE
    export_onnx(drafter, "medusa", example_inputs(drafter, "medusa", 2, 3), path)
    perturbed(drafter, seed=1)  # the file now holds stale weights
    parity = check_onnx_parity(drafter, "medusa", path, example_inputs(drafter, "medusa", 2, 3))
    assert not parity["passed"] and parity["max_rel_diff"] > parity["tolerance"]


def test_eagle_step_is_the_runtime_causal_pass(target):
    """The exported step must compute what the drafter computes in the engine: EagleModel.causal on an empty
    cache (positions 1..T, causal among the pairs)."""
    model = _drafter(target, "eagle")
    inputs = example_inputs(model, "eagle", batch=2, seq=6)
    with torch.no_grad():
        step_features, step_logits = EagleStep(model)(inputs["input_ids"], inputs["features"])
        features = model.causal(inputs["input_ids"], inputs["features"], model.new_cache(2, 6))
    torch.testing.assert_close(step_features, features, rtol=0, atol=1e-6)
    torch.testing.assert_close(step_logits, model.head(features), rtol=0, atol=1e-6)


def test_bad_requests_are_refused_with_a_reason(target, tmp_path):
    eagle, medusa = _drafter(target, "eagle"), _drafter(target, "medusa")
    with pytest.raises(ValueError, match="takes drafter type EagleModel, got MedusaHeads"):
        export_onnx(medusa, "eagle", example_inputs(medusa, "medusa", 2, 2), tmp_path / ONNX_FILE)
    with pytest.raises(ValueError, match="ngram drafter has no ONNX step"):
        export_onnx(eagle, "ngram", {}, tmp_path / ONNX_FILE)
    with pytest.raises(ValueError, match="'nope' is not one of"):
        export_onnx(eagle, "nope", {}, tmp_path / ONNX_FILE)
    with pytest.raises(ValueError, match="batch >= 2 and seq >= 2"):
        export_onnx(eagle, "eagle", example_inputs(eagle, "eagle", 1, 4), tmp_path / ONNX_FILE)
    with pytest.raises(ValueError, match="takes inputs"):
        export_onnx(eagle, "eagle", example_inputs(medusa, "medusa", 2, 2), tmp_path / ONNX_FILE)
    with pytest.raises(ValueError, match="expected torch.float32"):
        export_onnx(medusa.to(torch.bfloat16), "medusa", {}, tmp_path / ONNX_FILE)


@pytest.mark.slow
def test_real_target_eagle_step_passes_parity(smollm2_dir, tmp_path):
    """At SmolLM2 scale logits reach the hundreds: the relative tolerance must hold there, not just on a toy."""
    model = build_eagle(from_pretrained(smollm2_dir, max_seq_len=128), None).eval()
    path = tmp_path / ONNX_FILE
    export_onnx(model, "eagle", example_inputs(model, "eagle", 2, 4), path)
    parity = check_onnx_parity(model, "eagle", path, example_inputs(model, "eagle", 1, 24, seed=1))
    assert parity["passed"], parity
