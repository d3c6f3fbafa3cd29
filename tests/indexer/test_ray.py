"""`indexer build --ray` on a real local Ray instance: 2 shard tasks + merge == one process, and a
shard task whose worker is SIGKILLed mid-way is retried, resumes, and loses or doubles nothing;
`indexer audit --ray` of the sharded build equals its audit in this process.

Ray listens beyond loopback, so this module runs only inside a private network namespace. The
main `python -m pytest` run does not collect it; `test_ray_netns.py` runs it there instead
(`unshare -n python -m pytest tests/indexer/test_ray.py`, which also works by hand as root).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from ray_testlib import require_private_network, shard_hook

require_private_network("tests/indexer/test_ray.py")

ray = pytest.importorskip("ray")

from indexer_testlib import RAY_FLAGS as FLAGS  # noqa: E402
from indexer_testlib import assert_same_index, run_cli  # noqa: E402
from indexer import GalleryStore, Index  # noqa: E402
from indexer.ann import neighbours  # noqa: E402
from indexer.directory.index_dir import STORE_DIR  # noqa: E402
from indexer.directory.index_dir import FILE_LIST  # noqa: E402
from indexer.store.walk import read_file_list, shard_of  # noqa: E402


@pytest.fixture(scope="module")
def ray_address(ray_cluster) -> str:
    """The GCS address of the run's cluster (tests/conftest.py ``ray_cluster``, which this
    process joined as a driver); the CLI joins it as a user joins a cluster (`--ray HOST:PORT`)."""
    return ray_cluster.address


def test_two_ray_shards_equal_a_single_build(tmp_path: Path, ray_address: str, ray_gallery: Path,
                                             small_onnx: Path, ray_single: Index) -> None:
    """Progress across shards, each task's own list, and the merged index equal to one process's,
    with DBA as `merge` computes it (asked for: kept whatever the labels say)."""
    out = tmp_path / "ray"
    p = run_cli("build", ray_gallery, "--model", small_onnx, "--out", out, "--ray", ray_address,
                "--shards", "2", "--flat-threshold", "100", "--no-int8", "--dba")
    n = len(list(ray_gallery.rglob("*.png")))
    assert f"{n} files in 2 shards on Ray" in p.stdout and "attempts per shard: 1, 1" in p.stdout, p.stdout
    assert f"{n}/{n}" in p.stderr, p.stderr[-2000:]          # one progress bar across both shards
    for i in range(2):
        with GalleryStore(out / "shards" / str(i) / STORE_DIR) as st:
            paths = [st.get_meta(int(j))["path"] for j in st.ids()]
        assert paths and all(shard_of(r, 2) == i for r in paths)
        # the task ingested the list the driver's one walk wrote for it
        listed = [f.relpath for f in read_file_list(ray_gallery, out / "shards" / str(i) / FILE_LIST)]
        assert sorted(listed) == sorted(paths)
    merged = Index.open(out)
    assert merged.manifest["shards"] == [[0, 2], [1, 2]]
    assert_same_index(merged, ray_single, ray_gallery, dba=False)
    ids, x = ray_single.store.all_embeddings(ray_single.model_hash)
    want = neighbours.build(ids, x)           # the neighbours' similarities (a tie's winner aside)
    np.testing.assert_array_equal(merged.neighbours.ids, want.ids)
    np.testing.assert_allclose(merged.neighbours.sims, want.sims, atol=1e-5)
    # shards cut another way must not be resumed into these
    p = run_cli("build", ray_gallery, "--model", small_onnx, "--out", out, "--ray", ray_address,
                "--shards", "3", *FLAGS, check=False)
    assert p.returncode == 1 and "holds shards of another build (--shards 2 instead of 3)" in p.stderr, p.stderr


@pytest.mark.parametrize("layout", ["merged", "sharded"])
def test_a_ray_rebuild_with_prune_drops_deleted_files(tmp_path: Path, ray_address: str, ray_gallery: Path,
                                                     small_onnx: Path, layout: str) -> None:
    """`--prune` with `--ray` was refused: a Ray-built index kept deleted photos for good. Now
    the shard tasks and the merge drop them (`--sharded`: each shard its own, the parts rebuilt);
    without it the build counts them in one line."""
    import shutil

    g = tmp_path / "g"
    for f in sorted(ray_gallery.rglob("*.png"))[:40]:
        (g / f.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy(f, g / f.parent.name / f.name)
    out = tmp_path / "ray"
    build = ["build", g, "--model", small_onnx, "--out", out, "--ray", ray_address, "--shards", "2", *FLAGS,
             *(["--sharded"] if layout == "sharded" else [])]
    run_cli(*build)
    gone = sorted(g.rglob("*.png"))[::10]
    for f in gone:
        f.unlink()
    kept = run_cli(*build)
    assert f"{len(gone)} stored files are not in {g} any more" in kept.stderr, kept.stderr
    assert Index.open(out).manifest["count"] == 40
    pruned = run_cli(*build, "--prune")
    assert f"{len(gone)} stored files not in {g} any more: dropped (--prune)" in pruned.stdout, pruned.stdout
    stores = [out / "shards" / str(i) / STORE_DIR for i in range(2)] if layout == "sharded" else [out / STORE_DIR]
    held, vectors = set(), []
    with Index.open(out) as idx:
        for path in stores:
            with GalleryStore(path) as st:
                held.update(st.ids().tolist())
                vectors.append(st.all_embeddings(idx.model_hash)[1])
                assert all(st.id_for_path(f.relative_to(g).as_posix()) is None for f in gone)
        assert len(held) == 40 - len(gone) == idx.manifest["count"]
        _, ids = idx.search_embeddings(np.concatenate(vectors), k=40)      # what is served: the rest only
        assert set(ids.ravel().tolist()) - {-1} == held


def test_killed_shard_task_is_retried_and_resumes(tmp_path: Path, ray_address: str, ray_gallery: Path,
                                                  small_onnx: Path, ray_single: Index) -> None:
    out, marker = tmp_path / "ray", tmp_path / "killed.txt"
    # shard 0's worker SIGKILLs itself after its first commit (256 images), on the first attempt
    env = shard_hook("kill_after", f"0:1:{marker}")
    p = run_cli("build", ray_gallery, "--model", small_onnx, "--out", out, "--ray", ray_address,
                "--shards", "2", *FLAGS, env=env)
    assert marker.exists(), "the fault never fired"
    assert "attempts per shard: 2, 1" in p.stdout, p.stdout
    shard0 = json.loads((out / "shards" / "0" / "manifest.json").read_text())["ingest"]
    # the retry found what the killed attempt had committed and ingested only the rest
    assert shard0["unchanged"] >= 256 and shard0["new"] > 0, shard0
    assert shard0["unchanged"] + shard0["new"] == shard0["found"], shard0

    files = sorted(ray_gallery.rglob("*.png"))
    unique = {hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    merged = Index.open(out)
    with GalleryStore(out / STORE_DIR) as st:
        ids = st.ids()
        assert len(ids) == len(set(ids.tolist())) == len(unique) == merged.manifest["count"]
        for f in files:                                          # no loss: every file is there
            assert st.id_for_path(f.relative_to(ray_gallery).as_posix()) is not None
    assert_same_index(merged, ray_single, ray_gallery)


def test_sharded_ray_build_equals_a_single_build(ray_sharded: tuple[Path, str], ray_single: Index) -> None:
    """--sharded: the shards stay where their tasks built them, a second Ray pass fills each
    shard's part from a quantizer trained once, and the parts searched as one answer as well as
    the one-process build does."""
    from indexer import Sharded
    from indexer.directory.index_dir import PART_FILE

    out, stdout = ray_sharded
    assert "attempts per shard: 1, 1" in stdout, stdout
    sharded = Index.open(out, check_model=True)
    assert isinstance(sharded.layout, Sharded)
    assert sharded.manifest["sharded"]["shards"] == ["shards/0", "shards/1"]
    assert not (out / STORE_DIR).exists()                      # no store copied
    parts = [faiss_read(out / "shards" / str(i) / PART_FILE) for i in range(2)]
    assert all(n > 0 for n in parts) and sum(parts) + sharded.manifest["heldout_queries"] * 2 == len(sharded)
    ms, mm = ray_single.manifest, sharded.manifest
    for key in ("index_type", "count", "nlist", "dim"):
        assert mm[key] == ms[key], key
    # trained on samples each shard draws (not the one-process rows): as good, not identical
    ids, x = ray_single.store.all_embeddings(ray_single.model_hash)
    q = x / np.linalg.norm(x, axis=1, keepdims=True)
    exact = ids[np.argsort(-(q @ x.T), axis=1, kind="stable")[:, :10]]
    rec = lambda found: float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(found, exact)]))  # noqa: E731
    assert rec(sharded.search_embeddings(x, 10)[1]) >= rec(ray_single.search_embeddings(x, 10)[1]) - 0.03


def faiss_read(path: Path) -> int:
    import faiss

    return int(faiss.read_index(str(path), faiss.IO_FLAG_MMAP).ntotal)


def test_plan_reads_run_in_the_shards_readers_and_equal_the_in_process_plan(
        ray_sharded: tuple[Path, str]) -> None:
    """The plan made through one Ray reader per shard (census, samples, each shard's exact
    top-k) is the plan made in this process on the same shard directories, and those reads ran
    in the readers' processes, not here."""
    import faiss

    from indexer.ann import stream
    from indexer.ray.readers import open_readers
    from indexer.store.sources import StoreSource

    out, _ = ray_sharded
    dirs = [out / "shards" / str(i) for i in range(2)]
    m = json.loads((out / "manifest.json").read_text())
    model_hash, dim = m["model"]["hash"], int(m["dim"])
    opts = {"flat_threshold": 100, "device": "cpu", "seed": 3}
    local_sources = [StoreSource(d / STORE_DIR, model_hash, dim) for d in dirs]
    try:
        local = stream.plan(local_sources, **opts)
    finally:
        for s in local_sources:
            s.close()
    readers = open_readers(ray, dirs, model_hash, dim, max_retries=1)
    try:
        remote = stream.plan(readers, **opts)
        where = [r.where() for r in readers]
    finally:
        for r in readers:
            r.close()
    assert remote.spec == local.spec and local.spec.index_type == "ivf"
    assert remote.count == local.count == m["count"] and remote.tiny == local.tiny is False
    np.testing.assert_array_equal(remote.held_query_ids, local.held_query_ids)
    assert len(local.held_query_ids) == 2 * m["heldout_queries"]
    np.testing.assert_array_equal(remote.qt, local.qt)
    np.testing.assert_array_equal(remote.qc, local.qc)
    np.testing.assert_array_equal(remote.truth, local.truth)
    # and it is the exact answer: brute force over both stores but the held-out vectors
    with GalleryStore(dirs[0] / STORE_DIR) as s0, GalleryStore(dirs[1] / STORE_DIR) as s1:
        (i0, x0), (i1, x1) = s0.all_embeddings(model_hash), s1.all_embeddings(model_hash)
    first = ~np.isin(i1, i0)                                   # content in both: shard 0's
    ids, x = np.concatenate([i0, i1[first]]), np.concatenate([x0, x1[first]])
    keep = ~np.isin(ids, local.held_query_ids)
    q = np.concatenate([local.qt, local.qc])
    want = ids[keep][faiss.knn(q, x[keep], local.truth.shape[1], metric=faiss.METRIC_INNER_PRODUCT)[1]]
    assert (want == local.truth).mean() > 0.999                # ties in score may swap equal ids
    for a, b in zip(remote.skip, local.skip):
        np.testing.assert_array_equal(a, b)
    nlist = local.spec.nlist
    cents = [faiss.extract_index_ivf(p.trained).quantizer.reconstruct_n(0, nlist) for p in (remote, local)]
    np.testing.assert_array_equal(cents[0], cents[1])
    # every read ran in a reader: two processes, neither this one, each shard's exact answers once
    pids = {w["pid"] for w in where}
    assert len(pids) == 2 and os.getpid() not in pids, where
    for w in where:
        assert w["calls"]["knn"] == 1 and w["calls"]["sample"] >= 2 and w["calls"]["next_ids"] >= 2, w
    # what reached the driver: ids, sample rows and nq x k answers, never a shard's vectors in bulk
    got = {k: sum(r.received[k] for r in readers) for k in ("next_ids", "sample", "knn")}
    assert got["next_ids"] >= 8 * m["count"] and got["knn"] == 2 * len(local.truth) * local.truth.shape[1] * 12
    assert "next_chunk" not in readers[0].received


