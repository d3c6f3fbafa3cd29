"""Ingest: read gallery files, dedupe by content, embed while decoding, commit in batches.

The commit unit is one LMDB transaction holding the bytes, metadata, paths and embeddings of a
few batches, so a build killed at any moment leaves only whole entries behind, and a rerun picks
up exactly the files that are not committed yet (quick check: same size and mtime, then sha256).

Why the hot path looks the way it does: with a tiny model (small_cnn, 28 px) inference costs
about as much as the per-image bookkeeping, so every image is touched once. A decode thread
reads a *chunk* of files (one batch) and, from the same bytes, hashes, reads the header size and
decodes + preprocesses; the main thread only stacks ready arrays, runs the session and hands
whole batches to one writer thread (one LMDB transaction, one fsync per ``commit_every``
images). The store's state before the run is read once up front, so no thread reads LMDB per
image (reads would queue behind the writer's commits on the store's lock).
"""
from __future__ import annotations

import hashlib
import io
import os
import queue
import struct
import threading
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from .errors import IndexerError
from .store import _PATHREC, GalleryStore, NewItem, _model_key, id_for_sha256
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


_PNG_SIG = b"\x89PNG\r\n\x1a\n"
_PNG_IHDR = struct.Struct(">4sII")


def _header_size(data: bytes) -> tuple[int, int]:
    """Width and height from the header only (the full decode happens in ``prepare``).

    PNG (the common gallery format, and Omniglot's) is read straight from its IHDR chunk, which
    is what PIL reports too, without opening the image a second time; other formats go
    through PIL's lazy open. (0, 0) when the header is unreadable: the decode names the reason.
    """
    if len(data) >= 24 and data[:8] == _PNG_SIG:
        tag, w, h = _PNG_IHDR.unpack_from(data, 12)
        if tag == b"IHDR" and w > 0 and h > 0:
            return w, h
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


# Outcome kinds of reading one file in a decode thread (plain ints: compared per image).
_SKIP, _UNCHANGED, _TOUCH, _KNOWN, _DECODED, _FAILED = range(6)


@dataclass
class _StoreState:
    """What the store held before this ingest, read in one pass (a fresh build reads nothing).

    ``paths``: relpath -> (id, size, mtime_ns, embedded by this model) for the files to ingest;
    ``embedded``: ids whose content is stored *and* embedded by this model. Content committed
    during the run is tracked by the run itself (its ``seen`` set), so this snapshot is enough.
    """

    paths: dict[str, tuple[int, int, int, bool]]
    embedded: set[int]


def _store_state(store: GalleryStore, files: Sequence[GalleryFile], model_hash: str) -> _StoreState:
    """Snapshot the store in one read transaction, so decode threads never read LMDB per image."""
    # A fresh build has no data.mdb yet: do not open (create) the environment here, so its
    # creation (a few fsyncs) happens in the writer thread's first commit, overlapped with decoding.
    if not (store.path / "data.mdb").exists() or len(store) == 0:
        return _StoreState({}, set())
    mk = _model_key(model_hash)
    embedded: set[int] = set()
    paths: dict[str, tuple[int, int, int, bool]] = {}
    with store._read() as txn:          # one transaction for the whole snapshot
        meta, emb, path_db = store._db("meta"), store._db("emb"), store._db("path")
        cur = txn.cursor(db=emb)
        if cur.set_range(mk):
            for k in cur.iternext(keys=True, values=False):
                if not k.startswith(mk):
                    break
                if txn.get(k[32:], db=meta) is not None:
                    embedded.add(int.from_bytes(k[32:], "big"))
        for f in files:
            if f.problem:
                continue
            raw = txn.get(f.relpath.encode("utf-8"), db=path_db)
            if raw is not None:
                i, size, mtime = _PATHREC.unpack(raw)
                paths[f.relpath] = (i, size, mtime, i in embedded)
    return _StoreState(paths, embedded)


