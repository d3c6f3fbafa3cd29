"""docs/ARCHITECTURE.md cannot go stale silently: the one-way imports it draws, computed with
``ast`` from today's tree (every import, at module level or inside a function); benchmarks only
through the packages' public faces; and its module map names exactly the modules there are."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("embedder", "training", "indexer", "serving")
# who may import whom (the diagram at the top of docs/ARCHITECTURE.md)
ALLOWED = {
    "embedder": set(),
    "training": {"embedder"},
    "indexer": {"embedder"},
    "serving": {"embedder", "indexer"},
    "app": {"embedder", "indexer", "serving"},
    "configs": set(),
    "benchmarks": {"embedder", "training", "indexer", "serving", "benchmarks"},
}
# Benchmarks reach past a face here, on purpose (docs/ARCHITECTURE.md says why):
# training's face is owned by the training package and does not export everything the
# benchmarks use yet (public names of its submodules are fine there),
# and store_check_cost times the per-read check by switching its private hook off.
PRIVATE_OK = {("benchmarks/store_check_cost.py", "indexer.lmdb_env")}


def _modules() -> list[Path]:
    """Every module of the product and its tools, as paths relative to the repository."""
    out = [Path("app.py")]
    for d in (*PACKAGES, "benchmarks", "configs"):
        out += sorted(p.relative_to(REPO) for p in (REPO / d).glob("*.py"))
    return out


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, names imported from it, line) for every absolute import in the file."""
    out = []
    for node in ast.walk(ast.parse((REPO / path).read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, [a.name for a in node.names], node.lineno))
    return out


def _owner(path: Path) -> str:
    return path.parts[0] if len(path.parts) > 1 else path.stem


def test_imports_point_one_way():
    wrong = []
    for path in _modules():
        me = _owner(path)
        for module, _, line in _imports(path):
            top = module.split(".")[0]
            if (top in ALLOWED and top != me and top not in ALLOWED[me]) or top == "tests":
                wrong.append(f"{path}:{line} imports {module}")
    assert not wrong, "imports against the one-way rule of docs/ARCHITECTURE.md:\n" + "\n".join(wrong)


def test_benchmarks_use_the_public_faces():
    faces = {p: set(importlib.import_module(p).__all__) for p in PACKAGES}
    wrong = []
    for path in (p for p in _modules() if p.parts[0] == "benchmarks"):
        for module, names, line in _imports(path):
            parts = module.split(".")
            if parts[0] not in PACKAGES:
                continue
            where = f"{path}:{line} {module}"
            if len(parts) == 1:
                wrong += [f"{where}: {n} is not in {module}.__all__" for n in names
                          if n not in faces[module] and (str(path), f"{module}.{n}") not in PRIVATE_OK]
            elif parts[0] == "training" or parts[1] in faces[parts[0]]:
                wrong += [f"{where}: {n} is private" for n in names if n.startswith("_")]
            else:
                wrong.append(f"{where}: {parts[1]} is not a public module of {parts[0]}")
    assert not wrong, "benchmarks past the packages' faces:\n" + "\n".join(wrong)


def test_the_module_map_names_every_module_and_only_modules_there_are():
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"(?<![\w/.])((?:%s)/[A-Za-z0-9_]+\.py)\b" % "|".join((*PACKAGES, "benchmarks", "configs")), text))
    named |= {"app.py"} if re.search(r"`app\.py`", text) else set()
    there = {str(p) for p in _modules() if p.name not in ("__init__.py", "__main__.py")}
    assert not there - named, f"modules docs/ARCHITECTURE.md does not name: {sorted(there - named)}"
    gone = {n for n in named if not (REPO / n).is_file()}
    assert not gone, f"docs/ARCHITECTURE.md names modules that do not exist: {sorted(gone)}"


@pytest.mark.parametrize("face", PACKAGES)
def test_every_public_name_resolves(face):
    """A name or module in a face's __all__ that does not import is a map that lies."""
    mod = importlib.import_module(face)
    for name in mod.__all__:
        if not hasattr(mod, name):
            importlib.import_module(f"{face}.{name}")