def test_a_killed_reader_is_restarted_and_its_stream_goes_on(ray_sharded: tuple[Path, str]) -> None:
    """A reader whose process dies mid-stream is restarted and the call retried; the id stream
    still yields every id once (calls carry positions, not state). A shard that cannot be opened
    fails in one line that names it."""
    import signal

    from indexer.errors import IndexerError
    from indexer.ray.readers import open_readers
    from indexer.store.sources import StoreSource

    out, _ = ray_sharded
    d = out / "shards" / "0"
    m = json.loads((out / "manifest.json").read_text())
    model_hash, dim = m["model"]["hash"], int(m["dim"])
    src = StoreSource(d / STORE_DIR, model_hash, dim)
    want = src.ids()
    src.close()
    (reader,) = open_readers(ray, [d], model_hash, dim, max_retries=2)
    try:
        chunks, it = [], reader.id_chunks(50)
        chunks.append(next(it))
        os.kill(reader.where()["pid"], signal.SIGKILL)
        chunks += list(it)
        np.testing.assert_array_equal(np.concatenate(chunks), want)
        assert reader.where()["pid"] != os.getpid()
    finally:
        reader.close()
    with pytest.raises(IndexerError, match=r"^reading shard 1 for the plan \(where\) failed: .*no gallery store here"):
        open_readers(ray, [d, out / "no-such-shard"], model_hash, dim, max_retries=0)


