"""The build surface's single owners: the manifest schema, "not an index directory", the one
input check of every build entry, and the memory budget applied before candidates are built."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from embedder.images import IMAGE_SUFFIXES
from indexer import IndexDir, IndexerError, build_index, merge_shards
from indexer.ann import faiss_index as fx
from indexer.ann import selection
from indexer.__main__ import main
from indexer.directory.manifest import FORMAT, Manifest
from indexer.build.ray_build import build_with_ray
from indexer_testlib import REPO

OLD = Path(__file__).parent / "data" / "manifests-main-7c05da6"


# ---------------------------------------------------------------------------- the manifest
@pytest.mark.parametrize("name", ["flat", "s0", "merged", "sharded", "auto"])
def test_manifests_written_before_the_schema_read_and_rewrite_unchanged(name: str, tmp_path: Path) -> None:
    """Manifests written by main's code at 7c05da6 (a Flat build, a shard, an IVF merge under a
    budget, a sharded index, a measured selection): read as written, rewritten key for key."""
    old = json.loads((OLD / f"{name}.json").read_text())
    d = IndexDir(tmp_path)
    d.manifest_file.write_text(json.dumps(old))
    assert d.read_manifest() == old
    assert d.write_manifest(d.read_manifest()) == old
    assert json.loads(d.manifest_file.read_text()) == old
    assert Manifest.from_dict(old).to_dict() == old


@pytest.mark.parametrize("broken, why", [
    ({"format": FORMAT, "model": {"hash": "ab"}}, "missing dim, count"),
    ({"format": FORMAT, "model": "ab", "dim": 64, "count": 3}, "model.hash"),
    ({"format": FORMAT, "model": {"hash": "ab"}, "dim": "64", "count": 3}, "key 'dim': '64'"),
    ({"format": FORMAT, "model": {"hash": "ab"}, "dim": 64, "count": 3, "shard": [0, 2]}, "shard"),
    ({"format": "das-index/0", "model": {"hash": "ab"}, "dim": 64, "count": 3}, "format"),
])
def test_a_manifest_of_the_wrong_shape_is_refused_in_one_line(broken: dict, why: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps(broken))
    assert main(["info", "--index", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"not a {FORMAT} manifest" in err[0] and why in err[0], err


def test_only_schema_keys_are_written_and_unknown_keys_read_back(tmp_path: Path) -> None:
    old = json.loads((OLD / "flat.json").read_text())
    d = IndexDir(tmp_path)
    with pytest.raises(IndexerError, match=r"\['nprob'\] are not fields of indexer.directory.manifest.Manifest"):
        d.write_manifest({**old, "nprob": 3})                         # a misspelt key is a bug here
    assert not d.manifest_file.exists()
    d.manifest_file.write_text(json.dumps({**old, "added_by_a_newer_version": [1]}))
    assert d.read_manifest()["added_by_a_newer_version"] == [1]       # a reader keeps what it does not know


# ---------------------------------------------------------------------------- not an index directory
def test_not_an_index_directory_is_one_message_everywhere(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from serving import Searcher

    nowhere = tmp_path / "nowhere"
    with pytest.raises(IndexerError) as e:
        IndexDir(nowhere).require()
    msg = str(e.value)
    assert msg.startswith(f"{nowhere}: not an index directory") and "python -m indexer build" in msg
    for argv in (["info"], ["search", str(tmp_path / "q.png")], ["remove", "3"], ["repair"],
                 ["add", str(tmp_path)]):
        assert main([*argv, "--index", str(nowhere)]) == 1
        assert capsys.readouterr().err == f"indexer {argv[0]}: error: {msg}\n"
    with pytest.raises(IndexerError, match="not an index directory") as e:
        Searcher.open([nowhere])
    assert str(e.value) == msg
    r = subprocess.run([sys.executable, str(REPO / "app.py"), "--index", str(nowhere)], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert (r.returncode, r.stderr) == (1, f"app.py: error: {msg}\n")
    stopped = tmp_path / "stopped"
    IndexDir(stopped).store_dir.mkdir(parents=True)          # a first build killed before its manifest
    for argv in (["info"], ["search", str(tmp_path / "q.png")]):
        assert main([*argv, "--index", str(stopped)]) == 1
        assert "a first build stopped before it finished" in capsys.readouterr().err
    photos = tmp_path / "my photos"                          # the gallery given where its index belongs
    (photos / "dogs").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(photos / "dogs" / "a.jpg")
    assert main(["info", "--index", str(photos)]) == 1
    assert capsys.readouterr().err == (f"indexer info: error: {photos}: a folder of images, not an index directory: "
                                       f"index it first with `python -m indexer build '{photos}' --out "
                                       "'indexes/my photos'`, and give 'indexes/my photos' as the index\n")


# ---------------------------------------------------------------------------- one input check
def test_every_build_entry_refuses_bad_input_with_the_same_line(tmp_path: Path) -> None:
    """build, --ray (before Ray starts), merge and the in-memory build share one check."""
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images")
    for entry in (lambda: build_index(empty, tmp_path / "o"), lambda: build_with_ray(empty, tmp_path / "o")):
        with pytest.raises(IndexerError, match="empty gallery") as e:
            entry()
        listed = str(e.value).split("(no ", 1)[1].removesuffix(" files)").split("/")
        assert sorted(listed) == sorted(IMAGE_SUFFIXES)              # .tif included
    g = tmp_path / "g"
    g.mkdir()
    (g / "a.tif").write_bytes(b"")
    x = np.eye(4, dtype=np.float32)
    for entry in (lambda: build_index(g, tmp_path / "o", target_recall=1.5),
                  lambda: build_with_ray(g, tmp_path / "o", target_recall=1.5),
                  lambda: merge_shards([], tmp_path / "o", target_recall=1.5),
                  lambda: selection.build(np.arange(4), x, target_recall=1.5)):
        with pytest.raises(IndexerError, match=r"^target recall 1.5: expected 0 < target <= 1$"):
            entry()
    for entry in (lambda: build_index(g, tmp_path / "o", max_memory="lots"),
                  lambda: build_with_ray(g, tmp_path / "o", max_memory="lots"),
                  lambda: merge_shards([], tmp_path / "o", max_memory="lots")):
        with pytest.raises(IndexerError, match="memory size 'lots'"):
            entry()
    assert not (tmp_path / "o").exists()


def test_ray_build_is_a_library() -> None:
    """Its command line (flags, summary line) is the indexer CLI's; the library neither parses
    arguments nor prints (progress goes through tqdm)."""
    tree = ast.parse((REPO / "indexer" / "build" / "ray_build.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    imports = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert "print" not in names and "argparse" not in imports


# ---------------------------------------------------------------------------- --max-memory
def test_a_candidate_that_cannot_fit_the_budget_is_never_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """12k x 32 vectors need 1.5 MiB as floats: under a 700 KiB budget only 8-bit (or smaller)
    codes can fit, so Flat, IVF-Flat, SQ8 + exact re-ranking, PQ + exact re-ranking and HNSW are
    refused from their factory strings alone and never trained; the table still lists them."""
    n, dim, budget = 12_000, 32, 700 * 1024
    x = np.random.default_rng(0).normal(size=(n, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    trained: list[str] = []
    real_train = fx.train

    def counting_train(spec: fx.IndexSpec, *a, **kw):
        trained.append(spec.index_type)
        return real_train(spec, *a, **kw)

    monkeypatch.setattr(fx, "train", counting_train)
    index, m = selection.build(np.arange(n), x, flat_threshold=5_000, target_recall=0.5,
                               max_memory=budget, device="cpu")
    table = {r["index_type"]: r for r in m["candidates"]}
    never = {"flat", "ivf", "sq8rf", "pqfsrf", "hnsw"}
    assert never <= table.keys() and not never & set(trained), trained
    assert {"sq8", "pqfsr8"} <= set(trained)
    assert all(not table[t]["fits_memory"] and table[t]["memory_bytes"] > budget for t in never)
    assert m["index_type"] in ("sq8", "pqfsr8") and selection.serialized_bytes(index) <= budget


# ---------------------------------------------------------------------------- one options value
def test_build_options_are_checked_once_and_passed_through(tmp_path: Path, omniglot_root: Path,
                                                           small_onnx: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build's options are one value, checked when made (once per build), and the one
    selection.build receives is that same value; the old keyword spellings still work."""
    from indexer.ann.options import BuildOptions
    from indexer_testlib import copy_characters

    copy_characters(omniglot_root, tmp_path / "g", 2, per_char=6)
    checks, seen = [], []
    real_check, real_build = BuildOptions.__post_init__, selection.build
    monkeypatch.setattr(BuildOptions, "__post_init__", lambda self: checks.append(self) or real_check(self))
    monkeypatch.setattr(selection, "build", lambda ids, x, o, **kw: seen.append(o) or real_build(ids, x, o, **kw))
    m = build_index(tmp_path / "g", tmp_path / "o", small_onnx, progress=False, index_type="ivf",
                    target_recall=0.9, max_memory="1M")       # max_memory: index_memory's old name
    assert len(checks) == 1 and seen == [checks[0]] and seen[0] is checks[0]
    assert (m.index_type, m.target_recall, m.max_memory) == ("ivf", 0.9, 2 ** 20) and m.count == 12


def test_cli_usage_errors_exit_2_and_the_build_budget_has_its_own_name(capsys: pytest.CaptureFixture,
                                                                        tmp_path: Path) -> None:
    """The docstring's promise: 2 for bad usage (a count or a size that does not parse, flags
    that do not fit together), 1 for bad input, each with one error line naming the command."""
    for argv in (["build", str(tmp_path), "--batch-size", "0"], ["search", "x.png", "-k", "0"],
                 ["build", str(tmp_path), "--index-memory", "lots"],
                 ["eval", "--queries", str(tmp_path), "--max-queries", "5"]):
        try:
            code = main(argv)           # options that parse but do not fit: run_main returns 2
        except SystemExit as e:         # argparse's own usage errors exit 2 themselves
            code = e.code
        assert code == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("usage: ") and err.strip().splitlines()[-1].count("error: ") == 1, err
    assert main(["info", "--index", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"indexer info: error: {tmp_path / 'none'}: not an index directory (no index here: "
                   "missing manifest.json); build one with `python -m indexer build`"], err
    help_text = subprocess.run([sys.executable, "-m", "indexer", "merge", "--help"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout
    assert "--index-memory SIZE, --max-memory SIZE" in help_text and "deprecated" in help_text
