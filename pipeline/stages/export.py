"""The export stage: distill's drafter (+ calibration reports) -> a verified bundle bound to its target.

The bundle carries everything register and serving need and nothing they must trust blindly: the manifest
lists the sha256 of every file, the target fingerprint, the data digest, the full run config and the code
version. With `export.onnx` a weighted drafter also ships its step as drafter.onnx, checked against
onnxruntime before the stage may finish.
"""
from __future__ import annotations

import json
import subprocess
from importlib import metadata
from pathlib import Path

from pipeline.errors import DraftsmithError
from pipeline.runstore import RunStore, StageResult
from pipeline.sources import target_fingerprint
from pipeline.stages import sections_through
from pipeline.stages.context import StageContext
from runtime.bundle_reader import CONFIG, LOOKUP_CORPUS, WEIGHTS, read_bundle
from runtime.drafters import WEIGHT_QUANT, get_kind

BUNDLE_DIR = "bundle"
ENGINES_DIR = "engines"  # the drafter in serving engines' layouts, beside the bundle
CALIBRATION_SUFFIXES = (".json", ".png")  # calibrate's reports (layer_map.json, quant.json, plots)
# Parity runs at other shapes than the export's example, so a dynamic axis baked into a constant fails it.
ONNX_EXPORT_SHAPE, ONNX_PARITY_SHAPE = (2, 4), (1, 7)


