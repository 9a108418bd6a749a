"""The `pipeline` CLI end to end on the real embedded target (prepare only; later stages are other issues)."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from pipeline.errors import DraftsmithError
from runtime.target.precision import float_dtype


def pipeline(*args, cwd):
    # mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI: an earlier in-process stage (e.g. test_serving's, against
    # a server since stopped) would otherwise choose the tracking store of these subprocesses
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env=env)


@pytest.fixture
def tiny_data(tmp_path):
    f = tmp_path / "chats.jsonl"
    rows = []
    for i in range(40):
        rows.append({"conversations": [{"from": "human", "value": f"Question number {i}: what is {i} plus {i}?"},
                                       {"from": "gpt", "value": f"The answer is {2 * i}, because {i} + {i} = {2 * i}."}]})
    rows.append({"broken": True})
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return f


@pytest.mark.slow
def test_prepare_skip_force_and_missing_stage(tmp_path, tiny_data):
    args = ["--run-id", "r1", f"data.source={tiny_data}", "data.val_fraction=0.2", "data.min_assistant_tokens=4",
            "data.regenerate=false", "data.cache_hidden=false"]
    first = pipeline("run", "--stage", "prepare", *args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    rec = json.loads((tmp_path / "runs/r1/prepare/stage.json").read_text())
    assert rec["status"] == "completed" and rec["metrics"]["malformed"] == 1
    assert rec["metrics"]["train_rows"] + rec["metrics"]["val_rows"] == 40
    again = pipeline("run", "--stage", "prepare", *args, cwd=tmp_path)
    assert "up to date" in again.stderr
    assert json.loads((tmp_path / "runs/r1/prepare/stage.json").read_text())["finished"] == rec["finished"]
    forced = pipeline("run", "--stage", "prepare", "--force", *args, cwd=tmp_path)
    assert json.loads((tmp_path / "runs/r1/prepare/stage.json").read_text())["finished"] > rec["finished"]
    assert forced.returncode == 0
    changed = pipeline("run", "--stage", "prepare", *args, "data.max_length=64", cwd=tmp_path)
    assert "up to date" not in changed.stderr  # a changed input reruns the stage

    missing = pipeline("run", "--stage", "calibrate", "--run-id", "r1", cwd=tmp_path)
    assert missing.returncode == 2 and "needs the output of distill" in missing.stderr
    assert "Traceback" not in missing.stderr
    typo = pipeline("run", "--stage", "distill", "--run-id", "r2", cwd=tmp_path)
    assert typo.returncode == 2 and not (tmp_path / "runs/r2").exists()  # no half-made run from a typo
    quick = ["drafter.kind=ngram", "validate.num_prompts=2", "validate.max_new_tokens=12", "export.onnx=false"]
    failing = pipeline("run", "--run-id", "r1", *args, *quick, "validate.gate.min_tau=50", cwd=tmp_path)
    assert failing.returncode == 3 and "gate_failed" in failing.stderr  # the gate said no: nothing registered
    assert not (tmp_path / "runs/r1/register").exists()
    refused = pipeline("run", "--stage", "register", "--run-id", "r1", cwd=tmp_path)
    assert refused.returncode == 2 and "gate_failed" in refused.stderr
    status = pipeline("status", "--run-id", "r1", cwd=tmp_path)
    assert status.returncode == 0 and "completed" in status.stdout


@pytest.mark.slow
def test_regenerated_data_and_cached_features_feed_distill(tmp_path, tiny_data):
    args = ["--run-id", "r", f"data.source={tiny_data}", "data.val_fraction=0.2", "data.min_assistant_tokens=4",
            "data.regenerate=true", "data.cache_hidden=true", "data.regen_max_new_tokens=8", "data.max_length=96",
            "drafter.draft_vocab=512", "distill.steps=2", "distill.batch_size=2", "distill.eval_rows=4"]
    prep = pipeline("run", "--stage", "prepare", *args, cwd=tmp_path)
    assert prep.returncode == 0, prep.stderr
    out = tmp_path / "runs/r/prepare"
    metrics = json.loads((out / "stage.json").read_text())["metrics"]
    assert metrics["train_rows"] + metrics["val_rows"] == 40 and metrics["train_loss_tokens"] == 8 * metrics["train_rows"]
    assert sorted(p.name for p in (out / "features").iterdir()) == ["train-00000.safetensors", "val-00000.safetensors"]
    assert not list((tmp_path / "runs/r").glob(".prepare-work*"))  # resumable work is gone once the stage is done
    distill = pipeline("run", "--stage", "distill", *args, cwd=tmp_path)
    assert distill.returncode == 0, distill.stderr
    metrics = json.loads((tmp_path / "runs/r/distill/stage.json").read_text())["metrics"]
    assert metrics["offline_features"] == 1 and 1.0 <= metrics["eval_sim_tau"] <= 7.0


def write_gguf(path, arch: str):
    """A GGUF file of `arch` with a header and one small tensor: all a family check reads."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("target, expected", [
    ("empty-config", "config.json has no model_type"),
    ("gemma3.gguf", "GGUF architecture 'gemma3' is not supported")])
