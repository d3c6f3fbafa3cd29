"""Helpers the indexer tests import: the repository root, a CLI runner, Omniglot copies.

A module of its own, not conftest.py: with several test folders in one run, `from conftest
import ...` would find whichever conftest module was imported first."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from benchmarks.inputs.lmdb_damage import garbage_inside  # noqa: F401 - shared with the reliability probes

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: object, check: bool = True, timeout: float = 300,
            env: dict[str, str] | None = None, fresh: bool = False) -> subprocess.CompletedProcess:
    """``python -m indexer ...``: its ``main(argv)`` in this process, stdout and stderr captured,
    the exit code as ``returncode``; a real subprocess when ``fresh``, when ``env`` changes the
    environment, or for ``--ray`` (Ray's driver state and its give-up path, ``os._exit``, belong
    to a process of their own). In-process saves ~0.7 CPU-s of imports a call (138 call sites);
    the code run is the same ``main`` that ``python -m indexer`` calls, and
    tests/indexer/test_indexer_surface.py keeps the real entry point (exit codes, --help) checked."""
    from inprocess import run_main, run_module

    from indexer.__main__ import main

    argv = [str(a) for a in args]
    if fresh or env or any(a == "--ray" or a.startswith("--ray=") for a in argv):
        p = run_module("indexer", argv, timeout=timeout, env=env)
    else:
        p = run_main(main, "indexer", argv)
    if check and p.returncode != 0:
        raise AssertionError(f"indexer {argv} exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def copy_characters(omniglot_root: Path, dst: Path, n_chars: int, per_char: int = 20,
                    skip_chars: int = 0) -> list[Path]:
    """Copy ``n_chars`` Omniglot characters (Alphabet/characterNN/*.png) into ``dst``."""
    base = omniglot_root / "images_background"
    chars = [c for a in sorted(base.iterdir()) for c in sorted(a.iterdir())][skip_chars:skip_chars + n_chars]
    out = []
    for c in chars:
        d = dst / c.parent.name / c.name
        d.mkdir(parents=True, exist_ok=True)
        for f in sorted(c.glob("*.png"))[:per_char]:
            shutil.copy2(f, d / f.name)
            out.append(d / f.name)
    return out


@contextmanager
def serve_app(args: list, log_dir: Path, port: int, timeout: float = 180) -> Iterator[tuple[str, subprocess.Popen]]:
    """A real ``python app.py ARGS`` on 127.0.0.1:PORT (tests/serving has its own, in its
    conftest, which this folder cannot import); stopped by PID. Yields (base URL, process)."""
    import httpx

    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO), "GRADIO_TEMP_DIR": str(log_dir / "gradio-tmp")}
    log = log_dir / "server.log"
    with open(log, "w") as lf:
        proc = subprocess.Popen([sys.executable, str(REPO / "app.py"), *map(str, args), "--host", "127.0.0.1",
                                 "--port", str(port)], cwd=REPO, env=env, stdout=lf, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"app.py exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/api/health", timeout=2).status_code in (200, 503):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"app.py did not come up in {timeout:.0f} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()                # by PID: only the server started here
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


# The Ray build tests (test_ray.py, test_ray_cluster.py): one gallery shape and build flags, and
# one notion of "the same index" for a Ray build against the one-process build.
RAY_FLAGS = ["--quiet", "--flat-threshold", "100", "--no-int8", "--no-dba"]   # IVF: where merging must match
RAY_CHARS = 30                                         # 600 images, ~300 per shard (one commit: 256)


def assert_same_index(merged: Any, single: Any, gallery: Path, dba: bool | None = None) -> None:
    """Same ids, same vectors, same search answers (by vector and by image file; ``dba`` as
    ``Index.search``)."""
    import numpy as np

    from indexer.ann.faiss_index import index_ids

    ms, mm = single.manifest, merged.manifest
    assert mm["index_type"] == ms["index_type"] == "ivf"
    for key in ("count", "nlist", "nprobe", "recall_at_10", "dim"):
        assert mm[key] == ms[key], key
    np.testing.assert_array_equal(index_ids(merged.faiss.cpu_index), index_ids(single.faiss.cpu_index))
    ids, x = single.store.all_embeddings(single.model_hash)
    ids2, x2 = merged.store.all_embeddings(merged.model_hash)
    order, order2 = np.argsort(ids), np.argsort(ids2)
    np.testing.assert_array_equal(ids2[order2], ids[order])
    np.testing.assert_allclose(x2[order2], x[order], atol=1e-6)
    from knn_asserts import assert_knn, vector_scorer

    # ids up to float ties: the same vector sits elsewhere in the merged lists, where another
    # CPU's SIMD kernel may round its score another way, and look-alike glyphs tie within 1e-8
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    s1, i1 = single.search_embeddings(x, 10, dba=dba)
    s2, i2 = merged.search_embeddings(x, 10, dba=dba)
    assert_knn(i2, i1, vector_scorer(xn, xn, ids), ordered=True, got_scores=s2, score_atol=1e-5)
    np.testing.assert_allclose(s2, s1, atol=1e-5)
    queries = sorted(gallery.rglob("*.png"))[::50]          # image files, through the embedder
    row = {int(j): r for r, j in enumerate(ids)}
    qx = xn[[row[single.store.id_for_path(q.relative_to(gallery).as_posix())] for q in queries]]
    got, want = merged.search(queries, 5, dba=dba), single.search(queries, 5, dba=dba)
    assert_knn([[h.id for h in a] for a in got], [[h.id for h in b] for b in want],
               vector_scorer(qx, xn, ids), ordered=True)
    for h in (h for a in got for h in a):                   # each hit's path and label its own
        m = single.meta(h.id)
        assert (h.path, h.label) == (m["path"], m.get("label")), (h, m)
