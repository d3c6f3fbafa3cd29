"""Issue 19: a store file truncated or replaced under the running app. Reading a page of an
mmap past the end of a truncated file is SIGBUS, which used to kill the server at the next
request (even /api/health). Now the request is refused with 503 naming the file, the process
lives, the other index goes on answering, and a rebuilt store is served again. Real app.py,
real LMDB, the real `indexer build` CLI for the rebuild."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from serving_testlib import labelled_folder

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two(pretrained_index, small_index, tmp_path_factory, free_port, start_app):
    """(url, process, dir of 'victim', root) for a server on copies of both indexes."""
    root = tmp_path_factory.mktemp("damage")
    victim, other = root / "victim", root / "other"
    shutil.copytree(pretrained_index, victim, ignore=shutil.ignore_patterns("lock.mdb"))
    shutil.copytree(small_index, other, ignore=shutil.ignore_patterns("lock.mdb"))
    args = ["--index", victim, "--index", other, "--name", "victim", "--name", "other"]
    with start_app(args, root, free_port()) as (url, proc):
        yield url, proc, victim, root


def _search(url: str, image: bytes, index: str) -> httpx.Response:
    return httpx.post(f"{url}/api/search", files={"image": ("q.jpg", image, "image/jpeg")},
                      data={"index": index, "k": "3"}, timeout=60)


def _until(fn, ok, seconds: float = 60):
    r = fn()
    deadline = time.monotonic() + seconds
    while not ok(r) and time.monotonic() < deadline:
        time.sleep(0.3)
        r = fn()
    return r


def test_truncated_store_is_refused_not_fatal_and_recovers_after_rebuild(two, demo_dirs, pretrained_onnx):
    url, proc, victim, root = two
    query = labelled_folder(demo_dirs[1])[0][0].read_bytes()
    assert _search(url, query, "victim").status_code == 200             # served, store mapped
    data = victim / "store.lmdb" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)

    health = httpx.get(f"{url}/api/health", timeout=30)
    assert health.status_code == 503, health.text
    assert "store.lmdb/data.mdb" in health.json()["error"] and "truncated" in health.json()["error"]
    r = _search(url, query, "victim")
    assert r.status_code == 503 and "store.lmdb/data.mdb" in r.json()["error"], r.text
    assert str(victim) not in r.text                                   # named, not located
    assert proc.poll() is None, "the server died"
    assert _search(url, query, "other").status_code == 200             # the other index lives on

    # the operator's repair: rebuild the index directory in place
    shutil.rmtree(victim)
    subprocess.run([sys.executable, "-m", "indexer", "build", str(demo_dirs[0]), "--out", str(victim),
                    "--model", str(pretrained_onnx), "--quiet"], cwd=REPO, check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    health = _until(lambda: httpx.get(f"{url}/api/health", timeout=30), lambda h: h.status_code == 200)
    assert health.status_code == 200, health.text
    r = _until(lambda: _search(url, query, "victim"), lambda r: r.status_code == 200)
    assert r.status_code == 200 and len(r.json()["results"]) == 3
    assert proc.poll() is None


def test_store_replaced_by_garbage_is_refused_then_adopted_when_sound(two, demo_dirs):
    url, proc, victim, root = two
    query = labelled_folder(demo_dirs[1])[0][0].read_bytes()
    assert _until(lambda: _search(url, query, "victim"), lambda r: r.status_code == 200).status_code == 200
    data = victim / "store.lmdb" / "data.mdb"
    good = root / "good.mdb"
    shutil.copy(data, good)
    tmp = data.with_name("data.mdb.new")
    tmp.write_bytes(os.urandom(good.stat().st_size))
    os.replace(tmp, data)                                              # a new inode, not LMDB
    r = _until(lambda: _search(url, query, "victim"), lambda r: r.status_code != 200, seconds=10)
    assert r.status_code == 503 and "store.lmdb/data.mdb" in r.json()["error"], r.text
    assert proc.poll() is None and _search(url, query, "other").status_code == 200
    shutil.copy(good, tmp)
    os.replace(tmp, data)                                              # a sound store again
    r = _until(lambda: _search(url, query, "victim"), lambda r: r.status_code == 200)
    assert r.status_code == 200 and len(r.json()["results"]) == 3
