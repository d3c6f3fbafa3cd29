"""One writer per index directory, and the count check that notices when writers went wrong.

Before the writer lock, two `indexer add` runs at once into one index left images in the store
that index.faiss never got (one run died saying "damaged", the other exited 0) and `indexer
info` said nothing. These tests run real CLI processes against real LMDB/faiss indexes."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from indexer import GalleryStore, Index, check_counts, writer_lock
from indexer.ann.faiss_index import index_ids
from indexer.directory.lock import holder, is_locked
from indexer.directory.validate import read_faiss
from indexer_testlib import REPO, copy_characters, run_cli


def _popen(*args: object) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "indexer", *map(str, args)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def index_copy(built_index: Path, tmp_path: Path) -> Path:
    out = tmp_path / "idx"
    shutil.copytree(built_index, out)
    return out


@pytest.fixture(scope="module")
def new_folders(tmp_path_factory, omniglot_root: Path) -> tuple[Path, Path]:
    """Two folders of Omniglot characters the built index does not hold (10 x 20 images each)."""
    a, b = tmp_path_factory.mktemp("add-a"), tmp_path_factory.mktemp("add-b")
    copy_characters(omniglot_root, a, 10, skip_chars=12)
    copy_characters(omniglot_root, b, 10, skip_chars=22)
    return a, b


def _assert_all_searchable(idx_dir: Path, folder: Path) -> None:
    """Every image of ``folder`` is stored, in index.faiss, and found by searching for itself."""
    files = sorted(folder.rglob("*.png"))
    with GalleryStore(idx_dir / "store.lmdb") as st:
        ids = [st.id_for_path(str(f.relative_to(folder))) for f in files]
    assert None not in ids, "an image of the finished add is not in the store"
    in_faiss = set(index_ids(read_faiss(idx_dir / "index.faiss")).tolist())
    assert set(ids) <= in_faiss, f"{len(set(ids) - in_faiss)} stored images missing from index.faiss"
    idx = Index.open(idx_dir)
    hits = idx.search(files, k=5)
    assert all(i in {h.id for h in hs} for i, hs in zip(ids, hits))


def _holds_the_lock(index: Path, p: subprocess.Popen) -> None:
    """Wait until ``p`` holds ``index``'s writer lock (it must not exit first)."""
    deadline = time.monotonic() + 120
    while not (is_locked(index) and (holder(index) or {}).get("pid") == p.pid):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.02)


def test_two_concurrent_adds_one_refused_nothing_lost(index_copy: Path, new_folders):
    """Two adds at once. The second starts while the first holds the lock, the first paused there
    (SIGSTOP): started together, the first could finish before the second's imports did (a loaded
    2-core run saw both exit 0, one after the other)."""
    a, b = new_folders
    procs = [_popen("add", a, "--index", index_copy, "--quiet")]
    _holds_the_lock(index_copy, procs[0])
    os.kill(procs[0].pid, signal.SIGSTOP)
    try:
        procs.append(_popen("add", b, "--index", index_copy, "--quiet"))
        procs[1].wait(timeout=300)
    finally:
        os.kill(procs[0].pid, signal.SIGCONT)
    outs = [p.communicate(timeout=300) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 1], (codes, outs)
    loser = codes.index(1)
    winner = 1 - loser
    err = outs[loser][1].strip()
    assert len(err.splitlines()) == 1, err
    assert f"index {index_copy} is being written by pid {procs[winner].pid} (indexer add" in err, err
    _assert_all_searchable(index_copy, (a, b)[winner])
    check = check_counts(index_copy)
    assert check.ok and not check.busy and check.faiss == check.store == 240 + 200, check.message
    assert run_cli("info", "--index", index_copy).returncode == 0
    # the refused add never touched the store: none of its images is there
    with GalleryStore(index_copy / "store.lmdb") as st:
        assert all(st.id_for_path(str(f.relative_to((a, b)[loser]))) is None
                   for f in (a, b)[loser].rglob("*.png"))


