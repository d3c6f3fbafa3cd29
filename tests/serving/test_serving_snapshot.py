"""One request reads one index state (issue 31): a reload that lands between the embedding and
the search of a request does not reach that request. Real index, a real `indexer add` in a
subprocess, the real watcher's reload, real HTTP against the API served by uvicorn on 127.0.0.1."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from serving_testlib import DEMO_CLASSES

REPO = Path(__file__).resolve().parents[2]


class AddAfterEmbedding:
    """An Index's embedder that, right after embedding a request's query, runs `indexer add` on
    the served directory and waits until the searcher serves the new state: the swap lands
    between the request's embed step and its search step (once; the reopened Index shares it)."""

    def __init__(self, inner: Any, searcher: Any, directory: Path, folder: Path) -> None:
        self.inner, self.searcher, self.directory, self.folder = inner, searcher, directory, folder
        self.fired = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def embed(self, images: list) -> Any:
        out = self.inner.embed(images)
        if not self.fired:
            self.fired = True
            old = self.searcher.indexes["live"]
            subprocess.run([sys.executable, "-m", "indexer", "add", str(self.folder), "--index",
                            str(self.directory), "--quiet"], check=True, capture_output=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
            deadline = time.monotonic() + 120
            while self.searcher.indexes["live"] is old:     # the watcher reopens it in its thread
                assert time.monotonic() < deadline, "the watcher never picked up the add"
                self.searcher.index("live")
                time.sleep(0.05)
        return out


@pytest.fixture
def served(tmp_path, demo_dirs, small_onnx, free_port):
    """(url, searcher, index dir, folder to add): an index of 2 demo classes served over HTTP."""
    import uvicorn
    from fastapi import FastAPI

    from indexer import build_index
    from serving import Searcher
    from serving.api import add_api_routes

    gallery, more = tmp_path / "gallery", tmp_path / "more"
    for dst, classes in ((gallery, DEMO_CLASSES[:2]), (more, DEMO_CLASSES[2:4])):
        for c in classes:
            shutil.copytree(demo_dirs[0] / c, dst / c)
    out = tmp_path / "idx"
    build_index(gallery, out, model=small_onnx, progress=False)
    searcher = Searcher.open([out], names=["live"])
    searcher.watcher.interval = 0.0
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(add_api_routes(FastAPI(), searcher), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", searcher, out, more
    finally:
        server.should_exit = True
        thread.join(30)


def test_a_reload_between_embed_and_search_does_not_mix_two_states(served):
    url, searcher, directory, more = served
    idx = searcher.index("live")
    before, n_before = {int(i) for i in idx.store.ids()}, len(idx)
    photo = sorted((more / DEMO_CLASSES[2]).iterdir())[0]       # only the added state holds it
    hook = idx._embedder = AddAfterEmbedding(idx.embedder, searcher, directory, more)
    k = n_before + 5
    r = httpx.post(f"{url}/api/search", data={"k": str(k)}, timeout=300,
                   files={"image": (photo.name, photo.read_bytes(), "image/png")})
    assert r.status_code == 200, r.text
    assert hook.fired and len(searcher.index("live")) > n_before     # the swap landed mid-request
    body = r.json()
    # wholly the state the request started on: its ids, its count, its DBA setting
    assert len(body["results"]) == n_before and {x["id"] for x in body["results"]} == before
    assert body["dba"] is idx.has_dba
    # the next request reads the new state: the added photo is its own top hit, k results
    r = httpx.post(f"{url}/api/search", data={"k": str(k)}, timeout=300,
                   files={"image": (photo.name, photo.read_bytes(), "image/png")})
    top = r.json()["results"]
    assert len(top) == k and top[0]["path"].endswith(photo.name) and top[0]["score"] > 0.999


def test_a_ui_search_a_probe_and_an_api_search_each_resolve_each_index_once(searcher, monkeypatch):
    """One request, one state (issue 40): the page's search with a gallery pick, its probes and
    an API search look each index up once (``Searcher.index``, where a reload can land), and
    pass that snapshot down: to the query, the search, the thumbnails and the drawn query."""
    from collections import Counter

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from serving.api import add_api_routes
    from serving.ui import build_ui

    demo = build_ui(searcher)
    handler = {f.api_name: f.fn for f in demo.fns.values() if f.api_name}
    client = TestClient(add_api_routes(FastAPI(), searcher))
    pick = str(searcher.index().ids_for_label(searcher.index().labels()[0])[0])
    real, seen = searcher.index, Counter()

    def counted(name=None):
        seen[name or searcher.default] += 1
        return real(name)

    monkeypatch.setattr(searcher, "index", counted)
    status = handler["search_dba"](None, pick, None, 5, True)[0]
    assert status.startswith("Query **") and "⚠" not in status, status
    assert seen == Counter({n: 1 for n in searcher.names}), seen
    seen.clear()
    status = handler["probes"](None, pick, None, 4, 2, "0.5, 2", 0, 0.5, "0.5", None, 0)[0]
    assert status.startswith("Query **") and "⚠" not in status, status
    assert seen == Counter({n: 1 for n in searcher.names}), seen
    seen.clear()
    r = client.post("/api/search", data={"id": pick, "k": "5", "index": searcher.names[1]})
    assert r.status_code == 200 and len(r.json()["results"]) == 5, r.text
    assert seen == Counter({searcher.names[1]: 1}), seen
