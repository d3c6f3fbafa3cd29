"""A damaged ``neighbours.npz`` (DBA) is seen by ``indexer info`` (and ``--deep``) and by the
server's ``/api/health``, as ``search`` and ``app.py`` see it at open (issue 39, FAIL 3; before:
info exit 0 in 7 of 7 cases, health 200 while the next restart failed). One check for all:
``indexer.ann.neighbours.check``. Real index built by the CLI, damage made on disk."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Callable

import httpx
import numpy as np
import pytest

from indexer import check_counts
from indexer.errors import IndexerError
from indexer_testlib import copy_characters, run_cli, serve_app

NB = "neighbours.npz"


class _Payload:
    """Unpickling this creates a file: the test sees whether anything unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def dba_index(tmp_path_factory: pytest.TempPathFactory, omniglot_root: Path, small_onnx: Path) -> Path:
    g = tmp_path_factory.mktemp("dba-g")
    copy_characters(omniglot_root, g, 3, per_char=6)
    out = tmp_path_factory.mktemp("dba-idx") / "idx"
    run_cli("build", g, "--model", small_onnx, "--out", out, "--dba", "--quiet")
    return out


def _manifest(idx: Path) -> dict:
    return json.loads((idx / "manifest.json").read_text())


def _set_manifest(idx: Path, **nb: object) -> None:
    m = _manifest(idx)
    m["neighbours"].update(nb)
    (idx / "manifest.json").write_text(json.dumps(m))


def _rewrite(idx: Path, **arrays: np.ndarray) -> None:
    """Replace arrays of neighbours.npz and record the new file's size and sha256 in the
    manifest, so that only the file's content (not its checksum) can give it away."""
    with np.load(idx / NB) as z:
        a = {k: z[k] for k in z.files}
    a.update(arrays)
    with open(idx / NB, "wb") as f:
        np.savez(f, **a)
    data = (idx / NB).read_bytes()
    _set_manifest(idx, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def _truncate(idx: Path) -> None:
    data = (idx / NB).read_bytes()
    (idx / NB).write_bytes(data[:len(data) // 3])


def _garble(idx: Path) -> None:
    data = bytearray((idx / NB).read_bytes())
    for i in range(0, len(data), 97):
        data[i] ^= 0x5A
    (idx / NB).write_bytes(bytes(data))


def _wrong_shapes(idx: Path) -> None:
    with np.load(idx / NB) as z:
        aug = z["aug"]
    _rewrite(idx, aug=aug[:, :-1].copy())


def _pickle(idx: Path) -> None:
    marker = idx.parent / "unpickled"
    _rewrite(idx, aug=np.array([_Payload(marker)], dtype=object))


CASES: dict[str, Callable[[Path], None]] = {
    "deleted": lambda idx: (idx / NB).unlink(),
    "truncated": _truncate,
    "garbled": _garble,
    "wrong shapes": _wrong_shapes,
    "pickle inside": _pickle,
    "wrong k in manifest": lambda idx: _set_manifest(idx, k=_manifest(idx)["neighbours"]["k"] + 1),
    "wrong alpha in manifest": lambda idx: _set_manifest(idx, alpha=_manifest(idx)["neighbours"]["alpha"] + 1.5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_info_and_health_check_see_a_damaged_neighbour_file(case: str, dba_index: Path, tmp_path: Path) -> None:
    idx = tmp_path / "idx"
    shutil.copytree(dba_index, idx)
    assert check_counts(idx).ok                     # intact: the check passes
    CASES[case](idx)
    for deep in ([], ["--deep"]):
        p = run_cli("info", "--index", idx, *deep, check=False)
        lines = p.stderr.strip().splitlines()
        assert p.returncode != 0 and len(lines) == 1 and NB in lines[0], (case, deep, p.stdout, p.stderr)
    with pytest.raises(IndexerError, match=NB):     # what /api/health runs (serving.searcher)
        check_counts(idx)
    assert not (tmp_path / "unpickled").exists()


def test_running_app_health_says_503_naming_the_file(dba_index: Path, tmp_path: Path, free_port) -> None:
    idx = tmp_path / "idx"
    shutil.copytree(dba_index, idx)
    with serve_app(["--index", idx], tmp_path, free_port()) as (url, _):
        assert httpx.get(f"{url}/api/health", timeout=30).status_code == 200
        _garble(idx)                                # the manifest unchanged: no reload
        r = httpx.get(f"{url}/api/health", timeout=30)
        assert r.status_code == 503 and NB in r.text, r.text
        (idx / NB).unlink()
        r = httpx.get(f"{url}/api/health", timeout=30)
        assert r.status_code == 503 and NB in r.text and "missing" in r.text, r.text