def code_version() -> str:
    """`git describe` of the checkout this package runs from, else the installed package version."""
    repo = Path(__file__).resolve().parents[1]
    try:
        res = subprocess.run(["git", "-C", str(repo), "describe", "--always", "--dirty", "--tags"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        res = None
    if res is not None and res.returncode == 0 and res.stdout.strip():
        return f"git:{res.stdout.strip()}"
    return f"draftsmith=={metadata.version('draftsmith')}"


def calibrate_outputs(store: RunStore) -> dict:
    """The outputs the calibrate stage listed, if it completed; {} when it did not run."""
    rec = store.record("calibrate")
    return rec.get("outputs", {}) if rec is not None and rec.get("status") == "completed" else {}


def calibration_files(store: RunStore) -> dict[str, Path]:
    """The report files the calibrate stage listed as outputs, if it completed; {} when it did not run."""
    root = store.stage_dir("calibrate")
    named = [v for v in calibrate_outputs(store).values() if isinstance(v, str)]
    return {Path(v).name: root / v for v in named
            if Path(v).suffix in CALIBRATION_SUFFIXES and (root / v).is_file()}


def quantised_weights(store: RunStore) -> tuple[str, dict] | None:
    """(scheme, packed tensors) when calibrate chose a weight quantisation scheme, else None."""
    from safetensors import safe_open

    name = calibrate_outputs(store).get("quant_weights")
    if name is None:
        return None
    with safe_open(str(store.stage_dir("calibrate") / name), "pt") as f:
        return f.metadata()["scheme"], {k: f.get_tensor(k) for k in f.keys()}


def data_digest(store: RunStore) -> str:
    rec = store.record("prepare")
    if rec is None:
        raise DraftsmithError(f"export needs the prepare stage's record: {store.stage_dir('prepare')}/stage.json "
                              "is missing")
    return rec["inputs_digest"]


def onnx_checked(bundle_dir: Path, fingerprint: str, target_dir: Path, out: Path) -> dict:
    """Export the bundle's drafter step to `out` and check it against onnxruntime; raise if parity fails."""
    from export.onnx_export import check_onnx_parity, example_inputs, export_onnx
    from runtime.drafters import bundle_weights, drafter_module
    from runtime.target.loading import from_pretrained

    bundle = read_bundle(bundle_dir, fingerprint)
    if not get_kind(bundle.kind).onnx_inputs:
        raise DraftsmithError(f"export.onnx: drafter kind {bundle.kind!r} has no ONNX step (set export.onnx=false)")
    # lean: a drafter module reads only the target's embedding and head, which a lean load keeps plain
    target = from_pretrained(target_dir, max_seq_len=64, lean=True)
    # the trained module as the bundle reader rebuilds it, before the runtime prepacks its weights for CPU
    config, tensors = bundle_weights(bundle, target.dtype)
    module = drafter_module(config, target, tensors, max_len=64)
    record = export_onnx(module, bundle.kind, example_inputs(module, bundle.kind, *ONNX_EXPORT_SHAPE), out)
    parity = check_onnx_parity(module, bundle.kind, out, example_inputs(module, bundle.kind, *ONNX_PARITY_SHAPE,
                                                                        seed=1))
    if not parity["passed"]:
        raise DraftsmithError(f"export: {out.name} disagrees with the torch drafter (max relative difference "
                              f"{parity['max_rel_diff']:.3g} > tolerance {parity['tolerance']:.3g}); "
                              "the bundle was not written")
    return {**record, "parity": parity}


def engine_exports(ctx: StageContext, bundle_dir: Path, fingerprint: str) -> dict:
    """The bundle's drafter in every serving-engine layout its kind can write (export/engine_formats.py), each in
    engines/<format> beside the bundle: format -> its record, or why the format cannot express this drafter."""
    from export.engine_formats import write_engine_exports
    from pipeline.sources import verifier
    from runtime.drafters import bundle_weights, drafter_module
    from runtime.target.loading import from_pretrained

    bundle = read_bundle(bundle_dir, fingerprint)
    if not get_kind(bundle.kind).engine_formats:  # nothing to write: the target need not be loaded
        return {}
    target = from_pretrained(ctx.target_dir, max_seq_len=64, lean=True)  # as in onnx_checked
    config, tensors = bundle_weights(bundle, target.dtype)  # a quantised bundle's weights as the reader restores them
    depth = bundle.served_budget(ctx.configured_budget()).tree.depth  # what the engine is told to draft
    return write_engine_exports(bundle.kind, drafter_module(config, target, tensors, max_len=64),
                                verifier(ctx.cfg.target, ctx.target_dir), ctx.out / ENGINES_DIR, depth)


def run_export(ctx: StageContext) -> StageResult:
    from safetensors.torch import load_file

    from export.bundle_writer import write_bundle
    from export.onnx_export import ONNX_FILE

    distill = ctx.input("distill")
    drafter_config = json.loads((distill / CONFIG).read_text())
    tensors = load_file(str(distill / WEIGHTS)) if (distill / WEIGHTS).is_file() else None  # weightless: none
    if tensors is None and get_kind(drafter_config["kind"]).weighted:
        raise DraftsmithError(f"export: {distill / WEIGHTS} is missing for a {drafter_config['kind']!r} drafter")
    quantised = quantised_weights(ctx.store)
    if quantised is not None:  # the bundle carries the codes calibrate measured; the reader restores them
        drafter_config[WEIGHT_QUANT], tensors = quantised
    fingerprint = target_fingerprint(ctx.target_dir)
    extra_files = calibration_files(ctx.store)
    corpus = ctx.lookup_corpus_file()
    if corpus is not None:  # distill's, as it drafted from it
        extra_files[LOOKUP_CORPUS] = corpus
    extra_manifest = {"draft_budget": ctx.configured_budget().to_dict()}
    bundle_dir = ctx.out / BUNDLE_DIR
    lineage = dict(target_fingerprint=fingerprint, data_digest=data_digest(ctx.store),
                   config=ctx.cfg.model_dump(mode="json", include=set(sections_through("export"))),
                   code_version=code_version())

    def write(files: dict[str, Path], manifest: dict) -> dict:
        return write_bundle(bundle_dir, drafter_config, tensors, extra_files=files, extra_manifest=manifest, **lineage)

    manifest = write(extra_files, extra_manifest)
    metrics = {"bundle_files": len(manifest["files"])}
    if ctx.cfg.export.onnx and tensors is not None:
        # The ONNX file is exported from the bundle just written (what validate and serving load), in a scratch
        # path outside it, then the bundle is rewritten with it so the manifest covers its hash.
        scratch = ctx.out / ONNX_FILE
        onnx_record = onnx_checked(bundle_dir, fingerprint, ctx.target_dir, scratch)
        manifest = write({**extra_files, ONNX_FILE: scratch}, {**extra_manifest, "onnx": onnx_record})
        scratch.unlink()
        metrics |= {"bundle_files": len(manifest["files"]), "onnx_max_rel_diff": onnx_record["parity"]["max_rel_diff"]}
    engines = engine_exports(ctx, bundle_dir, fingerprint)
    written = sorted(name for name, record in engines.items() if isinstance(record, dict))
    outputs = {"bundle": BUNDLE_DIR, "manifest": f"{BUNDLE_DIR}/manifest.json"}
    if engines:
        outputs["engine_formats"] = engines
    return StageResult(outputs=outputs, metrics=metrics,
                       message=f"{drafter_config['kind']} bundle: {', '.join(sorted(manifest['files']))}"
                       + (f"; for serving engines: {', '.join(written)}" if written else ""))
