"""Serving a sharded index across Ray nodes (indexer.ray.fanout) on the run's local 3-node cluster
(``ray.cluster_utils.Cluster``, tests/conftest.py ``ray_cluster``): one actor per shard, each
pinned to its own node; answers equal the in-process search; a node killed under 4 HTTP clients'
load leaves every answer either whole or marked partial (and equal to the search of the surviving
shards), /api/health names the lost shard and the web page's search handler says so in its status
line, and answers are whole again once the node is back; ``indexer add`` while serving is found.

The server is uvicorn in this process (the API routes of ``serving``, real HTTP on 127.0.0.1),
because the test pins each shard's actor to a node it will kill (``RayServing.placement``),
which ``app.py --ray`` does not take; the CLI path (``indexer search --ray``) is run as a
subprocess. Runs only in a private network namespace (``test_ray_netns.py``).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ray_testlib import node_resource, require_private_network

require_private_network("tests/serving/test_ray_serving.py")

ray = pytest.importorskip("ray")

from indexer import Index, IndexerError  # noqa: E402
from indexer.ann import subset  # noqa: E402
from indexer.ray.fanout import RayServing, Router, shard_node  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHARDS = 3
BOUND_S = 3.0                  # the fan-out's bound in these tests
SLACK_S = 30.0                 # a loaded 2-core machine: the request must end, not be quick


def copy_chars(omniglot_root: Path, dst: Path, n: int, skip: int = 0, per_char: int = 20) -> Path:
    base = omniglot_root / "images_background"
    chars = [c for a in sorted(base.iterdir()) for c in sorted(a.iterdir())][skip:skip + n]
    for c in chars:
        d = dst / c.parent.name / c.name
        d.mkdir(parents=True, exist_ok=True)
        for f in sorted(c.glob("*.png"))[:per_char]:
            shutil.copy2(f, d / f.name)
    return dst


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The run's 3-node cluster (tests/conftest.py): shard i's actor pinned to node i (actors
    take no CPU, so the head holds one too); the build's tasks run on the two worker nodes."""
    assert len(ray_cluster.nodes) == SHARDS
    return ray_cluster


@pytest.fixture(scope="module")
def sharded(cluster, tmp_path_factory, omniglot_root, small_onnx) -> Path:
    """`indexer build --ray --sharded` (the library call) of 10 characters in 3 shards: IVF."""
    from indexer.build.ray_build import build_with_ray

    root = tmp_path_factory.mktemp("ray-serving")
    gallery = copy_chars(omniglot_root, root / "gallery", 10)
    out = root / "idx"
    build_with_ray(gallery, out, small_onnx, address=None, shards=SHARDS, sharded=True,
                   progress=False, flat_threshold=100)
    return out


def gallery_ids(idx: Index) -> list[int]:
    """Every id the sharded index's stores hold (first shard first)."""
    return list(dict.fromkeys(int(i) for st in idx.store.stores for i in st.ids()))


def pinned(i: int, shard: Path) -> dict:
    """Shard i's actor on node i only (node 0 is the head: its shard is never lost)."""
    return {"resources": {node_resource(i): 0.01}}


def served(timeout: float = BOUND_S) -> RayServing:
    return RayServing(timeout=timeout, placement=pinned)


