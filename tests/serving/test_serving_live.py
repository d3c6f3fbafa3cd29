"""A served index changes under the app: `python -m indexer add` runs while a client searches,
and a damaged state on disk shows in /api/health. Real app.py, real LMDB, real subprocesses.

The served copy of the small index is rewritten into a store whose LMDB map is just above its
data (as a store that never had to grow), and the add brings ~20 MB of new photos: the map must
grow while the app reads, which is what used to turn every request into a 500.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image

from serving_testlib import labelled_folder

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _compact_copy(src: Path, dst: Path) -> None:
    """Copy an index directory, rewriting its store with a small initial map (it doubles as it
    fills, so the recorded map ends up just above the data)."""
    from indexer import GalleryStore

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("store.lmdb"))
    model_hash = json.loads((src / "manifest.json").read_text())["model"]["hash"]
    with GalleryStore(src / "store.lmdb") as old, \
            GalleryStore(dst / "store.lmdb", readonly=False, map_size=256 * 1024) as new:
        new.copy_from(old, model_hash)


@pytest.fixture(scope="module")
def live(small_index, photo_paths, tmp_path_factory, free_port, start_app):
    """(url, index dir, folder of new photos) for a server on a private copy of the small index."""
    root = tmp_path_factory.mktemp("live")
    idx = root / "idx"
    _compact_copy(small_index, idx)
    more = root / "more"
    for i, p in enumerate(photo_paths[:8]):        # big uncompressed PNGs: ~3 MB each
        d = more / f"new{i}"
        d.mkdir(parents=True)
        Image.open(p).convert("RGB").resize((1024, 1024)).save(d / f"{p.stem}.png", compress_level=0)
    with start_app(["--index", idx, "--name", "live", "--max-upload-mb", 5], root, free_port()) as (url, _):
        yield url, idx, more


def _hammer(url: str, query: bytes, gid: int, stop: threading.Event, log: list) -> None:
    """Every endpoint in turn until told to stop; records (endpoint, status, text) of each call."""
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            for name, call in (
                    ("search upload", lambda: c.post(f"{url}/api/search", data={"k": "5"},
                                                     files={"image": ("q.png", query, "image/png")})),
                    ("search id", lambda: c.post(f"{url}/api/search", data={"k": "5", "id": str(gid)})),
                    ("thumb", lambda: c.get(f"{url}/api/thumb/live/{gid}")),
                    ("indexes", lambda: c.get(f"{url}/api/indexes")),
                    ("health", lambda: c.get(f"{url}/api/health"))):
                try:
                    r = call()
                    log.append((name, r.status_code, r.text[:300]))
                except httpx.HTTPError as e:
                    log.append((name, 0, repr(e)))


def test_add_while_serving_no_errors_then_new_images_are_found(live, demo_dirs):
    url, idx, more = live
    before = httpx.get(f"{url}/api/indexes", timeout=30).json()[0]["size"]
    qpath, _ = labelled_folder(demo_dirs[1])[0]
    gid = httpx.post(f"{url}/api/search", data={"k": "1"}, timeout=60,
                     files={"image": ("q.png", qpath.read_bytes())}).json()["results"][0]["id"]
    log: list = []
    stop = threading.Event()
    client = threading.Thread(target=_hammer, args=(url, qpath.read_bytes(), gid, stop, log), daemon=True)
    client.start()
    try:
        size0 = (idx / "store.lmdb" / "data.mdb").stat().st_size
        during = len(log)
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        add = subprocess.run([sys.executable, "-m", "indexer", "add", str(more), "--index", str(idx),
                              "--prefix", "added/", "--quiet"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=300)
        assert add.returncode == 0, add.stderr
        during = len(log) - during
        deadline = time.monotonic() + 60
        while True:
            r = httpx.get(f"{url}/api/indexes", timeout=30)
            assert r.status_code == 200, f"/api/indexes after the add: {r.status_code} {r.text[:300]}"
            if r.json()[0]["size"] == before + 8:
                break
            assert time.monotonic() < deadline, "the app never picked up the added images"
            time.sleep(0.5)
        time.sleep(1.0)                                     # a few requests on the new state too
    finally:
        stop.set()
        client.join(120)
    assert (idx / "store.lmdb" / "data.mdb").stat().st_size > size0 + 16 * 1024 * 1024   # the map grew
    bad = [x for x in log if x[1] != 200]
    assert not bad, f"{len(bad)} of {len(log)} requests failed, first: {bad[:3]}"
    assert during >= 5, f"only {during} requests ran during the add"
    # the added photos are searchable by their stored paths, and find themselves' neighbours
    r = httpx.post(f"{url}/api/search", data={"k": "3", "path": "added/new0/" + next((more / "new0").iterdir()).name},
                   timeout=60)
    assert r.status_code == 200 and len(r.json()["results"]) == 3, r.text


def test_health_reports_a_damaged_directory_and_recovers(live):
    url, idx, _ = live
    assert httpx.get(f"{url}/api/health", timeout=30).status_code == 200
    gid = _first_result(url)
    faiss_file, manifest = idx / "index.faiss", idx / "manifest.json"
    good_index, good_manifest = faiss_file.read_bytes(), manifest.read_text()
    try:
        faiss_file.write_bytes(bytes(b ^ 0xFF for b in good_index[:4096]) + good_index[4096:])
        tmp = manifest.with_suffix(".tmp")
        tmp.write_text(good_manifest)
        os.replace(tmp, manifest)                      # a writer's last step: a new manifest
        deadline = time.monotonic() + 60
        while (h := httpx.get(f"{url}/api/health", timeout=30)).status_code == 200:
            assert time.monotonic() < deadline, "health never noticed the damaged index.faiss"
            time.sleep(0.5)
        assert h.status_code == 503 and "index.faiss" in h.json()["error"], h.text
        # meanwhile the previous state keeps answering
        r = httpx.post(f"{url}/api/search", data={"k": "3", "id": str(gid)}, timeout=60)
        assert r.status_code == 200 and len(r.json()["results"]) == 3, r.text
    finally:
        faiss_file.write_bytes(good_index)
        tmp = manifest.with_suffix(".tmp")
        tmp.write_text(good_manifest)
        os.replace(tmp, manifest)
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/api/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "health did not recover after the repair"
        time.sleep(0.5)


def _first_result(url: str) -> int:
    """The id of some gallery image (the nearest neighbour of a plain brown square)."""
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (120, 80, 40)).save(buf, format="PNG")
    r = httpx.post(f"{url}/api/search", data={"k": "1"}, files={"image": ("q.png", buf.getvalue())}, timeout=60)
    return r.json()["results"][0]["id"]
