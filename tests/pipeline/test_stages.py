"""The stage graph's inputs digests: a stage reruns when a config section it reads changes, and so does every stage
after it; every section a stage's code reads is one its digest covers."""
from __future__ import annotations

import ast
import importlib.util
from functools import cache

import pytest

from pipeline.config import Config, load_config
from pipeline.home import write_json_atomic
from pipeline.runstore import RunStore
from pipeline.stages import STAGE_NAMES, STAGES, inputs_digest, sections_through

SECTIONS = set(Config.model_fields)


def chain_digests(tmp_path, overrides: list[str]) -> dict[str, str]:
    """Every stage's inputs digest for the config with `overrides`, each stage recorded as finished before the next
    one's digest is taken (as `pipeline run` does)."""
    cfg = load_config(None, overrides)
    store = RunStore(tmp_path / "runs", "-".join(overrides).replace("/", "_") or "defaults")
    digests = {}
    for stage in STAGES:
        digests[stage.name] = inputs_digest(stage, cfg, store)
        write_json_atomic(store.stage_dir(stage.name) / "stage.json",
                          {"status": "completed", "inputs_digest": digests[stage.name]})
    return digests


@pytest.mark.parametrize("override, first", [("validate.gate.min_tau=2.5", "calibrate"),
                                             ("validate.precision=fp32", "calibrate"),
                                             ("validate.num_prompts=3", "calibrate"),
                                             ("validate.max_new_tokens=64", "calibrate"),
                                             ("run.seed=7", "prepare"),
                                             ("drafter.depth=3", "distill"),
                                             ("calibrate.kv_recent=8", "calibrate"),
                                             ("register.model_name=other", "register")])
def test_a_changed_section_reruns_the_first_stage_reading_it_and_every_later_one(tmp_path, override, first):
    before, after = chain_digests(tmp_path, []), chain_digests(tmp_path, [override])
    changed = [name for name in STAGE_NAMES if before[name] != after[name]]
    assert changed == list(STAGE_NAMES[STAGE_NAMES.index(first):])


@cache
def module_tree(module: str) -> ast.Module:
    return ast.parse(open(importlib.util.find_spec(module).origin).read())


def own_imports(tree: ast.Module) -> dict[str, str]:
    """name -> module of every `from <our package> import name` in a module (inside functions too)."""
    return {alias.asname or alias.name: node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
            and node.module.split(".")[0] in ("pipeline", "train", "export", "runtime") for alias in node.names}


def definitions(module: str) -> dict[str, ast.AST]:
    """A module's top-level functions, and the members of StageContext by name where the module defines it."""
    defs = {}
    for node in module_tree(module).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs[node.name] = node
        if isinstance(node, ast.ClassDef) and node.name == "StageContext":
            defs.update({f"ctx.{m.name}": m for m in node.body if isinstance(m, ast.FunctionDef)})
    return defs


def sections_read(module: str, function: str, seen: set | None = None) -> set[str]:
    """Config sections `module.function` reads (`cfg.<section>`, `ctx.cfg.<section>`), following the calls it makes
    to functions of our packages and to the stage context's helpers."""
    seen = set() if seen is None else seen
    if function not in definitions(module) and function in own_imports(module_tree(module)):
        return sections_read(own_imports(module_tree(module))[function], function, seen)  # a re-export
    if (module, function) in seen or function not in definitions(module):
        return set()
    seen.add((module, function))
    imports, found = own_imports(module_tree(module)), set()
    for node in ast.walk(definitions(module)[function]):
        if isinstance(node, ast.Attribute) and node.attr in SECTIONS and (
                isinstance(node.value, ast.Name) and node.value.id == "cfg"
                or isinstance(node.value, ast.Attribute) and node.value.attr == "cfg"):
            found.add(node.attr)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("ctx", "self"):
            found |= sections_read("pipeline.stages.context", f"ctx.{node.attr}", seen)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            found |= sections_read(imports.get(node.id, module), node.id, seen)
    return found


def test_the_reads_are_found():
    """The reader below is not vacuous: it finds what calibrate and prepare are known to read."""
    assert {"calibrate", "validate", "drafter", "target"} <= sections_read("export.calibrate.stage", "run_calibrate")
    assert {"data", "run", "target"} <= sections_read("pipeline.stages.prepare", "run_prepare")


@pytest.mark.parametrize("stage", STAGES, ids=STAGE_NAMES)
def test_every_section_a_stage_reads_is_covered_by_its_digest(stage):
    """Its own sections, or an earlier stage's (whose digest its own chains in); what its `derived` function reads,
    through the functions it calls, is covered by that function's value, which its digest holds."""
    module, function = stage.impl.split(":")
    derived: set = set()
    if stage.derived:
        sections_read(*stage.derived.split(":"), derived)  # marks the derived function and its callees as seen
    read = sections_read(module, function, derived)
    assert read, f"{stage.impl} reads no config section: the reader missed its code"
    assert read <= set(sections_through(stage.name)), \
        f"{stage.name} reads {sorted(read - set(sections_through(stage.name)))} outside its digest"