def test_ray_answers_equal_the_in_process_search(cluster, sharded, monkeypatch):
    local = Index.open(sharded)
    remote = Index.open(sharded, ray=served())
    assert isinstance(remote.faiss, Router) and local.manifest["index_type"] == "ivf"
    assert len(remote) == len(local)
    # each shard's actor is on its own node
    assert [w["node"] for w in remote.faiss.where()] == [cluster.node_id(i) for i in range(SHARDS)]
    ids = gallery_ids(local)
    x = local.embeddings(ids)
    for k in (1, 5, 10, len(local) + 3):
        s1, i1 = local.search_embeddings(x, k)
        s2, i2, partial, _ = remote.answer(x, k)
        np.testing.assert_array_equal(i2, i1)
        np.testing.assert_array_equal(s2, s1)
        assert partial == ()
    # the searches went over each actor's own authenticated connection (the data plane), not
    # through Ray: one open connection per shard, to the address its node has in Ray
    for link in remote.faiss.links:
        assert link.endpoint[0] == "127.0.0.1" and len(link.idle) == 1
    # concurrent searches share fan-outs (the router batches what queues meanwhile): each still
    # gets its own rows, for its own k
    from concurrent.futures import ThreadPoolExecutor

    def one(j: int) -> tuple:
        kk = (5, 10, 3)[j % 3]
        return (j, kk, *remote.faiss.search(x[j:j + 2], kk))
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(0, 60)))
    for j, kk, d, i, partial in got:
        want_d, want_i, _ = local.faiss.search(x[j:j + 2], kk)
        assert partial == ()
        np.testing.assert_array_equal(i, want_i)
        np.testing.assert_array_equal(d, want_d)
    # gallery queries (the query left out of its own row) and the default soft-affinity actors
    soft = Index.open(sharded, ray=RayServing(timeout=BOUND_S))
    s1, i1 = local.search_embeddings(x[:20], 7, exclude=list(ids[:20]))
    s2, i2 = soft.search_embeddings(x[:20], 7, exclude=list(ids[:20]))
    np.testing.assert_array_equal(i2, i1)
    np.testing.assert_array_equal(s2, s1)
    # a search within two labels: the exact pass reads the stores here; without its budget, the
    # deeper search goes through the fan-out and is filtered
    only = local.labels()[:2]
    for budget in (subset.EXACT_BYTES, 0):
        monkeypatch.setattr(subset, "EXACT_BYTES", budget)
        s1, i1 = local.search_embeddings(x, 5, labels=only)
        s2, i2 = soft.search_embeddings(x, 5, labels=only)
        np.testing.assert_array_equal(i2, i1)
        np.testing.assert_array_equal(s2, s1)
        assert set(i2.ravel().tolist()) <= set(local.label_ids(only).tolist())
    # ... placed on the node that holds each shard (the build's record: shards/ray.json)
    import ray

    held = [shard_node(p.shard) for p in soft.layout.parts]
    assert all(held), held
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    placed = [w["node"] for w in soft.faiss.where()]
    # a node the node-loss test killed and revived has a new id: soft affinity places that
    # shard elsewhere (whatever order the tests run in, every live recorded node is kept)
    assert [p for p, h in zip(placed, held) if h in alive] == [h for h in held if h in alive], (placed, held)
    assert any(h in alive for h in held) or all(p in alive for p in placed)
    soft.faiss.close()


