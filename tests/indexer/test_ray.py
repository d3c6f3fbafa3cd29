"""`indexer build --ray` on a real local Ray instance: 2 shard tasks + merge == one process, and a
shard task whose worker is SIGKILLed mid-way is retried, resumes, and loses or doubles nothing.

Ray listens beyond loopback, so this module runs only inside a private network namespace. The
main `python -m pytest` run does not collect it; `test_ray_netns.py` runs it there instead
(`unshare -n python -m pytest tests/indexer/test_ray.py`, which also works by hand as root).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import struct
from pathlib import Path

import numpy as np
import pytest

from indexer.ray_build import FAULT_ENV, only_loopback

if not only_loopback():
    pytest.skip("Ray listens beyond loopback: run this module in a private network namespace "
                "(unshare -n python -m pytest tests/indexer/test_ray.py; the main run does it)",
                allow_module_level=True)

ray = pytest.importorskip("ray")

from indexer_testlib import copy_characters, run_cli  # noqa: E402
from indexer import GalleryStore, Index  # noqa: E402
from indexer.faiss_index import index_ids  # noqa: E402
from indexer.index_dir import STORE_DIR  # noqa: E402
from indexer.walk import FILE_LIST, read_file_list, shard_of  # noqa: E402

FLAGS = ["--quiet", "--flat-threshold", "100"]         # IVF: the case where merging must match
N_CHARS = 30                                           # 600 images, ~300 per shard


def loopback_up() -> None:
    """`ip link set lo up` (a new namespace starts with lo down), done by hand because
    iproute2 is not on every machine; SIOCGIFFLAGS / SIOCSIFFLAGS on a struct ifreq."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, siocgifflags, req))[1]
        if not flags & iff_up:
            fcntl.ioctl(s, siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))


@pytest.fixture(scope="module")
def ray_address():
    """A local Ray instance (2 CPUs) started here and stopped here; yields its GCS address,
    which the CLI joins as a user joins a cluster (`--ray HOST:PORT`)."""
    loopback_up()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ctx = ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2 ** 20,
                   logging_level="WARNING")
    try:
        address = ctx.address_info["gcs_address"]
        assert address.startswith("127.0.0.1:"), address
        yield address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def gallery(tmp_path_factory: pytest.TempPathFactory, omniglot_root: Path) -> Path:
    root = tmp_path_factory.mktemp("ray-gallery")
    copy_characters(omniglot_root, root, N_CHARS)
    return root


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, gallery: Path, small_onnx: Path) -> Index:
    """The single-process build everything is compared with."""
    out = tmp_path_factory.mktemp("ray-single") / "idx"
    run_cli("build", gallery, "--model", small_onnx, "--out", out, *FLAGS)
    return Index.open(out)


def assert_same_index(merged: Index, single: Index, gallery: Path) -> None:
    ms, mm = single.manifest, merged.manifest
    assert mm["index_type"] == ms["index_type"] == "ivf"
    for key in ("count", "nlist", "nprobe", "recall_at_10", "dim"):
        assert mm[key] == ms[key], key
    np.testing.assert_array_equal(index_ids(merged.faiss.cpu_index), index_ids(single.faiss.cpu_index))
    ids, x = single.store.all_embeddings(single.model_hash)
    s1, i1 = single.search_embeddings(x, 10)
    s2, i2 = merged.search_embeddings(x, 10)
    np.testing.assert_array_equal(i2, i1)
    np.testing.assert_allclose(s2, s1, atol=1e-5)
    queries = sorted(gallery.rglob("*.png"))[::50]          # image files, through the embedder
    for a, b in zip(merged.search(queries, 5), single.search(queries, 5)):
        assert [(h.id, h.path, h.label) for h in a] == [(h.id, h.path, h.label) for h in b]


