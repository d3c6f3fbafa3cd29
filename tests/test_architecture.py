"""docs/ARCHITECTURE.md cannot go stale silently: the one-way imports it draws, computed with
``ast`` from today's tree (every import, at module level or inside a function); no import circle
between a package's modules; indexer's subpackages in layers that import one way; no private name
imported across product modules; benchmarks only through the packages' public faces, by import and
by attribute (no ``x._name`` on a product module or object); its module map names exactly the
modules there are (subpackages included), and its table of faces exactly each package's ``__all__``."""
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
# Benchmarks reach past a face here, on purpose (docs/ARCHITECTURE.md says why): training's face
# does not export everything the benchmarks use (public names of its submodules are fine there).
# Circles between two modules of a package (imports inside functions included): none is left.
KNOWN_CIRCLES: set[frozenset[str]] = set()     # issue 31 removed the last three


def _modules() -> list[Path]:
    """Every module of the product and its tools (subpackages included), as paths relative to
    the repository."""
    out = [Path("app.py")]
    for d in (*PACKAGES, "benchmarks", "configs"):
        out += sorted(p.relative_to(REPO) for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts)
    return out


def _dotted(path: Path) -> str:
    """``indexer/ann/stream.py`` -> ``indexer.ann.stream``; a package's ``__init__.py`` -> the package."""
    parts = list(path.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(path: Path, node: ast.ImportFrom) -> str:
    """The module an ``ImportFrom`` in ``path`` names, relative imports resolved."""
    if node.level == 0:
        return node.module or ""
    package = list(path.parent.parts)
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


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


#: issue 40's bar: a module past this many lines holds two things; split it where they part
MAX_MODULE_LINES = 450


def test_no_product_module_is_over_the_line_bar():
    """Three modules had crept past it (embedder/quantize.py 484, indexer/cli/write.py 463,
    indexer/store/gallery.py 454) with nothing to say so."""
    product = [p for p in _modules() if _owner(p) in (*PACKAGES, "app")]
    long = {str(p): n for p in product if (n := len((REPO / p).read_text().splitlines())) > MAX_MODULE_LINES}
    assert len(product) > 100 and long == {}


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
                wrong += [f"{where}: {n} is not in {module}.__all__" for n in names if n not in faces[module]]
            elif parts[0] == "training" or parts[1] in faces[parts[0]] or (
                    parts[0] == "indexer" and parts[1] in INDEXER_LAYERS):
                wrong += [f"{where}: {n} is private" for n in names if n.startswith("_")]
            else:
                wrong.append(f"{where}: {parts[1]} is not a public module of {parts[0]}")
    assert not wrong, "benchmarks past the packages' faces:\n" + "\n".join(wrong)


def test_the_module_map_names_every_module_and_only_modules_there_are():
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"(?<![\w/.])((?:%s)/(?:[A-Za-z0-9_]+/)*[A-Za-z0-9_]+\.py)\b" % "|".join((*PACKAGES, "benchmarks", "configs")), text))
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


def _root(node: ast.AST) -> ast.AST:
    """The name an expression such as ``a.b().c[0]`` starts from."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript, ast.Await)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _names_bound(target: ast.AST) -> set[str]:
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(set(), *(_names_bound(e) for e in target.elts))
    return set()


def private_attribute_access(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, expression) of every ``x._name`` (not a dunder) where ``x`` is a product module or
    a product object: a name imported from a package, or assigned (``=``, ``with ... as``, ``for``)
    from an expression that starts with such a name, transitively (a flow-insensitive
    approximation: it follows names, not values through helper functions)."""
    product: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            product |= {(a.asname or a.name).split(".")[0] for a in n.names
                        if a.name.split(".")[0] in PACKAGES}
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] in PACKAGES:
            product |= {a.asname or a.name for a in n.names}
    while True:
        known = len(product)
        for n in ast.walk(tree):
            if isinstance(n, ast.Assign):
                pairs = [(t, n.value) for t in n.targets]
            elif isinstance(n, (ast.AnnAssign, ast.NamedExpr)) and n.value is not None:
                pairs = [(n.target, n.value)]
            elif isinstance(n, (ast.With, ast.AsyncWith)):
                pairs = [(i.optional_vars, i.context_expr) for i in n.items if i.optional_vars]
            elif isinstance(n, (ast.For, ast.comprehension)):
                pairs = [(n.target, n.iter)]
            else:
                continue
            for target, value in pairs:
                r = _root(value)
                if isinstance(r, ast.Name) and r.id in product:
                    product |= _names_bound(target)
        if len(product) == known:
            break
    return [(n.lineno, ast.unparse(n)) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
            and isinstance(_root(n.value), ast.Name) and _root(n.value).id in product]


