"""`indexer build --ray` across nodes, on a local multi-node Ray cluster (``ray.cluster_utils.
Cluster``: one head and two worker raylets on this machine, the way Ray tests its own multi-node
behaviour). The head has no CPU, so every shard task runs on a worker node, which the tests can
remove as a lost machine: its raylet and every process on it die at once.

- a sharded build whose two shard tasks ran on the two worker nodes reads its plan and fills its
  parts on the node that built each shard, and that plan is the in-process plan;
- a worker node removed while its shard task is mid-way (work committed, more to do): the task
  reruns on the other node, its store resumes (what the dead attempt stored is not embedded
  again) and the index equals the one-process build's (ids, vectors, search answers);
- a shard reader whose node is gone (removed mid-stream, or gone before it was placed) runs on
  another node and its stream goes on (soft node affinity falls back).

Ray listens beyond loopback: run in a private network namespace (`unshare -n python -m pytest
tests/indexer/test_ray_cluster.py`; the main run does it through test_ray_netns.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ray_testlib import LocalCluster, require_private_network, shard_hook

require_private_network("tests/indexer/test_ray_cluster.py")

ray = pytest.importorskip("ray")

from indexer_testlib import RAY_FLAGS as FLAGS  # noqa: E402
from indexer_testlib import REPO, assert_same_index, copy_characters, run_cli  # noqa: E402
from indexer import GalleryStore, Index  # noqa: E402
from indexer.ann.faiss_index import index_ids  # noqa: E402
from indexer.directory.index_dir import PART_FILE, STORE_DIR  # noqa: E402
from indexer.directory.index_dir import RUN_FILE

WAIT_S = 300.0                                         # bound on every wait for the cluster or a build


@pytest.fixture(scope="module")
def cluster(ray_cluster: LocalCluster) -> LocalCluster:
    """The run's cluster (tests/conftest.py): a head without CPU (the drivers' node) + 2 worker
    nodes of 1 CPU: with 1 CPU a shard task, two shards run at once, one on each worker node.
    This process is a driver too."""
    return ray_cluster


@pytest.fixture(scope="module")
def sharded(ray_sharded: tuple[Path, str]) -> Path:
    """`indexer build --ray HEAD --shards 2 --sharded` on the cluster, undisturbed."""
    return ray_sharded[0]


def run_facts(out: Path) -> dict:
    """What the build recorded about its Ray run (nodes of each shard, of each attempt...)."""
    return json.loads((out / "shards" / RUN_FILE).read_text())


def alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def progress_actor_nodes() -> list[str]:
    """Nodes of the live ``_Progress`` actors (the running build's), from the GCS actor table:
    Ray's public state API needs the dashboard, which the test cluster does not run."""
    from ray._private import state

    return [a["Address"]["NodeID"] for a in state.actors().values()
            if a.get("ActorClassName") == "_Progress" and a.get("State") == "ALIVE"]


def worker_index(cluster: LocalCluster, node: str) -> int:
    """Which of the cluster's nodes ``node`` is; never the head (it has no CPU for a task)."""
    ids = [cluster.node_id(i) for i in range(len(cluster.nodes))]
    assert node in ids[1:], f"{node} is not a worker node of the cluster ({ids})"
    return ids.index(node)


def test_sharded_build_reads_and_fills_each_shard_on_the_node_that_built_it(
        cluster: LocalCluster, sharded: Path) -> None:
    """Two shard tasks on the two worker nodes; the CLI's plan readers and fill tasks ran on the
    node of their shard; readers opened here land there too, and their plan is the plan made in
    this process from the same stores."""
    import faiss

    from indexer.ann import stream
    from indexer.ray.readers import open_readers
    from indexer.store.sources import StoreSource

    facts = run_facts(sharded)
    nodes = facts["nodes"]
    workers = {cluster.node_id(1), cluster.node_id(2)}
    assert facts["attempts"] == [1, 1] and set(nodes) == workers, facts      # one shard a node
    assert facts["attempt_nodes"] == [[n] for n in nodes], facts
    assert facts["plan_nodes"] == nodes and facts["fill_nodes"] == nodes, facts

    dirs = [sharded / "shards" / str(i) for i in range(2)]
    m = json.loads((sharded / "manifest.json").read_text())
    model_hash, dim = m["model"]["hash"], int(m["dim"])
    opts = {"flat_threshold": 100, "device": "cpu", "seed": 3}
    local_sources = [StoreSource(d / STORE_DIR, model_hash, dim) for d in dirs]
    try:
        local = stream.plan(local_sources, **opts)
    finally:
        for s in local_sources:
            s.close()
    readers = open_readers(ray, dirs, model_hash, dim, max_retries=1, nodes=nodes)
    try:
        where = [r.where() for r in readers]
        remote = stream.plan(readers, **opts)
        after = [r.where() for r in readers]
    finally:
        for r in readers:
            r.close()
    assert [w["node"] for w in where] == [w["node"] for w in after] == nodes, (where, nodes)
    assert len({w["pid"] for w in after}) == 2 and os.getpid() not in {w["pid"] for w in after}
    for w in after:                                    # the plan's reads ran in the readers
        assert w["calls"]["knn"] == 1 and w["calls"]["sample"] >= 2 and w["calls"]["next_ids"] >= 2, w
    assert remote.spec == local.spec and local.spec.index_type == "ivf"
    assert remote.count == local.count == m["count"]
    np.testing.assert_array_equal(remote.held_query_ids, local.held_query_ids)
    np.testing.assert_array_equal(remote.qt, local.qt)
    np.testing.assert_array_equal(remote.qc, local.qc)
    np.testing.assert_array_equal(remote.truth, local.truth)
    for a, b in zip(remote.skip, local.skip):
        np.testing.assert_array_equal(a, b)
    nlist = local.spec.nlist
    cents = [faiss.extract_index_ivf(p.trained).quantizer.reconstruct_n(0, nlist) for p in (remote, local)]
    np.testing.assert_array_equal(cents[0], cents[1])


def assert_same_sharded(got: Path, want: Path) -> None:
    """Two ``--sharded`` builds of one gallery: the same ids and vectors in each shard's store,
    the same ids in each part, the same search answers."""
    import faiss

    a, b = Index.open(got), Index.open(want)
    model_hash = b.model_hash
    for i in range(2):
        with GalleryStore(got / "shards" / str(i) / STORE_DIR) as sa, \
                GalleryStore(want / "shards" / str(i) / STORE_DIR) as sb:
            (ia, xa), (ib, xb) = sa.all_embeddings(model_hash), sb.all_embeddings(model_hash)
        oa, ob = np.argsort(ia), np.argsort(ib)
        np.testing.assert_array_equal(ia[oa], ib[ob])
        np.testing.assert_allclose(xa[oa], xb[ob], atol=1e-6)
        parts = [faiss.read_index(str(d / "shards" / str(i) / PART_FILE)) for d in (got, want)]
        np.testing.assert_array_equal(index_ids(parts[0]), index_ids(parts[1]))
    with GalleryStore(want / "shards" / "0" / STORE_DIR) as s0:
        _, x = s0.all_embeddings(model_hash)
    for key in ("count", "nlist", "nprobe", "recall_at_10"):
        assert a.manifest[key] == b.manifest[key], key
    (da, ka), (db, kb) = a.search_embeddings(x, 10), b.search_embeddings(x, 10)
    np.testing.assert_array_equal(ka, kb)
    np.testing.assert_allclose(da, db, atol=1e-5)


@pytest.mark.parametrize("layout", ["merged", "sharded"])
def test_node_removed_mid_task_the_task_reruns_elsewhere_resumes_and_equals_undisturbed(
        tmp_path: Path, cluster: LocalCluster, ray_gallery: Path, small_onnx: Path, ray_single: Index,
        sharded: Path, layout: str) -> None:
    """Shard 0's task stops once its first 256 images are committed (``ray_testlib.hold_after``); the test removes
    its node; Ray reruns the task on the other worker node, which finds those 256 in the shard's
    store and embeds only the rest. Merged: the index is the one-process build's; ``--sharded``:
    the undisturbed sharded build's, read and filled where the shards now are. The node comes
    back (a new node id) for the tests after."""
    out, marker = tmp_path / "idx", tmp_path / "held.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2", **shard_hook("hold_after", f"0:1:{marker}")}
    cmd = [sys.executable, "-m", "indexer", "build", str(ray_gallery), "--model", str(small_onnx),
           "--out", str(out), "--ray", cluster.address, "--shards", "2", *FLAGS]
    if layout == "sharded":
        cmd.append("--sharded")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed: int | None = None
    try:
        deadline = time.monotonic() + WAIT_S
        while not marker.exists():
            assert proc.poll() is None, f"the build ended before shard 0 was held: {proc.communicate()}"
            assert time.monotonic() < deadline, "shard 0's task was never held"
            time.sleep(0.2)
        time.sleep(0.2)                                  # the marker is written in one small write
        held = json.loads(marker.read_text())
        # the build's progress actor is on the driver's node (the head), not on one that can die
        # with a shard task: losing it used to fail the whole build
        assert progress_actor_nodes() == [cluster.node_id(0)]
        killed = worker_index(cluster, held["node"])
        dead = held["node"]
        cluster.kill(killed)                             # mid-task: 256 committed, ~44 to go
        stdout, stderr = proc.communicate(timeout=WAIT_S)
        assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout}\n{stderr[-4000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if killed is not None:
            cluster.revive(killed)
    assert dead not in alive_nodes()
    facts = run_facts(out)
    assert facts["attempts"] == [2, 1], facts
    first, retry = facts["attempt_nodes"][0]
    assert first == dead and retry != dead and facts["nodes"][0] == retry, facts   # reran elsewhere
    assert "attempts per shard: 2, 1" in stdout, stdout

    # the retry resumed the store: what the killed attempt committed was found, not embedded again
    shard0 = json.loads((out / "shards" / "0" / "manifest.json").read_text())["ingest"]
    assert held["done"] >= 256 and shard0["unchanged"] == held["done"], (held, shard0)
    assert shard0["new"] == shard0["embedded"] == shard0["found"] - held["done"] > 0, shard0

    if layout == "sharded":
        assert facts["plan_nodes"] == facts["fill_nodes"] == facts["nodes"], facts   # shard 0's new node
        assert_same_sharded(out, sharded)
        assert len(alive_nodes()) == 3
        return
    files = sorted(ray_gallery.rglob("*.png"))
    unique = {hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    merged = Index.open(out)
    with GalleryStore(out / STORE_DIR) as st:
        ids = st.ids()
        assert len(ids) == len(set(ids.tolist())) == len(unique) == merged.manifest["count"]
        for f in files:                                   # nothing lost
            assert st.id_for_path(f.relative_to(ray_gallery).as_posix()) is not None
    assert_same_index(merged, ray_single, ray_gallery)
    assert len(alive_nodes()) == 3                        # the node came back


def test_a_reader_whose_node_is_gone_runs_on_another_node(cluster: LocalCluster, sharded: Path) -> None:
    """Soft node affinity falls back: a reader whose node is removed mid-stream is restarted on
    another node and its id stream goes on whole; a reader asked for a node that no longer
    exists (the build's record after that node died) opens elsewhere and answers."""
    from indexer.ray.readers import open_readers
    from indexer.store.sources import StoreSource

    d = sharded / "shards" / "0"
    m = json.loads((sharded / "manifest.json").read_text())
    model_hash, dim = m["model"]["hash"], int(m["dim"])
    src = StoreSource(d / STORE_DIR, model_hash, dim)
    want = src.ids()
    src.close()

    target = cluster.node_id(1)
    (reader,) = open_readers(ray, [d], model_hash, dim, max_retries=2, nodes=[target])
    try:
        assert reader.where()["node"] == target
        chunks, it = [], reader.id_chunks(50)
        chunks.append(next(it))
        cluster.kill(1)
        try:
            chunks += list(it)
            moved = reader.where()["node"]
        finally:
            cluster.revive(1)
        np.testing.assert_array_equal(np.concatenate(chunks), want)
        assert moved != target and moved in alive_nodes(), (moved, target)
    finally:
        reader.close()

    assert target not in alive_nodes()
    (late,) = open_readers(ray, [d], model_hash, dim, max_retries=0, nodes=[target])
    try:
        assert late.where()["node"] in alive_nodes() and late.count() == len(want)
    finally:
        late.close()


def test_ray_local_starts_its_own_instance_beside_a_running_cluster(
        tmp_path: Path, cluster: LocalCluster, omniglot_root: Path, small_onnx: Path) -> None:
    """`--ray local` means a private instance even where RAY_ADDRESS (or the last cluster
    started on this machine) names another: it used to join that one and fail ("num_cpus and
    num_gpus must not be provided")."""
    small = tmp_path / "gallery"
    n = len(copy_characters(omniglot_root, small, 2))
    out = tmp_path / "idx"
    run_cli("build", small, "--model", small_onnx, "--out", out, "--ray", "local", "--shards", "1",
            "--quiet", env={"RAY_ADDRESS": cluster.address}, timeout=WAIT_S)
    facts = run_facts(out)
    assert facts["address"] == "local" and facts["found"] == n, facts
    ours = {cluster.node_id(i) for i in range(len(cluster.nodes))}
    assert facts["nodes"][0] not in ours, facts              # built on the private instance
    assert Index.open(out).manifest["count"] == n