def _read_chunk(chunk: Sequence[GalleryFile], state: _StoreState, embedder: Any
                ) -> tuple[list[tuple[int, GalleryFile, Any, Any]], list[np.ndarray]]:
    """Read, hash, size and decode one chunk of files (runs in a decode thread).

    Each file is opened and read once; sha256, the header size and the decode all use those
    bytes. Returns per-file ``(kind, file, item-or-reason, stat)`` in input order and the
    preprocessed arrays of the ``_DECODED`` ones, in the same order.
    """
    from embedder.images import ImageLoadError

    out: list[tuple[int, GalleryFile, Any, Any]] = []
    arrays: list[np.ndarray] = []
    paths, embedded = state.paths, state.embedded
    for f in chunk:
        if f.problem:
            out.append((_SKIP, f, f.problem, None))
            continue
        rec = paths.get(f.relpath)
        try:
            if rec is not None and rec[3]:      # resume: the quick check needs no read
                st = os.stat(f.abspath)
                if rec[1] == st.st_size and rec[2] == st.st_mtime_ns:
                    out.append((_UNCHANGED, f, None, None))
                    continue
            with open(f.abspath, "rb") as fh:   # one open: fstat + read on the same file
                st = os.fstat(fh.fileno())
                data = fh.read()
        except OSError as e:
            out.append((_SKIP, f, f"unreadable: {e.strerror or e}", None))
            continue
        sha = hashlib.sha256(data).hexdigest()
        i = id_for_sha256(sha)
        if i in embedded:                       # content stored + embedded before this run
            if rec is not None and rec[0] == i:
                out.append((_TOUCH, f, i, st))
            else:
                w, h = _header_size(data)
                out.append((_KNOWN, f, NewItem(f.relpath, f.label, data, sha, w, h, st.st_size,
                                               st.st_mtime_ns), None))
            continue
        w, h = _header_size(data)
        item = NewItem(f.relpath, f.label, data, sha, w, h, st.st_size, st.st_mtime_ns)
        try:
            arrays.append(embedder.prepare(data, name=f.relpath))
        except ImageLoadError as e:
            out.append((_FAILED, f, (item, e.reason), None))
            continue
        except Exception as e:  # noqa: BLE001 - a decoder bug must not stop indexing
            out.append((_FAILED, f, (item, f"{type(e).__name__}: {e}"), None))
            continue
        out.append((_DECODED, f, item, None))
    return out, arrays


