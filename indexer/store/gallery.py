"""The gallery store: one LMDB environment holding every image's bytes, metadata and embeddings.
Why LMDB: a batch is one transaction, so a killed build leaves no half-written entry. Ids derive
from the content hash: stable across reruns, shards and machines, identical content stored once.
Named sub-databases:
    meta   id(8B)                 -> JSON {path, paths, label, width, height, sha256, bytes}
    blob   id(8B)                 -> original file bytes
    path   relpath (UTF-8)        -> id(8B) + size(8B) + mtime_ns(8B)   (quick "unchanged" check)
    label  label (UTF-8), dupsort -> id(8B)
    emb    model sha256(32B)+id   -> float32 embedding
    info   key                    -> JSON (models seen, ...)
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import lmdb
import numpy as np

from embedder.folders import label_of

from ..errors import IndexerError
from .lmdb_env import LmdbStore

ID_BITS = 53          # ids stay exact in JavaScript (Number.MAX_SAFE_INTEGER == 2**53 - 1)
_PATHREC = struct.Struct(">QQq")
_NONE = np.zeros(0, dtype=np.float32)      # iter_embeddings(vectors=False)'s row


def id_for_sha256(sha256_hex: str) -> int:
    """The stable integer id of a piece of content: the top 53 bits of its sha256."""
    return int(sha256_hex[:14], 16) >> (56 - ID_BITS)


def _k(i: int) -> bytes:
    return int(i).to_bytes(8, "big")


def _model_key(model_hash: str) -> bytes:
    try:
        raw = bytes.fromhex(model_hash)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"model hash {model_hash!r}: expected 64 hex digits (sha256)")
    return raw


@dataclass
class NewItem:
    """An image read from disk, validated, ready to be committed."""

    relpath: str
    label: str | None
    data: bytes
    sha256: str
    width: int
    height: int
    size: int = 0
    mtime_ns: int = 0

    @property
    def id(self) -> int:
        return id_for_sha256(self.sha256)


@dataclass
class Snapshot:
    """What a store held for one model before an ingest (:meth:`GalleryStore.snapshot`)."""

    paths: dict[str, tuple[int, int, int]]   # relpath -> (id, size, mtime_ns), paths asked about
    embedded: set[int]                        # ids stored *and* embedded by the model


class GalleryStore(LmdbStore):
    """LMDB-backed gallery, opened lazily per process (picklable before first use). Read-only is
    safe for many threads and processes while one writer works (:mod:`indexer.store.lmdb_env`);
    writers grow the map when it fills."""

    NAMES = ("meta", "blob", "path", "label", "emb", "info")
    DUPSORT = ("label",)

    def __init__(self, path: str | Path, *, readonly: bool = True,
                 map_size: int | None = None) -> None:
        """``map_size``: a writer's initial map (default 1 GiB; it doubles when full); a
        reader's mapping (default: the size recorded in the file; it follows the writer)."""
        super().__init__(path, readonly=readonly, map_size=map_size)
        if readonly and not self.exists:
            raise IndexerError(f"{self.path}: no gallery store here (expected {self.path / 'data.mdb'})")

    # ------------------------------------------------------------------ reads
    def __len__(self) -> int:
        with self._read() as txn:
            return txn.stat(self._db("meta"))["entries"]

    def __contains__(self, id: object) -> bool:
        with self._read() as txn:
            return txn.get(_k(int(id)), db=self._db("meta")) is not None  # type: ignore[arg-type]

    def ids(self) -> np.ndarray:
        """All ids, ascending."""
        with self._read() as txn:
            keys = list(txn.cursor(db=self._db("meta")).iternext(keys=True, values=False))
        return np.array([int.from_bytes(k, "big") for k in keys], dtype=np.int64)

    def _get(self, db: str, id: int) -> bytes:
        with self._read() as txn:
            raw = txn.get(_k(id), db=self._db(db))
        if raw is None:
            raise KeyError(f"id {id} is not in the gallery store {self.path}")
        return bytes(raw)

    def get_meta(self, id: int) -> dict:
        return {**json.loads(self._get("meta", id)), "id": int(id)}

    def get_metas(self, ids: Sequence[int]) -> dict[int, dict]:
        """The records of those of ``ids`` the store holds, in one read transaction: a search's
        k results cost one read and one file check, not k (0.75 ms of a 10 ms query at k = 10)."""
        db = self._db("meta")
        with self._read() as txn:
            raw = {int(i): txn.get(_k(int(i)), db=db) for i in ids}
        return {i: {**json.loads(r), "id": i} for i, r in raw.items() if r is not None}

    def get_bytes(self, id: int) -> bytes:
        return self._get("blob", id)

    def path_record(self, relpath: str) -> tuple[int, int, int] | None:
        """(id, size, mtime_ns) recorded for a relative path, or None."""
        with self._read() as txn:
            raw = txn.get(relpath.encode("utf-8"), db=self._db("path"))
        return None if raw is None else _PATHREC.unpack(raw)

    def path_ids(self) -> np.ndarray:
        """The id of every file the store holds, one per path (identical files are one id under
        several paths: what the audit lists as exact copies)."""
        with self._read() as txn:
            cur = txn.cursor(db=self._db("path"))
            return np.fromiter((_PATHREC.unpack(v)[0] for v in cur.iternext(keys=False)), np.int64)

    def paths(self) -> list[str]:
        """Every stored path, in path order."""
        with self._read() as txn:
            return [k.decode("utf-8") for k in txn.cursor(db=self._db("path")).iternext(keys=True, values=False)]

    def path_sample(self, n: int) -> list[str]:
        """About ``n`` stored paths spread evenly over path order (every folder's share)."""
        with self._read() as txn:
            step = max(1, txn.stat(self._db("path"))["entries"] // max(1, n))
            keys = txn.cursor(db=self._db("path")).iternext(keys=True, values=False)
            return [k.decode("utf-8") for i, k in enumerate(keys) if i % step == 0]

    def paths_under(self, folder: str) -> list[str]:
        """The stored paths under ``folder`` ("dogs/": dogs/a.jpg, dogs/pug/b.jpg), in path order."""
        prefix = folder.rstrip("/").encode("utf-8") + b"/"
        out = []
        with self._read() as txn:
            cur = txn.cursor(db=self._db("path"))
            if cur.set_range(prefix):
                for k in cur.iternext(keys=True, values=False):
                    if not k.startswith(prefix):
                        break
                    out.append(k.decode("utf-8"))
        return out

    def remove_paths(self, relpaths: Sequence[str]) -> int:
        """Delete paths in one transaction (an id goes with its last path); how many ids went."""
        def fn(txn: lmdb.Transaction) -> int:
            gone = 0
            for p in relpaths:
                raw = txn.get(p.encode("utf-8"), db=self._dbs["path"])
                if raw is not None:
                    gone += self._detach_path(txn, p, _PATHREC.unpack(raw)[0])
            return gone

        return self.write(fn)

    def paths_of(self, ids: set[int]) -> dict[int, list[str]]:
        """The relative paths of each of ``ids`` (in path order; ids without a path left out)."""
        out: dict[int, list[str]] = {}
        with self._read() as txn:
            for k, v in txn.cursor(db=self._db("path")):
                i = _PATHREC.unpack(v)[0]
                if i in ids:
                    out.setdefault(i, []).append(k.decode("utf-8"))
        return out

    def id_for_path(self, rel_path: str) -> int | None:
        rec = self.path_record(str(rel_path))
        return None if rec is None else rec[0]

    def ids_for_label(self, label: str) -> list[int]:
        with self._read() as txn:
            cur = txn.cursor(db=self._db("label"))
            if not cur.set_key(label.encode("utf-8")):
                return []
            return [int.from_bytes(v, "big") for v in cur.iternext_dup()]

    def labels(self) -> list[str]:
        with self._read() as txn:
            cur = txn.cursor(db=self._db("label"))
            return [k.decode("utf-8") for k in cur.iternext_nodup(keys=True, values=False)]

    def info(self, key: str, default: Any = None) -> Any:
        with self._read() as txn:
            raw = txn.get(key.encode(), db=self._db("info"))
        return default if raw is None else json.loads(raw)

    def models(self) -> list[str]:
        """Hashes of the models that have embedded something into this store."""
        return list(self.info("models", []))

    def iter_embeddings(self, model_hash: str, size: int = 65_536, *, vectors: bool = True
                        ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids ascending, float32 embeddings) of the stored items embedded by ``model_hash``,
        ``size`` at a time in one read transaction (never all at once); only ids still stored
        count. ``vectors=False``: the ids only (embeddings (n, 0))."""
        mk, ids, rows = _model_key(model_hash), [], []
        with self._read() as txn:
            meta, cur = self._db("meta"), txn.cursor(db=self._db("emb"))
            for kv in (cur.iternext(keys=True, values=vectors) if cur.set_range(mk) else ()):
                k, v = kv if vectors else (kv, None)
                if not k.startswith(mk):
                    break
                if txn.get(k[32:], db=meta) is None:
                    continue
                ids.append(int.from_bytes(k[32:], "big"))
                rows.append(np.frombuffer(v, dtype=np.float32) if vectors else _NONE)
                if len(ids) == size:
                    yield np.array(ids, dtype=np.int64), np.stack(rows)
                    ids, rows = [], []
        if ids:
            yield np.array(ids, dtype=np.int64), np.stack(rows)

    def snapshot(self, model_hash: str, relpaths: Iterable[str]) -> Snapshot:
        """What the store holds for ``model_hash`` and ``relpaths``, read in one transaction; a
        store not created yet stays so (its creation belongs to the writer's first commit)."""
        snap = Snapshot({}, set())
        if not self.exists or len(self) == 0:
            return snap
        snap.embedded.update(int(i) for c, _ in self.iter_embeddings(model_hash, vectors=False) for i in c)
        with self._read() as txn:
            path_db = self._db("path")
            for p in relpaths:
                raw = txn.get(p.encode("utf-8"), db=path_db)
                if raw is not None:
                    snap.paths[p] = _PATHREC.unpack(raw)
        return snap

    def missing_embeddings(self, model_hash: str) -> list[int]:
        """Stored ids without an embedding by ``model_hash`` (a rebuild with a new model)."""
        have = {int(i) for c, _ in self.iter_embeddings(model_hash, vectors=False) for i in c}
        return [int(i) for i in self.ids() if int(i) not in have]

    def get_embeddings(self, model_hash: str, ids: Sequence[int]) -> np.ndarray:
        """Stored embeddings for ``ids`` (in that order); KeyError names a missing one."""
        mk = _model_key(model_hash)
        out: np.ndarray | None = None       # filled in place: a list of rows + np.stack held
        with self._read() as txn:           # the sample about twice (the streaming plan's peak)
            db = self._db("emb")
            for j, i in enumerate(ids):
                raw = txn.get(mk + _k(int(i)), db=db)
                if raw is None:
                    raise KeyError(f"id {int(i)} has no embedding for model {model_hash[:12]}")
                if out is None:
                    out = np.empty((len(ids), len(raw) // 4), dtype=np.float32)
                out[j] = np.frombuffer(raw, dtype=np.float32)
        return np.zeros((0, 0), dtype=np.float32) if out is None else out

    def embedded_ids(self, model_hash: str) -> np.ndarray:
        """The ids :meth:`all_embeddings` returns, without reading the vectors."""
        parts = [i for i, _ in self.iter_embeddings(model_hash, vectors=False)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def all_embeddings(self, model_hash: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids ascending, embeddings) of every stored item embedded by ``model_hash``."""
        parts = list(self.iter_embeddings(model_hash))
        if not parts:
            return np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.float32)
        return np.concatenate([i for i, _ in parts]), np.concatenate([x for _, x in parts])

    # ------------------------------------------------------------------ writes
    def _register_model(self, txn: lmdb.Transaction, model_hash: str) -> None:
        db = self._dbs["info"]
        raw = txn.get(b"models", db=db)
        models = json.loads(raw) if raw else []
        if model_hash not in models:
            models.append(model_hash)
            txn.put(b"models", json.dumps(models).encode(), db=db)

    def put_items(self, items: Sequence[NewItem], embeddings: np.ndarray | None = None,
                  model_hash: str | None = None) -> int:
        """Commit a batch atomically: bytes, metadata, paths and (optionally) embeddings. Known
        content gains the path as an alias; a path that held other content moves to the new
        content. Returns how many items were new content."""
        if embeddings is not None:
            if model_hash is None:
                raise ValueError("embeddings need the model hash they were made with")
            embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
            if len(embeddings) != len(items):
                raise ValueError(f"{len(items)} items but {len(embeddings)} embeddings")
            mk = _model_key(model_hash)

        def fn(txn: lmdb.Transaction) -> int:
            new = 0
            if embeddings is not None:
                self._register_model(txn, model_hash)  # type: ignore[arg-type]
            for j, it in enumerate(items):
                key = _k(it.id)
                raw = txn.get(key, db=self._dbs["meta"])
                if raw is None:
                    meta = {"path": it.relpath, "paths": [it.relpath], "label": it.label,
                            "width": it.width, "height": it.height, "sha256": it.sha256,
                            "bytes": len(it.data)}
                    txn.put(key, it.data, db=self._dbs["blob"])
                    txn.put(key, json.dumps(meta).encode(), db=self._dbs["meta"])
                    if it.label is not None:
                        txn.put(it.label.encode("utf-8"), key, db=self._dbs["label"])
                    new += 1
                else:
                    meta = json.loads(raw)
                    if meta["sha256"] != it.sha256:
                        raise IndexerError(
                            f"{it.relpath}: id {it.id} collides with {meta['path']} (different "
                            "content, same 53-bit id); rename or drop one of them")
                self._attach_path(txn, it.relpath, it.id, it.size, it.mtime_ns)
                if embeddings is not None:
                    txn.put(mk + key, embeddings[j].tobytes(), db=self._dbs["emb"])
            return new

        return self.write(fn)

    def put_embeddings(self, model_hash: str, ids: Sequence[int], embeddings: np.ndarray) -> None:
        mk = _model_key(model_hash)
        embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)

        def fn(txn: lmdb.Transaction) -> None:
            self._register_model(txn, model_hash)
            for i, e in zip(ids, embeddings):
                if txn.get(_k(i), db=self._dbs["meta"]) is not None:   # removed meanwhile: skip
                    txn.put(mk + _k(i), e.tobytes(), db=self._dbs["emb"])

        self.write(fn)

    def touch_paths(self, touched: Sequence[tuple[str, int, int, int]]) -> None:
        """Record new (relpath, id, size, mtime_ns) for unchanged paths (content hash matched), in
        one transaction: a gallery copied or remounted touches every path (25,311 of them one
        transaction each: 8.2 s of a 50 s rebuild)."""
        def fn(txn: lmdb.Transaction) -> None:
            for relpath, id, size, mtime_ns in touched:
                txn.put(relpath.encode("utf-8"), _PATHREC.pack(id, size, mtime_ns), db=self._dbs["path"])

        if touched:
            self.write(fn)

    def _attach_path(self, txn: lmdb.Transaction, relpath: str, id: int, size: int,
                     mtime_ns: int) -> None:
        pk = relpath.encode("utf-8")
        old = txn.get(pk, db=self._dbs["path"])
        if old is not None:
            old_id = _PATHREC.unpack(old)[0]
            if old_id != id:
                self._detach_path(txn, relpath, old_id)
        txn.put(pk, _PATHREC.pack(id, size, mtime_ns), db=self._dbs["path"])
        raw = txn.get(_k(id), db=self._dbs["meta"])
        meta = json.loads(raw)
        if relpath not in meta["paths"]:
            meta["paths"].append(relpath)
            txn.put(_k(id), json.dumps(meta).encode(), db=self._dbs["meta"])

    def _detach_path(self, txn: lmdb.Transaction, relpath: str, id: int) -> bool:
        """Drop one path of an id; the id itself goes when its last path goes. True if it went."""
        txn.delete(relpath.encode("utf-8"), db=self._dbs["path"])
        key = _k(id)
        raw = txn.get(key, db=self._dbs["meta"])
        if raw is None:
            return True
        meta = json.loads(raw)
        if relpath in meta["paths"]:
            meta["paths"].remove(relpath)
        if not meta["paths"]:
            self._delete_id(txn, id, meta)
            return True
        if meta["path"] == relpath:    # promote the next alias, and move the label with it
            if meta["label"] is not None:
                txn.delete(meta["label"].encode("utf-8"), key, db=self._dbs["label"])
            meta["path"] = meta["paths"][0]
            meta["label"] = label_of(meta["path"])
            if meta["label"] is not None:
                txn.put(meta["label"].encode("utf-8"), key, db=self._dbs["label"])
        txn.put(key, json.dumps(meta).encode(), db=self._dbs["meta"])
        return False

    def _delete_id(self, txn: lmdb.Transaction, id: int, meta: dict) -> None:
        key = _k(id)
        for p in meta["paths"]:
            txn.delete(p.encode("utf-8"), db=self._dbs["path"])
        if meta.get("label") is not None:
            txn.delete(meta["label"].encode("utf-8"), key, db=self._dbs["label"])
        txn.delete(key, db=self._dbs["blob"])
        txn.delete(key, db=self._dbs["meta"])
        raw = txn.get(b"models", db=self._dbs["info"])
        for m in json.loads(raw) if raw else []:
            txn.delete(_model_key(m) + key, db=self._dbs["emb"])

    def remove_id(self, id: int) -> bool:
        """Delete one item with all its paths and embeddings. False if it was not there."""
        def fn(txn: lmdb.Transaction) -> bool:
            raw = txn.get(_k(id), db=self._dbs["meta"])
            if raw is None:
                return False
            self._delete_id(txn, id, json.loads(raw))
            return True

        return self.write(fn)

    def remove_path(self, relpath: str) -> tuple[int, bool] | None:
        """Delete one path: (id, whether the content itself went), or None if unknown."""
        def fn(txn: lmdb.Transaction) -> tuple[int, bool] | None:
            raw = txn.get(relpath.encode("utf-8"), db=self._dbs["path"])
            if raw is None:
                return None
            i = _PATHREC.unpack(raw)[0]
            return i, self._detach_path(txn, relpath, i)

        return self.write(fn)

    def copy_from(self, other: "GalleryStore", model_hash: str, done: Callable[[int], Any] | None = None) -> int:
        """Copy every item of ``other`` (bytes, metadata, paths, its embedding) into this store
        (``indexer merge``), ``done(n)`` after each batch of n; idempotent: a killed merge is rerun."""
        ids = other.ids()
        copied = 0
        for s in range(0, len(ids), 256):
            chunk = ids[s:s + 256]
            items, embs = [], []
            for i in chunk:
                m = other.get_meta(int(i))
                data = other.get_bytes(int(i))
                emb = other.get_embeddings(model_hash, [int(i)])[0]
                for p in m["paths"]:
                    rec = other.path_record(p) or (int(i), 0, 0)
                    items.append(NewItem(p, label_of(p), data, m["sha256"], m["width"],
                                         m["height"], rec[1], rec[2]))
                    embs.append(emb)
            copied += self.put_items(items, np.stack(embs), model_hash)
            if done is not None:
                done(len(chunk))
        return copied
