"""The serving pyfunc: registered bundle + target -> speculative generation equal to plain greedy decoding."""
from __future__ import annotations

import json
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pytest
import torch
from support.helpers import run_concurrently
from support.mlflow_server import run_stage, validated_run

from pipeline.bench.load import free_port, start_server, stop
from pipeline.config import load_config
from pipeline.errors import DraftsmithError
from pipeline.serving.server import serve_invocation
from pipeline.serving.settings import BUDGET_ENV, DEVICE_ENV, budget_source, serving_device
from pipeline.sources import target_fingerprint
from pipeline.stages.register import run_promote, run_register
from runtime.bundle_reader import BundleError
from runtime.target.cpu_packing import Packable
from runtime.target.precision import float_dtype

def plain_greedy(target_dir: Path, prompts: list[str], max_new_tokens: int, dtype=torch.float32) -> list[str]:
    """Reference answers: the target alone, greedy, through the same chat template and stop token."""
    from transformers import AutoTokenizer

    from runtime.speculation.engine import Engine, EngineConfig
    from runtime.target.loading import from_pretrained

    tok = AutoTokenizer.from_pretrained(target_dir)
    target = from_pretrained(target_dir, dtype=dtype)
    engine = Engine(target, None, EngineConfig(max_seq_len=target.max_seq_len))
    answers = []
    for p in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False).input_ids
        answers.append(tok.decode(engine.generate(ids, max_new_tokens, stop_ids=(tok.eos_token_id,)).tokens,
                                  skip_special_tokens=True))
    return answers


def registry_cfg(tmp_path: Path, target: Path | str):
    return load_config(None, [f"run.dir={tmp_path / 'runs'}", f"target={target}",
                              f"register.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"])


def test_pyfunc_generates_like_the_target(tmp_path, tiny_chat_target):
    import mlflow

    cfg = registry_cfg(tmp_path, tiny_chat_target)
    store = validated_run(cfg, "r1", 1.5, target_fingerprint=target_fingerprint(tiny_chat_target))
    model_uri = run_stage(cfg, store, "register", run_register)["outputs"]["model_uri"]
    model = mlflow.pyfunc.load_model(model_uri)
    dtype = float_dtype(cfg.validate.precision, torch.device("cpu"))  # served as validate measured
    target = model.unwrap_python_model().served.engine.target
    assert target.dtype == dtype
    # lean on a CPU: every block weight is held once, packed (the replies below equal the plain target's)
    packed = [m for m in target.layers.modules() if isinstance(m, Packable)]
    assert packed and all(m.lean for m in packed)
    prompts = ["w5 w6 w7 w5 w6 w7 w5 w6", "w40 w41 w40 w41"]
    # The second row leaves max_new_tokens out (NaN in the frame): it gets validate's max_new_tokens.
    served = model.predict(pd.DataFrame([{"prompt": prompts[0], "max_new_tokens": 24}, {"prompt": prompts[1]}]))
    lengths = (24, cfg.validate.max_new_tokens)
    expected = [plain_greedy(tiny_chat_target, [p], n, dtype)[0] for p, n in zip(prompts, lengths)]
    assert served == expected and len(set(expected[0].split())) > 3  # a varied answer, not one repeated token
    sampled = model.predict(pd.DataFrame({"prompt": prompts[:1], "temperature": [0.8]}))
    assert len(sampled) == 1 and isinstance(sampled[0], str)
    with pytest.raises(ValueError, match="prompt=''"):
        model.predict(pd.DataFrame({"prompt": [""]}))
    with pytest.raises(ValueError, match="max_new_tokens=2.5: expected a whole number"):
        model.predict(pd.DataFrame({"prompt": ["w5"], "max_new_tokens": [2.5]}))


def test_pyfunc_refuses_a_bundle_for_other_weights(tmp_path, tiny_chat_target):
    import mlflow

    cfg = registry_cfg(tmp_path, tiny_chat_target)
    store = validated_run(cfg, "r1", 1.5, target_fingerprint="another-target")
    model_uri = run_stage(cfg, store, "register", run_register)["outputs"]["model_uri"]
    with pytest.raises(BundleError, match="built for target"):
        mlflow.pyfunc.load_model(model_uri)


@contextmanager
def served_champion(tmp_path: Path, target: Path | str, target_dir: Path, env: dict[str, str] | None = None):
    """A validated run for `target` registered and promoted to champion, then served by `pipeline serve`'s command
    on 127.0.0.1 (`env` over its environment) until the block ends: yields (config, port, the server's log)."""
    cfg = registry_cfg(tmp_path, target)
    store = validated_run(cfg, "r1", 1.5, target_fingerprint=target_fingerprint(target_dir))
    run_stage(cfg, store, "register", run_register)
    assert run_stage(cfg, store, "promote", run_promote)["metrics"]["promoted"]
    port = free_port()
    argv, served_env = serve_invocation(cfg, port)
    log = tmp_path / "serve.log"
    proc = start_server(argv, served_env | (env or {}), log)
    try:
        yield cfg, port, log
    finally:
        stop(proc)


