"""Kill a real build process mid-way (SIGKILL, by PID), rerun it, and check nothing is lost or doubled."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from indexer_testlib import REPO, copy_characters, run_cli
from indexer import GalleryStore, Index
from indexer.directory.index_dir import STORE_DIR


def _committed(store_dir: Path) -> int:
    if not (store_dir / "data.mdb").exists():
        return 0
    try:
        with GalleryStore(store_dir) as st:
            return len(st)
    except Exception:  # noqa: BLE001 - sub-databases not created yet
        return 0


def test_killed_build_resumes_without_duplicates(tmp_path: Path, omniglot_root: Path, small_onnx: Path) -> None:
    gallery = tmp_path / "g"
    files = copy_characters(omniglot_root, gallery, 80)
    unique = len({hashlib.sha256(f.read_bytes()).hexdigest() for f in files})
    out = tmp_path / "idx"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "indexer", "build", str(gallery), "--model", str(small_onnx),
           "--out", str(out), "--quiet", "--workers", "1", "--batch-size", "8", "--no-int8", "--no-dba"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while _committed(out / STORE_DIR) == 0 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "build finished before it could be killed: " + proc.stderr.read().decode()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "manifest.json").exists()
    done = _committed(out / STORE_DIR)
    assert 0 < done < len(files)

    # what survived the kill is whole: every entry has its bytes, its path and its embedding
    from embedder.hashing import file_sha256

    model_hash = file_sha256(small_onnx)
    with GalleryStore(out / STORE_DIR) as st:
        assert st.missing_embeddings(model_hash) == []      # every stored image is embedded
        for i in st.ids():
            m = st.get_meta(int(i))
            assert hashlib.sha256(st.get_bytes(int(i))).hexdigest() == m["sha256"]
            assert st.id_for_path(m["path"]) == int(i)

    res = run_cli("build", gallery, "--model", small_onnx, "--out", out, "--quiet", "--no-int8", "--no-dba")
    m = json.loads((out / "manifest.json").read_text())
    assert m["count"] == unique == len(files)
    assert m["ingest"]["unchanged"] == done and m["ingest"]["new"] == len(files) - done, res.stdout
    idx = Index.open(out)
    with GalleryStore(out / STORE_DIR) as st:
        assert len(st) == len(files) and sorted(st.ids()) == sorted(set(st.ids()))
        ids, x = st.all_embeddings(model_hash)
        assert len(ids) == len(files)
    # every image still finds itself
    probe = files[:: len(files) // 12]
    for f, hits in zip(probe, idx.search(probe, 1)):
        assert hits[0].path == f.relative_to(gallery).as_posix()
    assert np.isfinite(x).all()
