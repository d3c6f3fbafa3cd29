"""GalleryStore on a real LMDB environment with real image bytes."""
from __future__ import annotations

import hashlib
import pickle
import threading
from pathlib import Path

import lmdb
import numpy as np
import pytest

from indexer.store.gallery import GalleryStore, NewItem, id_for_sha256

MODEL = hashlib.sha256(b"some model").hexdigest()


def _item(path: Path, rel: str, label: str | None) -> NewItem:
    data = path.read_bytes()
    return NewItem(rel, label, data, hashlib.sha256(data).hexdigest(), 105, 105, len(data), 1)


def test_put_get_dedupe_and_embeddings(tmp_path: Path, omniglot_paths: list[Path]) -> None:
    files = omniglot_paths[:6]
    items = [_item(p, f"{p.parent.name}/{p.name}", p.parent.name) for p in files]
    # the same content under a second path: stored once, both paths resolve to it
    dup = _item(files[0], "elsewhere/copy.png", "elsewhere")
    emb = np.random.default_rng(0).normal(size=(7, 8)).astype(np.float32)
    with GalleryStore(tmp_path / "s", readonly=False) as st:
        assert st.put_items(items + [dup], emb, MODEL) == 6
        assert len(st) == 6
        i0 = items[0].id
        assert st.id_for_path("elsewhere/copy.png") == i0 == st.id_for_path(items[0].relpath)
        assert st.get_bytes(i0) == files[0].read_bytes()
        meta = st.get_meta(i0)
        assert meta["sha256"] == hashlib.sha256(files[0].read_bytes()).hexdigest()
        assert meta["paths"] == [items[0].relpath, "elsewhere/copy.png"]
        assert (meta["width"], meta["height"], meta["label"]) == (105, 105, files[0].parent.name)
        got = st.get_embeddings(MODEL, [items[2].id, items[1].id])
        np.testing.assert_array_equal(got, emb[[2, 1]])
        ids, x = st.all_embeddings(MODEL)
        assert list(ids) == sorted(it.id for it in items) and x.shape == (6, 8)
        assert sorted(st.labels()) == sorted({p.parent.name for p in files})
        assert sorted(st.ids_for_label(files[0].parent.name)) == sorted(
            it.id for it in items if it.label == files[0].parent.name)
        with pytest.raises(KeyError, match="not in the gallery store"):
            st.get_meta(12345)


def test_snapshot_and_missing_embeddings(tmp_path: Path, omniglot_paths: list[Path]) -> None:
    items = [_item(p, f"c/{p.name}", "c") for p in omniglot_paths[:3]]
    other = hashlib.sha256(b"another model").hexdigest()
    st = GalleryStore(tmp_path / "s", readonly=False)
    assert st.snapshot(MODEL, ["c/x.png"]).paths == {} and not st.exists   # not created by a look
    with st:
        st.put_items(items[:2], np.ones((2, 4), np.float32), MODEL)
        st.put_items(items[2:])                                   # stored, embedded by no model
        snap = st.snapshot(MODEL, [items[0].relpath, items[2].relpath, "c/unknown.png"])
        assert snap.embedded == {items[0].id, items[1].id}
        assert snap.paths == {it.relpath: (it.id, it.size, it.mtime_ns) for it in (items[0], items[2])}
        assert st.missing_embeddings(MODEL) == [items[2].id]
        assert st.missing_embeddings(other) == sorted(it.id for it in items)


def test_iter_embeddings_reads_one_model_in_chunks_and_only_stored_ids(tmp_path: Path,
                                                                       omniglot_paths: list[Path]) -> None:
    """The public seam the shards' sources read through (no other module knows the key layout):
    ascending ids in chunks of ``size``, this model's vectors only, a removed item's embedding
    never returned, ids alone with ``vectors=False``."""
    items = [_item(p, f"c/{p.name}", "c") for p in omniglot_paths[:7]]
    emb = np.random.default_rng(1).normal(size=(7, 4)).astype(np.float32)
    other = hashlib.sha256(b"another model").hexdigest()
    with GalleryStore(tmp_path / "s", readonly=False) as st:
        st.put_items(items, emb, MODEL)
        st.put_embeddings(other, [items[0].id], emb[:1] + 1)
        st.remove_id(items[3].id)
        chunks = list(st.iter_embeddings(MODEL, 2))
        want = sorted((it.id, j) for j, it in enumerate(items) if j != 3)
        assert [len(i) for i, _ in chunks] == [2, 2, 2]
        np.testing.assert_array_equal(np.concatenate([i for i, _ in chunks]), [i for i, _ in want])
        np.testing.assert_array_equal(np.concatenate([x for _, x in chunks]), emb[[j for _, j in want]])
        ids_only = list(st.iter_embeddings(MODEL, 4, vectors=False))
        assert [x.shape for _, x in ids_only] == [(4, 0), (2, 0)]
        np.testing.assert_array_equal(np.concatenate([i for i, _ in ids_only]), [i for i, _ in want])
        [(i, x)] = st.iter_embeddings(other)
        assert list(i) == [items[0].id] and np.allclose(x, emb[:1] + 1)
        assert list(st.iter_embeddings(hashlib.sha256(b"none").hexdigest())) == []