def ingest(store: GalleryStore, files: Sequence[GalleryFile] | Iterable[GalleryFile], embedder: Any,
           *, workers: int | None = None, commit_every: int = 256, progress: bool = True,
           on_done: Callable[[int], None] | None = None) -> IngestStats:
    """Bring ``files`` into ``store`` with embeddings from ``embedder`` (an OnnxEmbedder).

    ``workers`` decode threads (default: as many as ``embed_iter`` uses) each read a chunk of
    one batch; at most ``2 * workers + 1`` chunks are in flight, so memory stays O(batch).
    ``files`` may be a lazy iterable (``indexer build`` passes the gallery walk itself): into a
    fresh store it is consumed by a helper thread, so walking the folder overlaps embedding;
    into a store that already holds items it is listed first, for the one-pass snapshot.
    ``on_done(n)`` is told of files whose outcome is final: committed (called from the commit
    thread, after the transaction), found unchanged, or skipped; the counts add up to
    ``stats.found``. ``indexer build --ray`` reports shard progress through it.
    """
    if commit_every < 1:
        raise ValueError(f"commit_every must be >= 1, got {commit_every}")
    model_hash: str = embedder.model_hash
    batch_size = int(getattr(embedder, "batch_size", 32))
    workers = workers or min(8, os.cpu_count() or 1)
    fresh = not (store.path / "data.mdb").exists()
    if not fresh and not isinstance(files, Sequence):
        files = list(files)
    stats = IngestStats(found=0)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(files) if isinstance(files, Sequence) else None, desc="indexing",
                   unit="img")

    state = (_StoreState({}, set()) if fresh
             else _store_state(store, files, model_hash))  # type: ignore[arg-type]
    seen: set[str] = set()                   # sha256 of content first met in this run
    aliases: list[NewItem] = []              # same content as an earlier file / stored content
    failed: dict[str, str] = {}              # sha256 -> reason (aliases of a bad file are bad too)
    touches: list[tuple[str, int, int, int]] = []   # same content, new size/mtime

    ready_items: list[NewItem] = []          # decoded, waiting for a full batch
    ready_rows: list[np.ndarray] = []
    pending_items: list[NewItem] = []        # embedded, waiting for the next commit
    pending_emb: list[np.ndarray] = []

    # Commits (LMDB write + fsync) run on one writer thread, overlapping the next batches'
    # inference; at most one commit is in flight, so order and memory stay bounded.
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="indexer-commit")
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="indexer-decode")
    in_flight: list[Future] = []
    chunks: deque[Future] = deque()

    def commit(items: list[NewItem], emb: np.ndarray) -> None:
        stats.new += store.put_items(items, emb, model_hash)
        stats.embedded += len(items)
        if on_done is not None:
            on_done(len(items))

    def flush() -> None:
        while in_flight:
            in_flight.pop().result()      # re-raises a failed commit here
        if pending_items:
            in_flight.append(writer.submit(commit, list(pending_items), np.concatenate(pending_emb)))
            pending_items.clear()
            pending_emb.clear()

    def run_batches(final: bool) -> None:
        n = len(ready_rows) if final else len(ready_rows) // batch_size * batch_size
        if n == 0:
            return
        emb = embedder.embed_arrays(np.stack(ready_rows[:n]))
        pending_items.extend(ready_items[:n])
        pending_emb.append(_normalise(_check_dim(emb, embedder)))
        del ready_items[:n], ready_rows[:n]
        if len(pending_items) >= commit_every:
            flush()

    if isinstance(files, Sequence):
        source: Iterator[Sequence[GalleryFile]] = (files[s:s + batch_size]
                                                   for s in range(0, len(files), batch_size))
    else:
        source = _prefetch(_chunked(files, batch_size, bar), depth=2 * workers + 2)

    def submit_more() -> None:
        while len(chunks) < 2 * workers + 1:
            chunk = next(source, None)
            if chunk is None:
                return
            stats.found += len(chunk)
            chunks.append(pool.submit(_read_chunk, chunk, state, embedder))

    try:
        submit_more()
        while chunks:
            outcomes, arrays = chunks.popleft().result()
            submit_more()
            rows = iter(arrays)
            final = 0                              # outcomes settled without a commit
            for kind, f, x, st in outcomes:
                if kind == _DECODED:
                    row = next(rows)
                    if x.sha256 in seen:
                        aliases.append(x)
                    else:
                        seen.add(x.sha256)
                        ready_items.append(x)
                        ready_rows.append(row)
                elif kind == _UNCHANGED:
                    stats.unchanged += 1
                    final += 1
                elif kind == _SKIP:
                    stats.skipped.append({"path": f.relpath, "reason": x})
                    final += 1
                elif kind == _FAILED:
                    item, reason = x
                    if item.sha256 in seen:       # a later copy of content met before
                        aliases.append(item)
                    else:
                        seen.add(item.sha256)
                        failed[item.sha256] = reason
                        stats.skipped.append({"path": f.relpath, "reason": reason})
                        final += 1
                elif kind == _TOUCH:
                    touches.append((f.relpath, x, st.st_size, st.st_mtime_ns))
                    stats.unchanged += 1
                    final += 1
                else:                              # _KNOWN: stored content under a new path
                    aliases.append(x)
            if bar is not None:
                bar.update(len(outcomes))
            if on_done is not None and final:
                on_done(final)
            run_batches(final=False)
        run_batches(final=True)
        flush()
        flush()       # waits for the last commit
        for relpath, i, size, mtime_ns in touches:
            store.touch_path(relpath, i, size, mtime_ns)
        good = [a for a in aliases if a.sha256 not in failed]
        for a in aliases:
            if a.sha256 in failed:
                stats.skipped.append({"path": a.relpath, "reason": failed[a.sha256]})
        for s in range(0, len(good), commit_every):
            store.put_items(good[s:s + commit_every])
        stats.duplicates = len(good)
        if on_done is not None and aliases:
            on_done(len(aliases))
    finally:
        for fut in chunks:
            fut.cancel()
        close = getattr(source, "close", None)
        if close is not None:
            close()                       # stops the walking thread on an early exit
        pool.shutdown(wait=True)
        writer.shutdown(wait=True)
        if bar is not None:
            bar.close()
    if not fresh:   # a fresh store holds only what this run committed, embedded: nothing missing
        stats.embedded += embed_missing(store, embedder, workers=workers, progress=progress)
    return stats


def _chunked(files: Iterable[GalleryFile], size: int, bar: Any = None
             ) -> Iterator[list[GalleryFile]]:
    """Lists of ``size`` files; sets the progress bar's total once the walk is complete."""
    chunk: list[GalleryFile] = []
    n = 0
    for f in files:
        chunk.append(f)
        if len(chunk) == size:
            n += size
            yield chunk
            chunk = []
    n += len(chunk)
    if bar is not None:
        bar.total = n
        bar.refresh()
    if chunk:
        yield chunk


def _prefetch(gen: Iterator[Any], depth: int) -> Iterator[Any]:
    """Run a generator in its own thread, ``depth`` items ahead.

    Walking the gallery (os.scandir, stat) then overlaps decoding and inference instead of
    running before them. Exceptions are re-raised in the consumer.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def put(x: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for item in gen:
                if not put((None, item)):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put((e, None))
            return
        put((None, done))

    t = threading.Thread(target=run, name="indexer-walk", daemon=True)
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
    have = set(store._iter_emb_keys(model_hash))    # one read transaction, not one per id
    todo = [int(i) for i in (store.ids() if ids is None else ids) if int(i) not in have]
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
