"""File names the index cannot hold as text (issue 39, FAIL 6): a name that is not valid UTF-8
and a path the OS refuses (past PATH_MAX) are skipped and named in report.jsonl; the rest of the
gallery is indexed and the command exits 0 (was: exit 1 naming no file, and a silent drop)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from indexer_testlib import run_cli


def _deep_file(root: Path, src: Path, min_len: int = 4200) -> int:
    """Copy ``src`` as ``y.png`` under folders nested past ``min_len`` bytes of path (made
    through directory descriptors: no single path that long can be passed to the OS)."""
    data = src.read_bytes()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    total = len(os.fsencode(root))
    try:
        while total < min_len:
            name = "d" * 200
            os.mkdir(name, dir_fd=fd)
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd, total = nfd, total + 201
        out = os.open("y.png", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(out, data)
        os.close(out)
    finally:
        os.close(fd)
    return total


def _report(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "report.jsonl").read_text(encoding="utf-8").splitlines()]


def test_names_not_utf8_and_overlong_paths_are_reported_not_fatal(omniglot_paths: list[Path],
                                                                   small_onnx: Path, tmp_path: Path) -> None:
    g = tmp_path / "g"
    (g / "a").mkdir(parents=True)
    for i, src in enumerate(omniglot_paths[:4]):
        shutil.copy(src, g / "a" / f"x{i}.png")
    shutil.copy(omniglot_paths[4], os.fsencode(g / "a") + b"/caf\xe9.png")       # Latin-1 name
    (g / "b").mkdir()
    _deep_file(g / "b", omniglot_paths[5])
    out = tmp_path / "idx"
    p = run_cli("build", g, "--model", small_onnx, "--out", out, "--quiet", check=False)
    assert p.returncode == 0, p.stderr
    assert json.loads((out / "manifest.json").read_text())["count"] == 4
    report = _report(out)
    latin = [r for r in report if "not valid UTF-8" in r["reason"]]
    assert len(latin) == 1 and r"b'caf\xe9.png'" in latin[0]["reason"], report
    assert latin[0]["path"] == "a/caf\\xe9.png"
    deep = [r for r in report if "File name too long" in r["reason"]]
    assert len(deep) == 1 and deep[0]["path"].startswith("b/ddd"), report

    # add: a folder whose own name is not UTF-8 is named once, with nothing under it indexed
    extra = tmp_path / "extra"
    bad_dir = os.fsencode(extra) + b"/\xff\xfeclass"
    os.makedirs(bad_dir)
    shutil.copy(omniglot_paths[6], bad_dir + b"/z.png")
    (extra / "ok").mkdir()
    shutil.copy(omniglot_paths[7], extra / "ok" / "z.png")
    p = run_cli("add", "--index", out, extra, "--quiet", check=False)
    assert p.returncode == 0, p.stderr
    assert f"1 skipped (reasons in {out / 'report.jsonl'}); 1 embedded" in p.stdout, p.stdout
    assert json.loads((out / "manifest.json").read_text())["count"] == 5
    report = _report(out)
    assert any(r"b'\xff\xfeclass'" in r["reason"] for r in report), report
    info = run_cli("info", "--index", out, check=False)
    assert info.returncode == 0, info.stderr
