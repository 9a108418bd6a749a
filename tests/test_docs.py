"""Docs and code comments point only at what exists: every repo path, module and doc section they name.

Checked: README.md and docs/*.md (not docs/logs/, which are history and keep the names of their day), and the
comments and docstrings of the code. A reference is
- a path of the repo: `runtime/target/model.py`, `export/calibrate/`, with `:Name` or `::test_name` a name
  defined in that file;
- a module of our packages: `runtime.speculation.engine.Engine` (the module must exist, the names after it appear in
  it), as `python -m` takes them and docstrings name them;
- a doc section: `docs/cpu.md, "Title"` (a heading of that file) or a link `docs/cpu.md#anchor`, `[..](file#anchor)`.
And a table row that links a docs section holds only numbers that section holds: one source per number.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dags", "pipeline", "train", "export", "runtime", "kernels", "tests")
TOP = PACKAGES + ("scripts", "configs", "docs", ".ci")
CODE_DIRS = PACKAGES + ("scripts", ".ci")
FILE_SUFFIXES = ("py", "md", "sh", "json", "jsonl", "yaml", "cpp", "log", "png", "safetensors", "toml", "txt", "cu")

PATH = re.compile(r"(?<![\w./<>-])((?:%s)/[\w./-]*)((?::{1,2})[A-Za-z_]\w*)?" % "|".join(re.escape(t) for t in TOP))
MODULE = re.compile(r"(?<![\w./<>-])((?:%s)(?:\.[A-Za-z_]\w*)+)" % "|".join(PACKAGES))
SECTION = re.compile(r"((?:docs/)?[\w./-]+\.md),\s*\"([^\"]+)\"")
ANCHOR = re.compile(r"((?:docs/)?[\w./-]+\.md)#([\w-]+)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*x?(?![\w])")


def doc_files() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def code_files() -> list[Path]:
    """Every code file but this one, whose docstrings show broken references on purpose."""
    files = [ROOT / "Makefile", ROOT / ".ci" / "run"]
    for top in CODE_DIRS:
        files += [p for p in sorted((ROOT / top).rglob("*"))
                  if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts]
    return [f for f in files if f.is_file() and f != Path(__file__).resolve()]


@cache
def config_keys() -> frozenset[str]:
    """Dotted config keys (`export.onnx`): a section may share its name with a package."""
    from pipeline.config import Config

    def keys(model, prefix: str) -> set[str]:
        out = set()
        for name, field in model.model_fields.items():
            out.add(prefix + name)
            if isinstance(field.annotation, type) and hasattr(field.annotation, "model_fields"):
                out |= keys(field.annotation, f"{prefix}{name}.")
        return out

    return frozenset(keys(Config, ""))


def comments(path: Path) -> str:
    """A code file's comments and docstrings, one per line block (code and other strings left out)."""
    text = path.read_text()
    if path.suffix != ".py":
        return "\n".join(m.group(1) for m in re.finditer(r"(?:^|\s)#(.*)$", text, re.M))
    out = [tok.string.lstrip("#") for tok in tokenize.generate_tokens(io.StringIO(text).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append(ast.get_docstring(node, clean=False) or "")
    return "\n".join(out)


def slug(title: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def plain(title: str) -> str:
    return re.sub(r"[`*]", "", title).strip()


@cache
def headings(path: Path) -> tuple[tuple[int, str, str, int], ...]:
    """(level, title, anchor, line) of each heading outside code fences; repeated anchors get -1, -2, ..."""
    out, seen, fenced = [], {}, False
    for i, line in enumerate(path.read_text().splitlines()):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else HEADING.match(line)
        if m:
            anchor = slug(m.group(2))
            n = seen.get(anchor, 0)
            seen[anchor] = n + 1
            out.append((len(m.group(1)), m.group(2), anchor if n == 0 else f"{anchor}-{n}", i))
    return tuple(out)


def section_text(path: Path, anchor: str) -> str | None:
    """The text under the heading with this anchor, up to the next heading of its level or above."""
    lines = path.read_text().splitlines()
    hs = headings(path)
    for k, (level, _, a, start) in enumerate(hs):
        if a == anchor:
            end = next((line for lvl, _, _, line in hs[k + 1:] if lvl <= level), len(lines))
            return "\n".join(lines[start:end])
    return None


def doc_path(name: str, source: Path) -> Path:
    """A doc named in `source`: relative to the repo root when it starts with docs/, else to the source's folder."""
    return ROOT / name if name.startswith("docs/") or source.parent == ROOT or source.suffix != ".md" else \
        source.parent / name


def defines(path: Path, name: str) -> bool:
    """A def, class or assignment (`A, name = ...`, `name: int = ...`) of `name` at the start of a line."""
    assigned = rf"^\s*(?:\w+\s*,\s*)*{name}\s*(?:,\s*\w+\s*)*(?::[^=\n]*)?=(?!=)"
    return re.search(rf"^\s*(?:async\s+def|def|class)\s+{name}\b|{assigned}", path.read_text(), re.M) is not None


def module_problem(dotted: str) -> str | None:
    parts = dotted.split(".")
    if parts[-1] in FILE_SUFFIXES or dotted in config_keys():  # a file name (bundle.py) or a config key
        return None
    here = ROOT / parts[0]
    for i, part in enumerate(parts[1:], 1):
        if here.is_dir() and (here / part).is_dir():
            here = here / part
        elif here.is_dir() and (here / f"{part}.py").is_file():
            here = here / f"{part}.py"
        else:
            module = here / "__init__.py" if here.is_dir() else here
            text = module.read_text() if module.is_file() else ""
            missing = [p for p in parts[i:] if not re.search(rf"\b{p}\b", text)]
            return f"{'.'.join(parts[:i])} has no {'.'.join(missing)}" if missing else None
    return None


def path_problem(path: str, name: str | None) -> str | None:
    path = path.rstrip(".,;:)")
    target = ROOT / path
    if not target.exists():
        return "no such file or folder"
    if name and target.is_file() and not defines(target, name.lstrip(":")):
        return f"{path} defines no {name.lstrip(':')}"
    return None


def section_problem(doc: Path, anchor: str | None = None, title: str | None = None) -> str | None:
    if not doc.is_file():
        return f"no such doc {doc.relative_to(ROOT)}"
    if anchor is not None and anchor not in [a for _, _, a, _ in headings(doc)]:
        return f"{doc.relative_to(ROOT)} has no section #{anchor}"
    if title is not None and plain(title) not in [plain(t) for _, t, _, _ in headings(doc)]:
        return f"{doc.relative_to(ROOT)} has no section \"{title}\""
    return None


def broken_references(source: Path, text: str) -> list[str]:
    where = source.relative_to(ROOT)
    out = []
    links = LINK.findall(text) if source.suffix == ".md" else []
    if links:  # a link's target is checked as a link below; its text as any text
        text = LINK.sub(lambda m: m.group(0).split("](")[0] + "]", text)
    for m in PATH.finditer(text):
        problem = path_problem(m.group(1), m.group(2))
        if problem:
            out.append(f"{where}: {m.group(0)}: {problem}")
    for m in MODULE.finditer(text):
        problem = module_problem(m.group(1))
        if problem:
            out.append(f"{where}: {m.group(1)}: {problem}")
    for m in SECTION.finditer(text):
        problem = section_problem(doc_path(m.group(1), source), title=m.group(2))
        if problem:
            out.append(f"{where}: {m.group(0)}: {problem}")
    for m in ANCHOR.finditer(text):
        problem = section_problem(doc_path(m.group(1), source), anchor=m.group(2))
        if problem:
            out.append(f"{where}: {m.group(0)}: {problem}")
    for target in links:
        if re.match(r"[a-z]+:", target):  # http:, mailto:
            continue
        name, _, anchor = target.partition("#")
        doc = (source.parent / name).resolve() if name else source
        if not doc.exists():
            out.append(f"{where}: ({target}): no such file")
        elif anchor and doc.suffix == ".md":
            problem = section_problem(doc, anchor=anchor)
            if problem:
                out.append(f"{where}: ({target}): {problem}")
    return out


def unsourced_numbers(source: Path) -> list[str]:
    """In a table row linking a docs section, each cell's numbers (link texts left out) must be in the section the
    cell links, or else in the one the row links first."""
    out = []
    for line in source.read_text().splitlines():
        if not line.startswith("|"):
            continue
        cells = line.strip().strip("|").split("|")
        links = [LINK.findall(c) for c in cells]
        first = next((ls[0] for ls in links if ls), None)
        if first is None or "#" not in first:
            continue
        for cell, cell_links in zip(cells[1:], links[1:]):
            target = (cell_links or [first])[0]
            name, _, anchor = target.partition("#")
            text = section_text((source.parent / name).resolve(), anchor) or ""
            for number in NUMBER.findall(re.sub(r"\[[^\]]*\]\([^)]*\)", "", cell)):
                if not re.search(rf"(?<![\w.]){re.escape(number)}(?![\w])", text):
                    out.append(f"{source.relative_to(ROOT)}: {number} ({cell.strip()}) is not in {target}")
    return out


def test_docs_name_only_what_exists():
    assert [problem for doc in doc_files() for problem in broken_references(doc, doc.read_text())] == []


def test_code_comments_name_only_what_exists():
    assert [problem for code in code_files() for problem in broken_references(code, comments(code))] == []


def test_numbers_in_a_row_come_from_the_section_it_links():
    assert [problem for doc in doc_files() for problem in unsourced_numbers(doc)] == []


def test_the_checks_catch_what_they_should():
    """Each kind of reference, broken, is reported (the checks are not vacuous)."""
    doc = ROOT / "docs" / "architecture.md"
    text = ("`runtime/gpu_bench.py` `runtime/target/model.py:Linear` `runtime.speculation.engine.NoSuchThing` "
            "`python -m runtime.gpu_bench` (docs/cpu.md, \"No such section\") docs/gpu.md#no-such-anchor "
            "[x](cpu.md#nor-this) `runtime/speculation/engine.py` runtime.speculation.engine.Engine")
    found = broken_references(doc, text)
    assert len(found) == 7, found
    assert defines(ROOT / "runtime/drafters/ngram.py", "CORPUS_NEXT_ACCEPT")
    assert slug("`pipeline bench` on CPU") == "pipeline-bench-on-cpu"
    assert slug("KV at 2,048 tokens (`calibrate.context`, #43)") == "kv-at-2048-tokens-calibratecontext-43"