def test_writer_lock_refuses_and_waits(index_copy: Path, new_folders):
    """A writer holding the lock (this test process): `remove` refuses naming our pid; with
    --wait it blocks until the lock goes, then succeeds."""
    with GalleryStore(index_copy / "store.lmdb") as st:
        victim = str(int(st.ids()[0]))
    with writer_lock(index_copy, "test holder"):
        p = run_cli("remove", victim, "--index", index_copy, check=False, fresh=True)
        assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert f"is being written by pid {os.getpid()} (test holder" in p.stderr
        waiting = _popen("remove", victim, "--index", index_copy, "--wait")
        lines = []                                # the note is printed before it blocks on the lock
        while not lines or "waiting for it to finish" not in lines[-1]:
            lines.append(waiting.stderr.readline())
            assert lines[-1] and len(lines) < 50, lines
        assert f"is being written by pid {os.getpid()}" in lines[-1], lines
        assert waiting.poll() is None             # still blocked: we hold the lock
    out, err = waiting.communicate(timeout=120)
    assert waiting.returncode == 0, err
    assert f"removed id {victim}" in out
    assert check_counts(index_copy).ok


def test_kill9_of_the_lock_holder_frees_the_index(index_copy: Path, new_folders):
    a, b = new_folders
    p = _popen("add", a, "--index", index_copy, "--quiet")
    _holds_the_lock(index_copy, p)
    os.kill(p.pid, signal.SIGKILL)
    p.communicate()
    assert p.returncode == -signal.SIGKILL
    assert not is_locked(index_copy)              # the kernel dropped the dead holder's lock
    nxt = run_cli("add", b, "--index", index_copy, "--quiet", check=False)
    assert nxt.returncode == 0, nxt.stderr
    _assert_all_searchable(index_copy, b)
    check = check_counts(index_copy)
    assert check.ok, check.message               # whatever the killed add committed is indexed too


def test_inconsistent_index_info_exits_nonzero_naming_the_repair(index_copy: Path, small_onnx: Path):
    """Images committed to the store but not to index.faiss (what a writer dying between the two
    left behind): info exits 1 with one line naming both counts and `indexer repair`."""
    import hashlib

    import numpy as np

    from indexer.store.gallery import NewItem

    with GalleryStore(index_copy / "store.lmdb", readonly=False) as st:
        model = st.models()[0]
        first = int(st.ids()[0])
        base, dim = st.get_bytes(first), st.get_embeddings(model, [first]).shape[1]
        items = []
        for n in range(3):            # three new contents (a stored PNG plus trailing bytes)
            data = base + bytes([n]) * 8
            items.append(NewItem(f"extra/x{n}.png", "extra", data, hashlib.sha256(data).hexdigest(),
                                 105, 105))
        emb = np.random.default_rng(0).normal(size=(3, dim)).astype(np.float32)
        st.put_items(items, emb / np.linalg.norm(emb, axis=1, keepdims=True), model)
    p = run_cli("info", "--index", index_copy, check=False)
    assert p.returncode == 1, p.stdout
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert "counts differ: the store holds 243 images" in err and "index.faiss 240 vectors" in err, err
    assert f"python -m indexer repair --index {index_copy}" in err
    fixed = run_cli("repair", "--index", index_copy, "--quiet")
    assert "added 3" in fixed.stdout
    assert run_cli("info", "--index", index_copy).returncode == 0
    assert check_counts(index_copy).faiss == 243


def test_lock_is_reentrant_for_its_thread_only(tmp_path: Path):
    d = tmp_path / "idx"
    with writer_lock(d, "outer"):
        with writer_lock(d, "inner"):            # e.g. build --ray locks --out, then merges into it
            assert is_locked(d)
        assert is_locked(d)
        seen = []

        def other() -> None:
            try:
                with writer_lock(d, "other thread"):
                    seen.append("got it")
            except Exception as e:  # noqa: BLE001
                seen.append(str(e))

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert seen and "is being written by pid" in seen[0], seen
    assert not is_locked(d)