def test_two_ray_shards_equal_a_single_build(tmp_path: Path, ray_address: str, gallery: Path,
                                             small_onnx: Path, single: Index) -> None:
    out = tmp_path / "ray"
    p = run_cli("build", gallery, "--model", small_onnx, "--out", out, "--ray", ray_address,
                "--shards", "2", "--flat-threshold", "100")
    n = len(list(gallery.rglob("*.png")))
    assert f"{n} files in 2 shards on Ray" in p.stdout and "attempts per shard: 1, 1" in p.stdout, p.stdout
    assert f"{n}/{n}" in p.stderr, p.stderr[-2000:]          # one progress bar across both shards
    for i in range(2):
        with GalleryStore(out / "shards" / str(i) / STORE_DIR) as st:
            paths = [st.get_meta(int(j))["path"] for j in st.ids()]
        assert paths and all(shard_of(r, 2) == i for r in paths)
        # the task ingested the list the driver's one walk wrote for it
        listed = [f.relpath for f in read_file_list(gallery, out / "shards" / str(i) / FILE_LIST)]
        assert sorted(listed) == sorted(paths)
    merged = Index.open(out)
    assert merged.manifest["shards"] == [[0, 2], [1, 2]]
    assert_same_index(merged, single, gallery)
    # shards cut another way must not be resumed into these
    p = run_cli("build", gallery, "--model", small_onnx, "--out", out, "--ray", ray_address,
                "--shards", "3", *FLAGS, check=False)
    assert p.returncode == 1 and "holds shards of another build (--shards 2 instead of 3)" in p.stderr, p.stderr


def test_killed_shard_task_is_retried_and_resumes(tmp_path: Path, ray_address: str, gallery: Path,
                                                  small_onnx: Path, single: Index) -> None:
    out, marker = tmp_path / "ray", tmp_path / "killed.txt"
    # shard 0's worker SIGKILLs itself after its first commit (256 images), on the first attempt
    env = {FAULT_ENV: f"0:1:{marker}"}
    p = run_cli("build", gallery, "--model", small_onnx, "--out", out, "--ray", ray_address,
                "--shards", "2", *FLAGS, env=env)
    assert marker.exists(), "the fault never fired"
    assert "attempts per shard: 2, 1" in p.stdout, p.stdout
    shard0 = json.loads((out / "shards" / "0" / "manifest.json").read_text())["ingest"]
    # the retry found what the killed attempt had committed and ingested only the rest
    assert shard0["unchanged"] >= 256 and shard0["new"] > 0, shard0
    assert shard0["unchanged"] + shard0["new"] == shard0["found"], shard0

    files = sorted(gallery.rglob("*.png"))
    unique = {hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    merged = Index.open(out)
    with GalleryStore(out / STORE_DIR) as st:
        ids = st.ids()
        assert len(ids) == len(set(ids.tolist())) == len(unique) == merged.manifest["count"]
        for f in files:                                          # no loss: every file is there
            assert st.id_for_path(f.relative_to(gallery).as_posix()) is not None
    assert_same_index(merged, single, gallery)


def test_sharded_ray_build_equals_a_single_build(tmp_path: Path, ray_address: str, gallery: Path,
                                                 small_onnx: Path, single: Index) -> None:
    """--sharded: the shards stay where their tasks built them, a second Ray pass fills each
    shard's part from a quantizer trained once, and the parts searched as one answer as well as
    the one-process build does."""
    from indexer.shards import PART_FILE, ShardedIndex

    out = tmp_path / "ray"
    p = run_cli("build", gallery, "--model", small_onnx, "--out", out, "--ray", ray_address,
                "--shards", "2", "--sharded", *FLAGS)
    assert "attempts per shard: 1, 1" in p.stdout, p.stdout
    sharded = Index.open(out, check_model=True)
    assert isinstance(sharded, ShardedIndex)
    assert sharded.manifest["sharded"]["shards"] == ["shards/0", "shards/1"]
    assert not (out / STORE_DIR).exists()                      # no store copied
    parts = [faiss_read(out / "shards" / str(i) / PART_FILE) for i in range(2)]
    assert all(n > 0 for n in parts) and sum(parts) + sharded.manifest["heldout_queries"] * 2 == len(sharded)
    ms, mm = single.manifest, sharded.manifest
    for key in ("index_type", "count", "nlist", "dim"):
        assert mm[key] == ms[key], key
    # trained on samples each shard draws (not the one-process rows): as good, not identical
    ids, x = single.store.all_embeddings(single.model_hash)
    q = x / np.linalg.norm(x, axis=1, keepdims=True)
    exact = ids[np.argsort(-(q @ x.T), axis=1, kind="stable")[:, :10]]
    rec = lambda found: float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(found, exact)]))  # noqa: E731
    assert rec(sharded.search_embeddings(x, 10)[1]) >= rec(single.search_embeddings(x, 10)[1]) - 0.03


def faiss_read(path: Path) -> int:
    import faiss

    return int(faiss.read_index(str(path), faiss.IO_FLAG_MMAP).ntotal)
