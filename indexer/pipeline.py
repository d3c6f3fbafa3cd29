"""Ingest: read gallery files, dedupe by content, embed while decoding, commit in batches.

The commit unit is one LMDB transaction holding the bytes, metadata, paths and embeddings of a
few batches, so a build killed at any moment leaves only whole entries behind, and a rerun picks
up exactly the files that are not committed yet (quick check: same size and mtime, then sha256).
"""
from __future__ import annotations

import hashlib
import io
import os
import queue
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from .errors import IndexerError
from .store import GalleryStore, NewItem, id_for_sha256
from .walk import GalleryFile


@dataclass
class IngestStats:
    """What one ingest did; printed as the summary and stored in the manifest."""

    found: int = 0
    new: int = 0            # new content committed (bytes + embedding)
    unchanged: int = 0      # path already stored with the same size/mtime or the same sha256
    duplicates: int = 0     # identical content under another path: stored once, path recorded
    embedded: int = 0       # embeddings computed (new content + stored content new to the model)
    skipped: list[dict] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.found} files: {self.new} new, {self.unchanged} unchanged, "
                f"{self.duplicates} duplicate content, {len(self.skipped)} skipped; "
                f"{self.embedded} embedded")


def _header_size(data: bytes) -> tuple[int, int]:
    """Width and height from the header only (the full decode happens in the embedder)."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as im:
                return im.size
    except Exception:  # noqa: BLE001 - the embedder's load_image names the real reason
        return (0, 0)


def _normalise(emb: np.ndarray) -> np.ndarray:
    emb = np.ascontiguousarray(emb, dtype=np.float32)
    norms = np.linalg.norm(emb, axis=1, keepdims=True)
    return emb / np.maximum(norms, 1e-12)


def ingest(store: GalleryStore, files: Sequence[GalleryFile], embedder: Any, *,
           workers: int | None = None, commit_every: int = 256, progress: bool = True) -> IngestStats:
    """Bring ``files`` into ``store`` with embeddings from ``embedder`` (an OnnxEmbedder)."""
    stats = IngestStats(found=len(files))
    model_hash: str = embedder.model_hash
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(files), desc="indexing", unit="img")

    def tick(n: int = 1) -> None:
        if bar is not None:
            bar.update(n)

    seen: dict[str, str] = {}                # sha256 -> first relpath of this run
    aliases: list[NewItem] = []              # same content as an earlier file of this run
    failed: dict[str, str] = {}              # sha256 -> reason (aliases of a bad file are bad too)

    def to_embed() -> Iterator[tuple[NewItem, bytes]]:
        for f in files:
            if f.problem:
                stats.skipped.append({"path": f.relpath, "reason": f.problem})
                tick()
                continue
            try:
                st = f.abspath.stat()
                rec, _, embedded = store.ingest_status(f.relpath, None, model_hash)
                if (rec is not None and rec[1] == st.st_size and rec[2] == st.st_mtime_ns
                        and embedded):
                    stats.unchanged += 1
                    tick()
                    continue
                data = f.abspath.read_bytes()
            except OSError as e:
                stats.skipped.append({"path": f.relpath, "reason": f"unreadable: {e.strerror or e}"})
                tick()
                continue
            sha = hashlib.sha256(data).hexdigest()
            i = id_for_sha256(sha)
            _, stored, embedded = store.ingest_status(f.relpath, i, model_hash)
            if rec is not None and rec[0] == i and embedded:
                store.touch_path(f.relpath, i, st.st_size, st.st_mtime_ns)   # touched, same content
                stats.unchanged += 1
                tick()
                continue
            w, h = _header_size(data)
            item = NewItem(f.relpath, f.label, data, sha, w, h, st.st_size, st.st_mtime_ns)
            if sha in seen or embedded:
                aliases.append(item)
                tick()
                continue
            seen[sha] = f.relpath
            yield item, data

    pending_items: list[NewItem] = []
    pending_emb: list[np.ndarray] = []

    # Commits (LMDB write + fsync) run on one writer thread, overlapping the next batches'
    # inference; at most one commit is in flight, so order and memory stay bounded.
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="indexer-commit")
    in_flight: list[Future] = []

    def commit(items: list[NewItem], emb: np.ndarray) -> None:
        stats.new += store.put_items(items, emb, model_hash)
        stats.embedded += len(items)

    def flush() -> None:
        while in_flight:
            in_flight.pop().result()      # re-raises a failed commit here
        if pending_items:
            in_flight.append(writer.submit(commit, list(pending_items), np.concatenate(pending_emb)))
            pending_items.clear()
            pending_emb.clear()

    try:
        for keys, emb, failures in embedder.embed_iter(_prefetch(to_embed()), workers=workers):
            for item, err in failures:
                reason = getattr(err, "reason", str(err))
                failed[item.sha256] = reason
                stats.skipped.append({"path": item.relpath, "reason": reason})
            if keys:
                emb = _check_dim(emb, embedder)
                pending_items.extend(keys)
                pending_emb.append(_normalise(emb))
            tick(len(keys) + len(failures))
            if len(pending_items) >= commit_every:
                flush()
        flush()
        flush()       # waits for the last commit
        good = [a for a in aliases if a.sha256 not in failed]
        for a in aliases:
            if a.sha256 in failed:
                stats.skipped.append({"path": a.relpath, "reason": failed[a.sha256]})
        for s in range(0, len(good), commit_every):
            store.put_items(good[s:s + commit_every])
        stats.duplicates = len(good)
    finally:
        writer.shutdown(wait=True)
        if bar is not None:
            bar.close()
    stats.embedded += embed_missing(store, embedder, workers=workers, progress=progress)
    return stats


def _prefetch(gen: Iterator[Any], depth: int = 512) -> Iterator[Any]:
    """Run a generator in its own thread, ``depth`` items ahead.

    Reading, hashing and the store look-ups of the next files then overlap with decoding and
    inference instead of stalling the embedder's feeding loop (file I/O and sha256 release the
    GIL). Exceptions are re-raised in the consumer.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def run() -> None:
        try:
            for item in gen:
                while not stop.is_set():
                    try:
                        q.put((None, item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put((e, None))
        q.put((None, done))

    t = threading.Thread(target=run, name="indexer-read", daemon=True)
    t.start()
    try:
        while True:
            err, item = q.get()
            if err is not None:
                raise err
            if item is done:
                return
            yield item
    finally:
        stop.set()
        t.join(timeout=5)


def _check_dim(emb: np.ndarray, embedder: Any) -> np.ndarray:
    if emb.ndim != 2 or emb.shape[1] != embedder.dim:
        raise IndexerError(f"{embedder.path}: model says dim {embedder.dim} but produced "
                           f"embeddings of shape {tuple(emb.shape)}")
    return emb


def embed_missing(store: GalleryStore, embedder: Any, *, ids: Iterable[int] | None = None,
                  workers: int | None = None, progress: bool = True, commit_every: int = 256) -> int:
    """Embed stored content that has no embedding for this model yet (a rebuild with a new model).

    Reads the original bytes back from the store, so the gallery folder need not exist any more.
    """
    model_hash = embedder.model_hash
    todo = [int(i) for i in (store.ids() if ids is None else ids)
            if not store.has_embedding(model_hash, int(i))]
    if not todo:
        return 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc="re-embedding stored images", unit="img")
    done = 0
    buf_ids: list[int] = []
    buf_emb: list[np.ndarray] = []
    try:
        items = ((i, store.get_bytes(i)) for i in todo)
        for keys, emb, failures in embedder.embed_iter(items, workers=workers):
            if keys:
                buf_ids.extend(keys)
                buf_emb.append(_normalise(_check_dim(emb, embedder)))
            for i, err in failures:   # stored bytes decoded before; a new model's loader may differ
                warnings.warn(f"id {i}: {getattr(err, 'reason', err)}; left out of this model's index")
            if bar is not None:
                bar.update(len(keys) + len(failures))
            if len(buf_ids) >= commit_every:
                store.put_embeddings(model_hash, buf_ids, np.concatenate(buf_emb))
                done += len(buf_ids)
                buf_ids, buf_emb = [], []
        if buf_ids:
            store.put_embeddings(model_hash, buf_ids, np.concatenate(buf_emb))
            done += len(buf_ids)
    finally:
        if bar is not None:
            bar.close()
    return done


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))