def test_ids_are_content_derived_and_js_safe(omniglot_paths: list[Path]) -> None:
    shas = [hashlib.sha256(p.read_bytes()).hexdigest() for p in omniglot_paths]
    ids = [id_for_sha256(s) for s in shas]
    assert len(set(ids)) == len(set(shas))
    assert all(0 <= i < 2 ** 53 for i in ids)


def test_remove_path_promotes_alias_then_removes_content(tmp_path: Path, omniglot_paths: list[Path]) -> None:
    p = omniglot_paths[0]
    a, b = _item(p, "x/a.png", "x"), _item(p, "y/b.png", "y")
    with GalleryStore(tmp_path / "s", readonly=False) as st:
        st.put_items([a, b], np.ones((2, 4), np.float32), MODEL)
        assert st.remove_path("x/a.png") == (a.id, False)
        m = st.get_meta(a.id)
        assert (m["path"], m["label"]) == ("y/b.png", "y")
        assert st.ids_for_label("x") == [] and st.ids_for_label("y") == [a.id]
        assert st.remove_path("y/b.png") == (a.id, True)
        assert len(st) == 0 and a.id not in st
        with pytest.raises(KeyError):     # the embedding went with the item
            st.get_embeddings(MODEL, [a.id])
        assert st.remove_path("y/b.png") is None


def test_changed_content_at_same_path_replaces_old_entry(tmp_path: Path, omniglot_paths: list[Path]) -> None:
    old, new = _item(omniglot_paths[0], "c/img.png", "c"), _item(omniglot_paths[1], "c/img.png", "c")
    with GalleryStore(tmp_path / "s", readonly=False) as st:
        st.put_items([old], np.ones((1, 4), np.float32), MODEL)
        st.put_items([new], np.ones((1, 4), np.float32), MODEL)
        assert len(st) == 1 and st.id_for_path("c/img.png") == new.id and old.id not in st


def test_map_grows_when_full(tmp_path: Path, photo_paths: list[Path]) -> None:
    """MDB_MAP_FULL is handled by growing the map, not by failing the batch."""
    items = [_item(p, p.name, None) for p in photo_paths]
    total = sum(len(i.data) for i in items)
    with GalleryStore(tmp_path / "s", readonly=False, map_size=64 * 1024) as st:
        start = st.map_size
        assert total > start
        st.put_items(items)
        assert st.map_size > start and len(st) == len(items)
        assert st.get_bytes(items[-1].id) == items[-1].data


def test_readonly_reader_is_lazy_picklable_and_thread_safe(tmp_path: Path, omniglot_paths: list[Path]) -> None:
    items = [_item(p, f"{i}.png", None) for i, p in enumerate(omniglot_paths)]
    with GalleryStore(tmp_path / "s", readonly=False) as st:
        st.put_items(items)
    reader = pickle.loads(pickle.dumps(GalleryStore(tmp_path / "s")))   # no env opened yet
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for it in items:
                assert reader.get_bytes(it.id) == it.data
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    with pytest.raises(Exception, match="read-only"):
        reader.put_items(items[:1])


def test_missing_store_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="no gallery store"):
        GalleryStore(tmp_path / "nothing")


def test_write_is_atomic_on_failure(tmp_path: Path, omniglot_paths: list[Path]) -> None:
    """A batch that fails half-way leaves nothing behind (one transaction per batch)."""
    items = [_item(p, f"{i}.png", None) for i, p in enumerate(omniglot_paths[:4])]
    with GalleryStore(tmp_path / "s", readonly=False) as st:
        with pytest.raises(ValueError):
            st.put_items(items, np.ones((3, 4), np.float32), MODEL)   # wrong row count
        bad = items[:2] + [NewItem("z.png", None, b"x", "zz", 1, 1)]    # bad sha: fails mid-batch
        with pytest.raises((ValueError, lmdb.Error)):
            st.put_items(bad, np.ones((3, 4), np.float32), MODEL)
        assert len(st) == 0 and st.id_for_path("0.png") is None