def test_audit_over_ray_equals_the_audit_in_this_process(ray_sharded: tuple[Path, str], ray_address: str,
                                                         tmp_path: Path) -> None:
    """`indexer audit --ray`: the kNN graph searched through the shards' Ray actors gives the
    audit that this process gives of the same sharded index (same parts, same probes); every
    image scored once. (The pixel check reads the stores, not the graph: off, it adds ~35 s.)"""
    out, _ = ray_sharded
    got = {}
    for name, extra in (("local", []), ("ray", ["--ray", ray_address])):
        run_cli("audit", "--index", out, "--out", tmp_path / name, "--quiet", "--no-sheets", "--no-verify", *extra)
        got[name] = {kind: [json.loads(x) for x in (tmp_path / name / f"{kind}.jsonl").read_text().splitlines()]
                     for kind in ("outliers", "mislabelled", "duplicates")}
    n = len(Index.open(out))
    assert len(got["local"]["outliers"]) == len(got["ray"]["outliers"]) == n
    # scores per image, not ranks: a tie at a probe's k-th neighbour may go either way
    score = {k: {r["path"]: r["score"] for r in v["outliers"]} for k, v in got.items()}
    diff = np.array([abs(score["ray"][p] - score["local"][p]) for p in score["local"]])
    assert (diff <= 1e-4).mean() >= 0.95 and diff.max() <= 0.05, np.sort(diff)[-10:]
    flagged = {k: {r["path"] for r in v["mislabelled"]} for k, v in got.items()}
    assert len(flagged["ray"] ^ flagged["local"]) <= max(2, len(flagged["local"]) // 10), flagged
    assert len(got["ray"]["duplicates"]) == len(got["local"]["duplicates"])
