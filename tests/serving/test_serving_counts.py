"""/api/health's count check (issue 19): a served index whose store holds images that index.faiss
lacks is reported (the route answers 503 with this text), naming `indexer repair`; a writer at
work is not a problem; after the repair the index is healthy again. Real Searcher, LMDB, faiss;
the writes run in other processes, as they do next to a real server."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# What a writer dying between its store commit and index.faiss leaves: one stored, embedded
# image that faiss does not hold.
_DAMAGE = """
import hashlib, sys
from indexer import GalleryStore
from indexer.store.gallery import NewItem
with GalleryStore(sys.argv[1] + "/store.lmdb", readonly=False) as st:
    model = st.models()[0]
    first = int(st.ids()[0])
    data = st.get_bytes(first) + b"extra"
    st.put_items([NewItem("x/extra.png", "x", data, hashlib.sha256(data).hexdigest(), 1, 1)],
                 st.get_embeddings(model, [first]), model)
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr
    return p


def test_health_reports_count_mismatch_and_recovers(small_index: Path, tmp_path: Path):
    from indexer import writer_lock
    from serving import Searcher

    d = tmp_path / "idx"
    shutil.copytree(small_index, d)
    s = Searcher.open([d], names=["small"])
    assert s.health() == {}
    _run("-c", _DAMAGE, str(d))
    problem = s.health()["small"]
    assert "counts differ" in problem and "1 stored images can never be found" in problem, problem
    assert f"python -m indexer repair --index {d}" in problem
    with writer_lock(d, "test writer"):            # mid-write the counts legitimately differ
        assert s.health() == {}
    assert "added 1" in _run("-m", "indexer", "repair", "--index", str(d), "--quiet").stdout
    assert s.health() == {}