def test_benchmarks_use_no_private_attribute_of_product_code():
    wrong = [f"{path}:{line} {expr}" for path in _modules() if path.parts[0] == "benchmarks"
             for line, expr in private_attribute_access(ast.parse((REPO / path).read_text()))]
    assert not wrong, "benchmarks reading or writing product internals:\n" + "\n".join(wrong)


def test_the_private_access_check_sees_modules_objects_and_their_chains():
    code = ("from indexer import lmdb_env, Index\nimport training.das as d\nfrom os import path\n"
            "lmdb_env._check = None\nidx = Index.open('x')\nstore = idx.store\nstore._shared\n"
            "with Index.open('y') as j:\n    j.store._db('ids')\nd.DAS(2, 2)._gen()\n"
            "path._joinrealpath\nidx.__class__\n")
    found = [expr for _, expr in private_attribute_access(ast.parse(code))]
    assert sorted(found) == sorted(["lmdb_env._check", "store._shared", "j.store._db",
                                    "d.DAS(2, 2)._gen"])


def _module_imports() -> dict[str, set[str]]:
    """Each product module's imports of other modules of its own package (relative or absolute,
    at any level of the file), not counting its package's face."""
    mods = {_dotted(p): p for p in _modules() if p.parts[0] in PACKAGES and p.name != "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        pkg = path.parts[0]
        deps = set()
        for n in ast.walk(ast.parse((REPO / path).read_text())):
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                base = _absolute(path, n)
                targets = [base, *(f"{base}.{a.name}" for a in n.names)]
            else:
                continue
            deps |= {t for t in targets if t in mods and t != name and t.startswith(pkg + ".")}
        graph[name] = deps
    return graph


def test_no_import_circle_between_the_modules_of_a_package():
    """A circle (even through an import inside a function) means two modules that can only be
    understood, and changed, together (das.py <-> das_check.py was one)."""
    graph = _module_imports()
    circles = set()
    for start in graph:
        stack = [(start, (start,))]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    circles.add(frozenset(path))
                elif nxt not in path:
                    stack.append((nxt, path + (nxt,)))
    new = sorted(" <-> ".join(sorted(c)) for c in circles - KNOWN_CIRCLES)
    assert not new, "import circles between modules of one package:\n" + "\n".join(new)


# indexer's subpackages (and its two shared modules) in layers: a module imports only from its own
# layer or a lower one (docs/ARCHITECTURE.md draws it), so no two subpackages import each other.
INDEXER_LAYERS = {"errors": 0, "searchable": 0, "directory": 1, "store": 2, "ann": 3, "ray": 4,
                  "layouts": 5, "build": 6, "audit": 7, "cli": 8, "__main__": 9, "__init__": 10}


def _layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def layer_violations(path: Path, tree: ast.AST) -> list[str]:
    """Each import in ``path`` (an indexer module) of a module in a layer above its own, or of
    another subpackage in the same layer."""
    me, wrong = _layer(_dotted(path)), []
    assert me in INDEXER_LAYERS, f"{path}: a new part of indexer/; give it a layer in INDEXER_LAYERS"
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            targets = [_absolute(path, n)]
        elif isinstance(n, ast.Import):
            targets = [a.name for a in n.names]
        else:
            continue
        for t in targets:
            if t.split(".")[0] == "indexer" and t != "indexer":
                other = _layer(t)
                if other != me and INDEXER_LAYERS[other] >= INDEXER_LAYERS[me]:
                    wrong.append(f"{path}:{n.lineno} ({me}) imports {t} ({other})")
    return wrong


def test_indexer_subpackages_depend_one_way():
    wrong = [w for path in _modules() if path.parts[0] == "indexer"
             for w in layer_violations(path, ast.parse((REPO / path).read_text()))]
    assert not wrong, "imports against indexer's layers:\n" + "\n".join(wrong)


def test_the_layer_check_sees_upward_and_sideways_imports():
    code = ("from ..build.ray_build import connect\nfrom ..directory.manifest import Manifest\n"
            "from . import fanout\nimport indexer.layouts.index\nfrom indexer import Index\n")
    found = layer_violations(Path("indexer/ray/readers.py"), ast.parse(code))
    assert [w.split(" ", 1)[0] for w in found] == ["indexer/ray/readers.py:1", "indexer/ray/readers.py:4"]


def private_imports(path: Path, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each private name (``_x``, not a dunder) imported from a product module."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and _absolute(path, n).split(".")[0] in (*PACKAGES, "app"):
            out += [(n.lineno, a.name) for a in n.names if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_no_private_name_is_imported_across_modules():
    """A name another module needs is a public seam of the module that owns it (issue 40: the
    fan-out imported ``_ray`` and ``_near`` from the Ray build)."""
    wrong = [f"{path}:{line} imports {name}" for path in _modules() if _owner(path) in (*PACKAGES, "app")
             for line, name in private_imports(path, ast.parse((REPO / path).read_text()))]
    assert not wrong, "private names imported across modules:\n" + "\n".join(wrong)


def test_the_private_import_check_sees_relative_and_absolute_imports():
    code = ("from ..build.ray_build import _ray as r\nfrom .x import a, _b\nfrom indexer.y import _c\n"
            "from os import _exit\nfrom . import __version__\n")
    found = private_imports(Path("indexer/ray/fanout.py"), ast.parse(code))
    assert found == [(1, "_ray"), (2, "_b"), (3, "_c")]


def test_the_table_of_faces_lists_each_package_all():
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    for pkg in PACKAGES:
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| `{pkg}/` |"))
        named = set(re.findall(r"`([A-Za-z_]\w*)`", row.rsplit("|", 2)[-2]))
        face = set(importlib.import_module(pkg).__all__)
        assert named == face, (f"docs/ARCHITECTURE.md's face of {pkg}/: missing {sorted(face - named)}, "
                               f"not exported {sorted(named - face)}")


# Single vs sharded is told apart in the layouts' own code only (issue 40): everything else works
# on the indexer.layouts.layout.Layout protocol. ``args.sharded`` (the CLI's build flag) is not a layout.
LAYOUT_CODE = {"indexer/layouts/layout.py", "indexer/layouts/shards.py", "indexer/directory/manifest.py",
               "indexer/directory/shard_files.py"}
_LAYOUT_BRANCH = re.compile(r"isinstance\([^)]*\bSharded\b|\bis_sharded\b|[=!]=\s*[\"']s(ingle|harded)[\"']"
                            r"|[\"']s(ingle|harded)[\"']\s*[=!]=|\b(if|elif|and|or|not)\b[^#]*(?<!args)\.sharded\b")


def layout_branches(text: str) -> list[tuple[int, str]]:
    """(line, text) of each line that decides single vs sharded for itself."""
    return [(i, ln.strip()) for i, ln in enumerate(text.splitlines(), 1)
            if not ln.lstrip().startswith("#") and _LAYOUT_BRANCH.search(ln)]


def test_no_layout_branch_outside_the_layouts_code():
    wrong = [f"{path}:{line} {ln}" for path in _modules()
             if _owner(path) in (*PACKAGES, "app") and path.as_posix() not in LAYOUT_CODE
             for line, ln in layout_branches((REPO / path).read_text())]
    assert not wrong, "single vs sharded decided outside indexer/layouts/:\n" + "\n".join(wrong)


def test_the_layout_branch_check_sees_each_form():
    code = ("if isinstance(idx.layout, Sharded):\nx = m.is_sharded\nif facts['layout'] == 'sharded':\n"
            "y = a if manifest.sharded else b\nif args.sharded:\nstore = ShardedStore(dirs)\n"
            "files = manifest.sharded['files']\n")
    assert [line for line, _ in layout_branches(code)] == [1, 2, 3, 4]



# The manifest is typed all the way down (issue 40): outside indexer/directory/ a record of it is
# read by attribute (``m.sharded.held``), never by string key (``m["model"]``, ``m.sharded["held"]``,
# ``m.get("neighbours")``). Rows of other tables that share a key name are listed with their reason.
MANIFEST_RECORDS = {"model", "index_file", "shard", "sharded", "neighbours", "ingest", "candidates"}
NOT_MANIFEST_READS = {("indexer/cli/read.py", "p['shard']"), ("indexer/cli/read.py", "s['shard']"),  # info's parts rows
                      ("indexer/audit/run.py", "r['neighbours']")}                                    # the audit's rows


def record_key_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, code) of each read of a manifest record by string key: ``x["model"]``,
    ``x.get("sharded")``, ``x.model["hash"]``, ``x.sharded.get("files")`` (writes are not reads)."""
    out = []
    for n in ast.walk(tree):
        is_get = isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args
        key = n.slice if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Load) else n.args[0] if is_get else None
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
            continue
        on = n.value if isinstance(n, ast.Subscript) else n.func.value
        if key.value in MANIFEST_RECORDS or (isinstance(on, ast.Attribute) and on.attr in MANIFEST_RECORDS):
            out.append((n.lineno, ast.unparse(n)))
    return out


def test_no_manifest_record_is_read_by_string_key_outside_the_directory_subpackage():
    wrong = [f"{path}:{line} {code}" for path in _modules()
             if _owner(path) in (*PACKAGES, "app") and not path.as_posix().startswith("indexer/directory/")
             for line, code in record_key_reads(ast.parse((REPO / path).read_text()))
             if (path.as_posix(), code) not in NOT_MANIFEST_READS]
    assert not wrong, "manifest records read by string key (read the typed fields):\n" + "\n".join(wrong)


def test_the_record_key_check_sees_each_form():
    code = ('a = m["model"]["hash"]\nb = manifest.get("neighbours")\nc = m.sharded["held"]\n'
            'd = m.model.get("source")\nfields["neighbours"] = rec\ne = m.sharded.held\nf = x["count"]\n')
    assert sorted(line for line, _ in record_key_reads(ast.parse(code))) == [1, 2, 3, 4]

# The searchable index is one type (issue 40): serving reads an answer's partial from the answer
# and a mode's facts from indexer.searchable.Searchable, never by probing for an attribute, and
# no answer travels as per-thread state.
_PROBE = re.compile(r"getattr\([^,]*\.faiss\b|threading\.local\(")
PER_THREAD_OK = {"indexer/store/lmdb_env.py"}     # LMDB read transactions are per thread by LMDB's rule


def test_no_attribute_probing_of_the_searchable_index_and_no_thread_local_answers():
    wrong = [f"{path}:{i} {ln.strip()}" for path in _modules()
             if _owner(path) in (*PACKAGES, "app") and path.as_posix() not in PER_THREAD_OK
             for i, ln in enumerate((REPO / path).read_text().splitlines(), 1) if _PROBE.search(ln)]
    assert not wrong, "probing or thread-local state:\n" + "\n".join(wrong)
    assert _PROBE.search('p = getattr(idx.faiss, "partial", None)') and _PROBE.search("x = threading.local()")



def hook_calls(code: str) -> list[int]:
    """Lines where code runs what the environment names, or stands in for a crash: an import of a
    module whose name is not fixed in the source (a constant, an f-string that starts with one,
    or relative to the package itself: a lazy face), ``os.abort()``. Both were test hooks in product modules once (issue 40 step 5)."""
    def name(f: ast.expr) -> str:
        return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")

    def fixed(a: ast.expr) -> bool:
        return isinstance(a, ast.Constant) or (isinstance(a, ast.JoinedStr) and bool(a.values)
                                               and isinstance(a.values[0], ast.Constant))
    return sorted(n.lineno for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call) and (
        (name(n.func) in ("import_module", "__import__") and not (n.args and fixed(n.args[0]))
         and not (len(n.args) > 1 and name(n.args[1]) == "__name__"))
        or name(n.func) == "abort"))


def test_test_hooks_live_in_the_tests():
    """Faults are put into the product from outside: Ray's own runtime-env hooks
    (tests/ray_testlib.py), a `sitecustomize` on a child's path, monkeypatching; never an
    environment variable that a product module turns into code or a crash."""
    wrong = [f"{path}:{line}" for path in _modules() if _owner(path) in (*PACKAGES, "app")
             for line in hook_calls((REPO / path).read_text())]
    assert not wrong, "a test hook in product code:\n" + "\n".join(wrong)


def test_the_test_hook_check_sees_each_form():
    code = ("module, name, arg = spec.split(':', 2)\n"
            "f = getattr(importlib.import_module(module), name)\n"
            "if os.environ.get(CRASH_ENV):\n    os.abort()\n"
            "m = import_module(f'.{mod}', __name__)\n"          # a package's own lazy face: fine
            "m = import_module(LAZY[name], __name__)\n"
            "e = importlib.import_module(f'efficientnet_lite{n}_model')\n"
            "x = __import__(os.environ['X'])\n")
    assert hook_calls(code) == [2, 4, 8]
