"""The audit a server shows (issue 42 item 2), on the demo gallery: computed once per index
version and kept beside the index (a second request reads it, an `indexer add` makes the next
one recompute), served by `GET /api/audit/<index>` behind the login, 404 for an unknown index."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from serving import Searcher

REPO = Path(__file__).resolve().parents[2]


def test_audit_once_per_index_version_and_again_after_add(tmp_path, small_index, demo_dirs):
    idx = tmp_path / "small"
    shutil.copytree(small_index, idx)
    s = Searcher.open([idx], names=["s"])
    first = s.audit("s")
    cache = idx / "audit.json"
    from indexer.audit.served import FORMAT      # a cache of an older audit's lists is computed again

    assert first["version"] == f"{FORMAT}:" + hashlib.sha256((idx / "manifest.json").read_bytes()).hexdigest()
    assert first["summary"]["images"] == 40 and "index" not in first["summary"]     # no server path
    assert {"duplicates", "mislabelled", "outliers", "confused"} <= set(first)
    assert all(x["id"] in s.index("s") for x in first["outliers"])
    stamp = cache.stat().st_mtime_ns
    assert s.audit("s") == first and cache.stat().st_mtime_ns == stamp      # read, not recomputed
    more = tmp_path / "more"
    shutil.copytree(demo_dirs[1], more)                                    # the 16 held-out views
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "indexer", "add", str(more), "--index", str(idx), "--quiet"],
                   check=True, env=env, capture_output=True, timeout=300)
    after = Searcher.open([idx], names=["s"]).audit("s")
    assert after["version"] != first["version"] and after["summary"]["images"] == 56
    assert cache.stat().st_mtime_ns != stamp


def test_api_audit_needs_a_login_and_names_an_index(server):
    url, auth = server
    assert httpx.get(f"{url}/api/audit/pretrained", timeout=30).status_code == 401
    r = httpx.get(f"{url}/api/audit/pretrained", auth=auth, timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["index"] == "pretrained" and body["summary"]["images"] == 40
    assert len(body["outliers"]) > 0 and all({"id", "label", "score"} <= set(x) for x in body["outliers"])
    r = httpx.get(f"{url}/api/audit/nope", auth=auth, timeout=30)
    assert r.status_code == 404 and "nope" in r.json()["error"]