def test_indexer_search_cli_over_ray(cluster, sharded, omniglot_root):
    """`indexer search --ray ADDRESS` joins the cluster and prints what the in-process search does
    (that one run by its ``main`` here: only the Ray runs need a process of their own)."""
    from inprocess import run_main

    from indexer.__main__ import main

    image = next(iter(sorted((sharded.parent / "gallery").rglob("*.png"))))
    args = ["search", str(image), "--index", str(sharded), "-k", "5", "--json"]
    local = run_main(main, "indexer", args)
    over = subprocess.run([sys.executable, "-m", "indexer", *args, "--ray", cluster.address, "--shard-timeout", "10"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert local.returncode == 0 and over.returncode == 0, local.stderr[-2000:] + over.stderr[-2000:]
    assert json.loads(over.stdout) == json.loads(local.stdout)
    # `indexer eval --ray`: the same Recall@k as in one process
    args = ["eval", "--leave-one-out", "--index", str(sharded), "--json"]
    local = run_main(main, "indexer", args)
    over = subprocess.run([sys.executable, "-m", "indexer", *args, "--ray", cluster.address], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert local.returncode == 0 and over.returncode == 0, local.stderr[-2000:] + over.stderr[-2000:]
    assert json.loads(over.stdout)["recall"] == json.loads(local.stdout)["recall"]


def test_app_py_with_ray_serves_the_same_answers(cluster, sharded, start_app, free_port, tmp_path):
    """`app.py --index DIR --ray ADDRESS`: the real server joins the cluster (actors where Ray
    places them) and answers as the in-process index does, whole."""
    import httpx

    local = Index.open(sharded)
    qids = gallery_ids(local)[::40]
    with start_app(["--index", sharded, "--name", "ray", "--ray", cluster.address, "--shard-timeout", "10"],
                   tmp_path, free_port()) as (url, _):
        assert httpx.get(f"{url}/api/health", timeout=60).json()["status"] == "ok"
        for q in qids:
            r = httpx.post(f"{url}/api/search", data={"id": str(q), "k": "6"}, timeout=120)
            body = r.json()
            assert r.status_code == 200 and "partial" not in body, body
            assert _same([(x["id"], x["score"]) for x in body["results"]], expected(local, q, 6))


def test_ray_on_a_single_index_is_one_line(tmp_path, omniglot_root, small_onnx):
    from indexer import build_index

    out = tmp_path / "single"
    build_index(copy_chars(omniglot_root, tmp_path / "g", 2), out, model=small_onnx, progress=False)
    with pytest.raises(IndexerError, match="sharded index .* single index: serve it without --ray"):
        Index.open(out, ray="127.0.0.1:1")
    with pytest.raises(IndexerError, match="--max-memory and --ray exclude each other"):
        Index.open(out, ray="127.0.0.1:1", max_memory="1G")


def surviving(directory: Path, lost: list[int]) -> Index:
    """The in-process Index whose faiss index is the parts of the shards NOT lost (+ held)."""
    import faiss

    from indexer.ann import faiss_index as fx
    from indexer.ann import stream
    from indexer.directory.index_dir import PART_FILE
    from indexer.searchable import Answer
    from indexer.directory.shard_files import shard_paths

    idx = Index.open(directory)
    m = idx.manifest
    trained = faiss.read_index(str(directory / m.sharded.trained))
    files = [p / PART_FILE for i, p in enumerate(shard_paths(directory, m)) if i not in lost]
    parts = stream.open_parts(files + [directory / m.sharded.held], trained)
    fx.set_search_params(parts, m.search_params or "")

    class Surviving:            # those parts as an indexer.searchable.Searchable, searched here
        d, ntotal, summary = parts.d, parts.ntotal, None

        def missing(self) -> list[int]:
            return []

        def search(self, q: np.ndarray, k: int) -> Answer:
            return Answer(*parts.search(q, k))

    return Index(idx.layout, idx.store, Surviving(), None)


@pytest.fixture(scope="module")
def app(cluster, sharded, free_port):
    """The API on 127.0.0.1 over a Searcher whose shard actors are pinned to nodes 0, 1, 2."""
    import uvicorn
    from fastapi import FastAPI

    from serving import Searcher
    from serving.api import add_api_routes

    searcher = Searcher.open([sharded], names=["ray"], ray=served())
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
        yield f"http://127.0.0.1:{port}", searcher
    finally:
        server.should_exit = True
        thread.join(30)


def expected(idx: Index, qid: int, k: int) -> list[tuple[int, float]]:
    v = idx.embeddings([qid])
    s, i = idx.search_embeddings(v, k, exclude=[qid])
    return [(h.id, h.score) for h in idx.hits(s[0], i[0])]


def test_node_loss_under_load_is_partial_then_whole(cluster, sharded, app):
    import httpx

    url, searcher = app
    k, lost = 8, 1
    whole = Index.open(sharded)
    rest = surviving(sharded, [lost])
    qids = gallery_ids(whole)[::7][:24]
    want_whole = {q: expected(whole, q, k) for q in qids}
    want_partial = {q: expected(rest, q, k) for q in qids}
    assert any(want_whole[q] != want_partial[q] for q in qids)     # the lost shard matters
    assert httpx.get(f"{url}/api/health", timeout=60).status_code == 200
    # the web page's search handler, built before the load: built under it (4 client threads
    # and the server in this process, one GIL) it took ~22 s of the test's ~40
    page_search = ui_search(searcher)

    answers: list[tuple[float, int, dict, int]] = []
    stop = threading.Event()
    lock = threading.Lock()

    def client(c: int) -> None:
        n = 0
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():
                q = qids[(c * 5 + n) % len(qids)]
                t0 = time.monotonic()
                r = http.post(f"{url}/api/search", data={"id": str(q), "k": str(k)})
                with lock:
                    answers.append((time.monotonic() - t0, r.status_code, r.json(), q))
                n += 1

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        cluster.kill(lost)
        health = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:          # Ray notices the node is gone; health says so
            health = httpx.get(f"{url}/api/health", timeout=60)
            if health.status_code == 503:
                break
            time.sleep(0.5)
        assert health is not None and health.status_code == 503, health and health.text
        assert f"shard(s) {lost} not answering" in health.json()["error"]
        with lock:
            seen = len(answers)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:          # partial answers are served meanwhile
            with lock:
                if sum(1 for a in answers[seen:] if a[2].get("partial")) >= 4:
                    break
            time.sleep(0.5)
        ui_line = page_search(None, str(qids[0]), None, k)[0]    # the page says so too
        assert f"partial answer, shard(s) {lost} did not answer in time" in ui_line, ui_line
        cluster.revive(lost)                        # Ray restarts the pinned actor there
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            health = httpx.get(f"{url}/api/health", timeout=60)
            if health.status_code == 200:
                break
            time.sleep(0.5)
        assert health.status_code == 200, health.text
        with lock:
            back = len(answers)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with lock:
                if sum(1 for a in answers[back:] if not a[2].get("partial")) >= 8:
                    break
            time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(180)
    counts = {"whole": 0, "partial": 0}
    for took, status, body, q in answers:
        assert status == 200, body
        assert took <= BOUND_S + SLACK_S, (took, body)
        got = [(r["id"], r["score"]) for r in body["results"]]
        if body.get("partial"):
            assert body["partial"] == [lost], body
            assert _same(got, want_partial[q]), (q, got, want_partial[q])
            counts["partial"] += 1
        else:
            assert _same(got, want_whole[q]), (q, got, want_whole[q])
            counts["whole"] += 1
    assert counts["partial"] >= 4 and counts["whole"] >= 8, counts
    tail = [a for a in answers[back:]]
    assert tail and not any(a[2].get("partial") for a in tail[-4:]), counts    # whole again
    ui_line = page_search(None, str(qids[0]), None, k)[0]
    assert ui_line.startswith("Query") and "partial" not in ui_line, ui_line
    print(f"answers under node loss: {counts}")


def ui_search(searcher) -> Any:
    """The web page's search handler (``serving.ui``, api_name ``search``) over ``searcher``:
    what a click on Search runs; its first output is the status line above the results."""
    from serving.ui import build_ui

    demo = build_ui(searcher)
    return next(f.fn for f in demo.fns.values() if f.api_name == "search")


def _same(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> bool:
    return [g[0] for g in got] == [w[0] for w in want] and \
        np.allclose([g[1] for g in got], [w[1] for w in want], atol=1e-6)


def test_add_while_serving_over_ray_is_found(cluster, sharded, app, omniglot_root, tmp_path):
    """`indexer add` into the sharded index while it is served over Ray: the server reopens on
    the manifest change, the changed shard gets a new actor, and the added images are found."""
    import httpx

    url, searcher = app
    before = searcher.index("ray")
    before_ids = set(gallery_ids(before))       # the store is live: read the ids now
    more = copy_chars(omniglot_root, tmp_path / "more", 2, skip=40, per_char=5)
    add = subprocess.run([sys.executable, "-m", "indexer", "add", str(more), "--index", str(sharded),
                          "--quiet"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert add.returncode == 0, add.stderr[-2000:]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(searcher.index("ray")) == len(before):
        time.sleep(0.2)
    after = searcher.index("ray")
    assert len(after) == len(before) + 10 and isinstance(after.faiss, Router)
    new = sorted(set(gallery_ids(after)) - before_ids)
    assert len(new) == 10
    for q in new[:3]:
        r = httpx.post(f"{url}/api/search", data={"id": str(q), "k": "3"}, timeout=120)
        body = r.json()
        assert r.status_code == 200 and "partial" not in body, body
        got = [(x["id"], x["score"]) for x in body["results"]]
        assert _same(got, expected(Index.open(sharded), q, 3))
        # the added image's own vector finds it (not left out: queried as a vector)
        s, i = after.search_embeddings(after.embeddings([q]), 1)
        assert int(i[0, 0]) == q
