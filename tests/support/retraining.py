"""Retraining-loop fixtures: base chats and a tiny eagle run's settings for the tiny chat target, the pipeline run
stage by stage with calibrate stubbed, and a champion serving chat requests with capture on."""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.runstore import RunStore, StageResult
from pipeline.stages import STAGES, inputs_digest
from pipeline.stages.context import StageContext
from pipeline.tracking import stage_run

MODEL = "loop-drafter"
# a tiny eagle run on the tiny chat target: each stage takes seconds
TINY_EAGLE = {"data": {"max_length": 64, "regenerate": False, "cache_hidden": False, "min_assistant_tokens": 4,
                       "val_fraction": 0.25},
              "drafter": {"kind": "eagle", "draft_vocab": 0, "depth": 2, "width": 1, "nodes": 2, "lookup": 0},
              "distill": {"steps": 6, "warm_steps": 4, "batch_size": 4, "lr": 3e-3, "warmup": 1, "eval_every": 0,
                          "eval_rows": 4},
              "export": {"onnx": False}, "register": {"model_name": MODEL},
              "validate": {"num_prompts": 3, "max_new_tokens": 12, "gate": {"min_tau": 1.0, "min_speedup": 0.0}}}


def dotted(tree: dict, prefix: str = "") -> list[str]:
    """`tree` as key=value overrides."""
    out = []
    for k, v in tree.items():
        out += dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}={json.dumps(v)}"]
    return out


def base_chats(path: Path) -> Path:
    """40 chats over the words w4..w43 (the traffic below asks about w50 and up)."""
    path.write_text("".join(json.dumps({"conversations": [
        {"from": "human", "value": f"w{4 + i % 40} w{5 + i % 40} w{6 + i % 40}"},
        {"from": "gpt", "value": " ".join(f"w{4 + (i * 3 + j) % 40}" for j in range(10))}]}) + "\n"
        for i in range(40)))
    return path


def stub_calibrate(ctx: StageContext) -> StageResult:
    """Only the draft budget, as calibrate writes it (calibrate's own tests run it for real)."""
    chosen = {"depth": 2, "width": 1, "nodes": 2, "adaptive": False, "lookup": 0}
    (ctx.out / "draft_budget.json").write_text(json.dumps({"chosen": chosen, "sweep": []}))
    return StageResult(outputs={"draft_budget": "draft_budget.json"})


def run_pipeline(cfg, run_id: str) -> RunStore:
    """What `pipeline run` does, stage by stage (skipping a stage whose digest matches), with calibrate stubbed."""
    store = RunStore(cfg.run.dir, run_id)
    for stage in STAGES:
        digest = inputs_digest(stage, cfg, store)
        if store.is_current(stage.name, digest):
            continue
        run = stub_calibrate if stage.name == "calibrate" else stage.run
        with stage_run(cfg, store, stage.name, stage.sections):
            store.run_stage(stage.name, digest, lambda out: run(StageContext(cfg, store, out, digest)))
    return store


def serve_and_capture(cfg, traffic_url: str, requests: int = 12) -> None:
    """models:/MODEL@champion behind the OpenAI API with capture into `traffic_url`, asked `requests` chat requests
    about words the base chats never use through the `openai` client; every sixth sampled, the others greedy."""
    import openai

    from pipeline.bench.openai_stream import running
    from pipeline.serving.api_server import build_app
    from pipeline.serving.capture import CaptureSettings, TrafficCapture
    from pipeline.serving.server import load_champion

    served, _ = load_champion(cfg)
    capture = TrafficCapture(CaptureSettings(traffic_url))
    with running(build_app(served, MODEL, capture=capture)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        for i in range(requests):
            client.chat.completions.create(
                model=MODEL, max_tokens=10, temperature=0.8 if i % 6 == 5 else 0, seed=i,
                messages=[{"role": "user", "content": f"w{50 + i} w{60 + i} w{50 + i} w{60 + i}"}])
        capture.flush()