def test_a_target_that_is_no_supported_causal_lm_is_one_line(tmp_path, target, expected):
    if target.endswith(".gguf"):
        write_gguf(tmp_path / target, "gemma3")
    else:
        (tmp_path / target).mkdir()
        (tmp_path / target / "config.json").write_text("{}")
    res = pipeline("run", "--stage", "prepare", "--run-id", "r", f"target={tmp_path / target}", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    error = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and expected in error[0], res.stderr
    assert error[0].endswith("supported families: llama, qwen2, qwen3, mistral")


def test_bad_override_is_one_line(tmp_path):
    res = pipeline("run", "distill.stepz=1", cwd=tmp_path)
    assert res.returncode == 2 and "unknown key 'distill.stepz'" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
def test_stage_is_tracked_in_mlflow(tmp_path, tiny_data):
    import mlflow

    res = pipeline("run", "--stage", "prepare", "--run-id", "r2", f"data.source={tiny_data}",
                   "data.val_fraction=0.2", "data.min_assistant_tokens=4", "data.regenerate=false",
                   "data.cache_hidden=false", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    runs = {r.info.run_name: r for r in mlflow.search_runs(experiment_names=["draftsmith"], output_format="list")}
    parent, stage = runs["r2"], runs["prepare"]
    assert stage.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert stage.data.tags["draftsmith.status"] == "completed"
    assert stage.data.metrics["malformed"] == 1 and stage.data.params["data.val_fraction"] == "0.2"
    arts = [a.path for a in mlflow.MlflowClient().list_artifacts(stage.info.run_id, "prepare")]
    assert "prepare/stage.json" in arts


@pytest.mark.slow
def test_bench_refuses_a_bundle_for_another_target(tmp_path):
    from export.bundle_writer import write_bundle

    write_bundle(tmp_path / "b", {"kind": "ngram", "max_ngram": 3}, None, target_fingerprint="other",
                 data_digest="d", config={}, code_version="t")
    res = pipeline("bench", "--drafter", str(tmp_path / "b"), cwd=tmp_path)
    assert res.returncode == 2 and "built for target" in res.stderr and "Traceback" not in res.stderr
    res = pipeline("bench", "--drafter", str(tmp_path / "missing"), cwd=tmp_path)
    assert res.returncode == 2 and "expected 'ngram', 'quantspec' or a bundle directory" in res.stderr


@pytest.mark.slow
def test_bench_cli_writes_report(tmp_path):
    (tmp_path / "p.txt").write_text('Say hello.\n{"ids": [1, 4093, 198, 19556, 30, 2, 198]}\n')  # ids: as they are
    res = pipeline("bench", "--drafter", "ngram", "--prompts", "p.txt", "--max-new-tokens", "8", "--dtype", "float32",
                   "--budget", "3x1+4", "--out", "b.json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    report = json.loads((tmp_path / "b.json").read_text())
    assert set(report["methods"]) == {"hf_generate", "ours_ar", "ours_spec"}
    assert report["methods"]["ours_spec"]["same_tokens_as_ours_ar"] is True
    assert report["ours_ar_fraction_of_floor"] > 0 and report["dtype"] == "float32"
    res = pipeline("bench", "--prompts", "p.txt", "--max-new-tokens", "4", "--out", "auto.json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    report = json.loads((tmp_path / "auto.json").read_text())
    bf16 = float_dtype("auto", torch.device("cpu")) == torch.bfloat16  # validate's default precision
    assert report["dtype"] == ("bfloat16" if bf16 else "float32")
    assert (report["weight_bytes_per_token"] < 300e6) == bf16  # bf16 halves the weights


@pytest.mark.slow
def test_bench_refuses_a_prompt_beyond_the_models_context_in_one_line(tmp_path):
    (tmp_path / "p.txt").write_text('Say hi.\n' + json.dumps({"ids": [198] * 9000}) + "\n")
    res = pipeline("bench", "--prompts", "p.txt", "--max-new-tokens", "8", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert re.sub(r"\s+", " ", res.stderr).count("prompt 2 of 2: prompt of 9000 tokens + max_new_tokens=8 does not "
                                                 "fit the model's context of max_position_embeddings=8192") == 1
    res = pipeline("bench", "--context", "1024,9000", "--max-new-tokens", "8", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "--context 9000: prompt of 9000 tokens + max_new_tokens=8 does not fit" in re.sub(r"\s+", " ", res.stderr)
    assert not (tmp_path / "bench.json").exists()


def device_budget_bundle(out, fingerprint: str, candidates: bool = True):
    """An n-gram bundle whose calibrated budget is a chain, with two device candidates (tau made up: the wider
    one's far outweighs any step cost) unless `candidates` is false."""
    from export.bundle_writer import write_bundle

    chain = {"depth": 1, "width": 1, "nodes": 1, "adaptive": False, "lookup": 0, "max_tree": 0}
    report = {"chosen": chain, "sweep": []}
    if candidates:
        report["device_candidates"] = [chain | {"tau": 1.1}, chain | {"depth": 3, "nodes": 3, "tau": 90.0}]
    out.mkdir()
    (out / "draft_budget.json").write_text(json.dumps(report))
    write_bundle(out / "b", {"kind": "ngram", "max_ngram": 3}, None, target_fingerprint=fingerprint, data_digest="d",
                 config={}, code_version="t", extra_files={"draft_budget.json": out / "draft_budget.json"})
    return out / "b"


@pytest.mark.slow
def test_bench_budget_device_runs_the_bundles_fastest_candidate(tmp_path, smollm2_dir, capsys):
    from pipeline.cli import main
    from pipeline.sources import target_fingerprint

    bundle = device_budget_bundle(tmp_path / "with", target_fingerprint(smollm2_dir))
    (tmp_path / "p.txt").write_text("Say hello.\n")
    res = pipeline("bench", "--drafter", str(bundle), "--budget", "device", "--prompts", "p.txt", "--max-new-tokens",
                   "8", "--dtype", "float32", "--out", "b.json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["device_budget"]["chosen"] == "3x1/3" and len(report["device_budget"]["candidates"]) == 2
    assert report["methods"]["ours_spec"]["same_tokens_as_ours_ar"] is True
    assert "draft budget on cpu: 3x1/3" in " ".join(res.stdout.split())
    old = device_budget_bundle(tmp_path / "without", target_fingerprint(smollm2_dir), candidates=False)
    for drafter, expected in ((None, "--budget device needs a bundle"), ("ngram", "--budget device needs a bundle"),
                              (str(old), f"--budget device: bundle {old} lists no device candidates")):
        assert main(["bench", "--budget", "device", *(["--drafter", drafter] if drafter else [])]) == 2
        assert expected in " ".join(capsys.readouterr().err.split())


def test_bench_prompts_file_lines_and_its_errors(tmp_path):
    from pipeline.cli import _bench_prompts

    good = tmp_path / "good.jsonl"
    good.write_text('Say hi.\n\n{"prompt": "Count to 3."}\n{"ids": [1, 9, 2]}\n')
    assert _bench_prompts(good) == ["Say hi.", "Count to 3.", [1, 9, 2]]
    for name, text, why in [("nofield.jsonl", 'ok\n{"x": 1}\n', ":2: a JSON line without a string 'prompt'"),
                            ("broken.jsonl", '{"prompt": \n', ":1: a JSON line"),
                            ("number.jsonl", '{"prompt": 3}\n', ":1: a JSON line"),
                            ("badids.jsonl", '{"ids": [1, -2]}\n', ":1: a JSON line"),
                            ("noids.jsonl", '{"ids": []}\n', ":1: a JSON line"),
                            ("empty.txt", "\n  \n", ": no prompts")]:
        (tmp_path / name).write_text(text)
        with pytest.raises(DraftsmithError, match=re.escape(f"{tmp_path / name}{why}")):
            _bench_prompts(tmp_path / name)


def test_bench_budget_flag_and_its_errors():
    from pipeline.cli import _budget
    from runtime.speculation.draft_budget import DraftBudget, ServedBudget

    assert _budget("2x3/6+8@5") == ServedBudget(DraftBudget(2, 3, 6), adaptive=False, lookup=8, max_tree=5)
    assert _budget("2x1") == ServedBudget(DraftBudget(2, 1, 0))
    for bad in ("4x3x2", "0x3", "deep", "4x3+", "4x0/2", "2x1@"):
        with pytest.raises(DraftsmithError, match=re.escape(f"--budget {bad!r}: expected DEPTHxWIDTH")):
            _budget(bad)


def test_an_error_with_brackets_prints_as_written(capsys):
    """Rich reads [..] as markup: an unescaped message such as the budget spec's crashed the error path."""
    from pipeline.cli import main

    assert main(["bench", "--budget", "0x3"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--budget '0x3': expected DEPTHxWIDTH[/NODES][+LOOKUP][@MAX_TREE]" in err


def test_unexpected_stage_failure_is_one_line_and_keeps_the_traceback(tmp_path, monkeypatch, capsys):
    from pipeline.cli import main
    import pipeline.stages.prepare

    def boom(ctx):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(pipeline.stages.prepare, "run_prepare", boom)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--stage", "prepare", "--run-id", "r", "expected_minutes=95"]) == 1
    err = capsys.readouterr().err
    assert "prepare: failed: RuntimeError: disk on fire" in err and "Traceback" not in err
    assert "expected:" not in err  # one stage: the full run's time would mislead
    assert main(["run", "--run-id", "full", "expected_minutes=95"]) == 1
    assert "expected: about 95 minutes" in capsys.readouterr().err
    saved = json.loads((tmp_path / "runs/r/prepare.error.json").read_text())
    assert "in boom" in saved["traceback"] and not (tmp_path / "runs/r/prepare").exists()


@pytest.mark.slow
@pytest.mark.parametrize("entry, depth", [("pipeline bench", []), ("python -m pipeline.bench.random_weights", ["2"])])
def test_random_weights_bench_runs_from_both_entry_points(tmp_path, entry, depth):
    """One definition of the flags: `pipeline bench` takes the module's (it had no --depth, and failed without it)."""
    from pipeline.bench import random_weights
    from pipeline.cli import main

    out = tmp_path / "r.json"
    args = ["--random-weights", "smollm2-135m", "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "3",
            "--n-prompts", "1", "--accept-rate", "1", "--out", str(out), *(["--depth", *depth] if depth else [])]
    assert (main(["bench", *args]) if entry == "pipeline bench" else random_weights.main(args)) == 0
    report = json.loads(out.read_text())
    assert f"depth={depth[0] if depth else 5}" in report["drafter"] and report["max_new_tokens"] == 3
    assert report["methods"]["ours_spec"]["matching_prefix_min"] == 3


BAD_NUMBERS = [("--max-new-tokens", "-3", "an int >= 1"), ("--max-new-tokens", "2.5", "an int >= 1"),
               ("--n-prompts", "0", "an int >= 1"), ("--depth", "0", "an int >= 1"),
               ("--accept-rate", "1.5", "a number >= 0 and <= 1"), ("--temperature", "nan", "a number >= 0"),
               ("--temperature", "-1", "a number >= 0"), ("--specattn-top-p", "0", "a number > 0 and <= 1")]


@pytest.mark.parametrize("flag, value, expected", BAD_NUMBERS)
def test_bench_numbers_are_checked_up_front_in_one_line(flag, value, expected, capsys):
    from pipeline.bench import random_weights
    from pipeline.cli import main

    entries = [lambda argv: main(["bench", *argv])]
    if flag not in ("--temperature", "--specattn-top-p"):  # pipeline bench's own flags
        entries.append(lambda argv: random_weights.main(["--random-weights", "smollm2-135m", *argv]))
    for entry in entries:
        with pytest.raises(SystemExit) as exit:
            entry([flag, value])
        err = capsys.readouterr().err
        assert exit.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
        assert f"argument {flag}: {value!r}: expected {expected}" in err


def bench_on(target_dir, tmp_path, *args) -> dict:
    """`pipeline bench` of the n-gram drafter on `target_dir` (two prompts), on the CPU in fp32; its report."""
    from pipeline.cli import main

    (tmp_path / "p.txt").write_text("w5 w6 w7 w5 w6\nw9 w10 w9 w10\n")
    out = tmp_path / "b.json"
    assert main(["bench", "--target", str(target_dir), "--drafter", "ngram", "--prompts", str(tmp_path / "p.txt"),
                 "--device", "cpu", "--dtype", "float32", "--out", str(out), *args]) == 0
    return json.loads(out.read_text())


def test_bench_of_generations_without_a_decode_forward(tmp_path, tiny_chat_target, capsys):
    """Each generation ends at its first token (the prefill's): no method made a decode forward to time."""
    report = bench_on(tiny_chat_target, tmp_path, "--max-new-tokens", "1")
    assert report["ours_ar_fraction_of_floor"] is None
    assert all(r["new_tokens"] == 2 and "decode_ms_per_forward" not in r for r in report["methods"].values())
    assert "our AR decode made no decode forward" in " ".join(capsys.readouterr().out.split())


def test_bench_shows_progress_per_method_and_prompt(tmp_path, tiny_chat_target, capfd):
    report = bench_on(tiny_chat_target, tmp_path, "--max-new-tokens", "3")
    assert report["methods"]["ours_spec"]["same_tokens_as_ours_ar"] is True
    err = capfd.readouterr().err
    for method in ("hf_generate", "ours_ar", "ours_spec"):
        assert f"{method}, warm-up" in err and f"{method}, prompt 1/2" in err and f"{method}, prompt 2/2" in err
    assert "9/9" in err  # three warm-ups and three methods on two prompts