@pytest.mark.slow
def test_serve_champion_over_http(tmp_path, smollm2_dir):
    """`pipeline serve`'s command serves models:/NAME@champion; POST /invocations answers like the target."""
    prompts = ["List the first five prime numbers.", "What is the capital of France?"]
    with served_champion(tmp_path, "smollm2-135m-instruct", smollm2_dir) as (cfg, port, _):
        body = json.dumps({"dataframe_records": [{"prompt": p, "max_new_tokens": 16} for p in prompts]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=180) as r:
            predictions = json.loads(r.read())["predictions"]
    expected = plain_greedy(smollm2_dir, prompts, 16, float_dtype(cfg.validate.precision, torch.device("cpu")))
    assert predictions == expected and all(p.strip() for p in predictions)


def test_serve_refuses_an_alias_the_registry_lacks(tmp_path):
    cfg = registry_cfg(tmp_path, "smollm2-135m-instruct")
    with pytest.raises(DraftsmithError, match="models:/draftsmith-drafter@champion: no such model version"):
        serve_invocation(cfg, free_port())


def test_serving_runs_graphs_on_a_gpu_and_the_bundle_as_calibrated_on_the_cpu(tmp_path, tiny_chat_target,
                                                                               monkeypatch):
    from export.bundle_writer import write_bundle
    from runtime.bundle_reader import read_bundle
    from runtime.serving.served_engine import served_engine
    from runtime.speculation.draft_budget import DraftBudget
    from runtime.target.loading import from_pretrained

    chosen = {"depth": 2, "width": 3, "nodes": 6, "adaptive": False, "lookup": 8, "max_tree": 0}
    (tmp_path / "draft_budget.json").write_text(json.dumps({"chosen": chosen, "sweep": []}))
    (tmp_path / "kv_quant.json").write_text(json.dumps({"chosen": "int8", "recent": 32, "candidates": []}))
    write_bundle(tmp_path / "b", {"kind": "ngram", "max_ngram": 4}, None, target_fingerprint="fp", data_digest="d",
                 config={}, code_version="test", extra_files={n: tmp_path / n for n in ("draft_budget.json",
                                                                                         "kv_quant.json")})
    bundle, target = read_bundle(tmp_path / "b"), from_pretrained(tiny_chat_target, max_seq_len=256)
    cpu = served_engine(bundle, target, 256).engine.cfg  # on the CPU: as calibrated
    assert (cpu.kv_scheme, cpu.static_verify, cpu.lookup, cpu.budget) == ("int8", False, 8, DraftBudget(2, 3, 6))
    assert cpu.speed_check and not served_engine(bundle, target, 256, speed_check=False).engine.cfg.speed_check
    assert cpu.draft_window == 0  # an n-gram drafter reads every prompt token
    gpu = served_engine(bundle, target, 256, graphed=True).engine.cfg  # what a CUDA target gets
    assert (gpu.kv_scheme, gpu.static_verify, gpu.lookup, gpu.budget) == (None, True, 8, DraftBudget(2, 3, 6))
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    assert serving_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert serving_device() == torch.device("cpu")
    for bad in ("tpu", *(() if torch.cuda.is_available() else ("cuda",))):
        monkeypatch.setenv(DEVICE_ENV, bad)
        with pytest.raises(DraftsmithError, match=f"DRAFTSMITH_DEVICE={bad!r}: expected cpu, or cuda"):
            serving_device()
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    assert (budget_source(torch.device("cuda")), budget_source(torch.device("cpu"))) == ("device", "calibrated")
    monkeypatch.setenv(BUDGET_ENV, "fastest")
    with pytest.raises(DraftsmithError, match="DRAFTSMITH_BUDGET='fastest': expected one of calibrated, device"):
        budget_source(torch.device("cpu"))


def test_pyfunc_serves_the_device_candidate_that_runs_fastest_here(tmp_path, tiny_chat_target, monkeypatch):
    """$DRAFTSMITH_BUDGET=device (the default on a GPU): the candidates are timed at load and the one with the most
    tokens/s served; its tau (from calibrate, made up here) outweighs any step cost. Output stays plain greedy."""
    import mlflow

    from runtime.speculation.draft_budget import DraftBudget

    chain = {"depth": 1, "width": 1, "nodes": 1, "adaptive": False, "lookup": 0, "max_tree": 0}
    wide = {"depth": 3, "width": 2, "nodes": 6, "adaptive": False, "lookup": 4, "max_tree": 5}
    report = {"chosen": chain, "sweep": [], "device_candidates": [chain | {"tau": 1.1}, wide | {"tau": 90.0}]}
    (tmp_path / "draft_budget.json").write_text(json.dumps(report))
    cfg = registry_cfg(tmp_path, tiny_chat_target)
    store = validated_run(cfg, "r1", 1.5, target_fingerprint=target_fingerprint(tiny_chat_target),
                          extra_files={"draft_budget.json": tmp_path / "draft_budget.json"})
    model_uri = run_stage(cfg, store, "register", run_register)["outputs"]["model_uri"]
    served = {}
    for source in ("device", "calibrated"):
        monkeypatch.setenv(BUDGET_ENV, source)
        served[source] = mlflow.pyfunc.load_model(model_uri)
    device, calibrated = (served[s].unwrap_python_model().served.engine.cfg for s in ("device", "calibrated"))
    assert (device.budget, device.lookup, device.max_tree) == (DraftBudget(3, 2, 6), 4, 5)
    assert (calibrated.budget, calibrated.lookup) == (DraftBudget(1, 1, 1), 0)
    prompt = "w5 w6 w7 w5 w6 w7 w5 w6"
    answer = served["device"].predict(pd.DataFrame([{"prompt": prompt, "max_new_tokens": 24.0}]))
    dtype = float_dtype(cfg.validate.precision, torch.device("cpu"))
    assert answer == plain_greedy(tiny_chat_target, [prompt], 24, dtype)


def test_pyfunc_batches_concurrent_requests_and_refuses_what_cannot_fit(tmp_path, tiny_chat_target, monkeypatch):
    """Two rows at once and no queue: three callers in parallel (one with two rows) each get their own greedy
    answers; a request of more rows than the server holds is refused at once with HTTP 429; bad settings are
    one-line errors naming the variable."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from pipeline.serving.settings import MAX_BATCH_ENV, MAX_QUEUE_ENV, POLICY_ENV, TIMEOUT_ENV, BatchSettings

    cfg = registry_cfg(tmp_path, tiny_chat_target)
    store = validated_run(cfg, "r1", 1.5, target_fingerprint=target_fingerprint(tiny_chat_target))
    model_uri = run_stage(cfg, store, "register", run_register)["outputs"]["model_uri"]
    for name, value in ((MAX_BATCH_ENV, "2"), (MAX_QUEUE_ENV, "1"), (POLICY_ENV, "fixed"), (TIMEOUT_ENV, "600")):
        monkeypatch.setenv(name, value)
    model = mlflow.pyfunc.load_model(model_uri)
    engine = model.unwrap_python_model().served.engine
    assert engine.max_batch == 2 and model.unwrap_python_model().served.scheduler.capacity == 3
    frames = [[{"prompt": "w5 w6 w7 w5 w6", "max_new_tokens": 20.0}],
              [{"prompt": "w40 w41 w40", "max_new_tokens": 14.0}, {"prompt": "w9 w8 w9 w8", "max_new_tokens": 9.0}],
              [{"prompt": "w60 w61 w62", "max_new_tokens": 17.0}]]
    # a 429 is possible: 3 rows fit, 4 are asked
    answers, errors = run_concurrently(lambda i: model.predict(pd.DataFrame(frames[i])), 3, timeout_s=600)
    dtype = float_dtype(cfg.validate.precision, torch.device("cpu"))
    for i, frame in enumerate(frames):
        if i in answers:
            assert answers[i] == [plain_greedy(tiny_chat_target, [r["prompt"]], int(r["max_new_tokens"]), dtype)[0]
                                  for r in frame]
    assert len(answers) + len(errors) == 3 and len(answers) >= 2
    assert all(isinstance(e, MlflowException) and e.get_http_status_code() == 429 for e in errors)
    with pytest.raises(MlflowException, match="a request of 4 rows can never fit") as refused:
        model.predict(pd.DataFrame([{"prompt": "w5"}] * 4))
    assert refused.value.get_http_status_code() == 429
    for name, value, match in ((MAX_BATCH_ENV, "0", "DRAFTSMITH_MAX_BATCH='0': expected an integer >= 1"),
                               (TIMEOUT_ENV, "soon", "DRAFTSMITH_REQUEST_TIMEOUT_S='soon': expected a number"),
                               (POLICY_ENV, "always", "DRAFTSMITH_BATCH_POLICY='always': expected one of")):
        monkeypatch.setenv(name, value)
        with pytest.raises(DraftsmithError, match=match):
            BatchSettings.from_env()
        monkeypatch.delenv(name)


def test_pyfunc_refuses_a_prompt_beyond_the_served_context_in_one_line(tiny_chat_target):
    from transformers import AutoTokenizer

    from pipeline.serving.pyfunc import DraftsmithPyfunc
    from pipeline.serving.served_model import ServedModel
    from pipeline.serving.settings import BatchSettings
    from runtime.serving.batch_engine import BatchEngine
    from runtime.speculation.engine import EngineConfig
    from runtime.target.loading import from_pretrained

    model = DraftsmithPyfunc()  # what load_context builds, with a short context (no queue: refused before it)
    engine = BatchEngine(from_pretrained(tiny_chat_target, max_seq_len=48), None, EngineConfig(max_seq_len=48), 1)
    model.served = ServedModel(AutoTokenizer.from_pretrained(tiny_chat_target), engine, None, (), 8, BatchSettings())
    n = len(model.served.chat_ids("w5 " * 40))
    assert n + 8 - 1 > 48
    rows = pd.DataFrame([{"prompt": "w5 w6"}, {"prompt": "w5 " * 40}])
    with pytest.raises(ValueError, match=f"^row 1: prompt of {n} tokens \\+ max_new_tokens=8 does not fit the "
                                         "served context of max_seq_len=48$"):
        model.predict(None, rows)
