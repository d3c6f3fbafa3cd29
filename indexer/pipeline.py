"""Ingest: read gallery files, dedupe by content, embed while decoding, commit in batches.

The commit unit is one LMDB transaction holding the bytes, metadata, paths and embeddings of a
few batches, so a build killed at any moment leaves only whole entries behind, and a rerun picks
up exactly the files that are not committed yet (quick check: same size and mtime, then sha256).

The shape is reader -> mapper -> writer. Why: with a tiny model (small_cnn, 28 px) inference
costs about as much as the per-image bookkeeping, so every image is touched once. The reader
(:mod:`indexer.reader`, decode threads) reads a *chunk* of files (one batch) and, from the same
bytes, hashes, reads the header size and decodes + preprocesses; the mapper, on the main thread,
only dedupes, stacks ready arrays and runs the session; the writer commits whole batches on one
thread (one LMDB transaction, one fsync per ``commit_every`` images). The store's state before
the run is read once up front (:meth:`GalleryStore.snapshot`), so no thread reads LMDB per image
(reads would queue behind the writer's commits on the store's lock).
"""
from __future__ import annotations

import os
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from embedder.vectors import l2_normalize

from .errors import IndexerError
from .reader import DECODED, FAILED, SKIP, TOUCH, UNCHANGED, chunked, prefetch, read_ahead
from .store import GalleryStore, NewItem, Snapshot
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


class _Mapper:
    """Settles each read outcome, keeps content met twice in this run to one copy, and embeds
    full batches of new content for the writer. What settles only after the last commit
    (aliases of stored content, new size/mtime of unchanged content) is kept here."""

    def __init__(self, embedder: Any, writer: "_Writer", batch_size: int) -> None:
        self.embedder, self.writer, self.batch_size = embedder, writer, batch_size
        self.seen: set[str] = set()                 # sha256 of content first met in this run
        self.aliases: list[NewItem] = []            # same content as an earlier file / stored content
        self.failed: dict[str, str] = {}            # sha256 -> reason (aliases of a bad file are bad too)
        self.touches: list[tuple[str, int, int, int]] = []   # same content, new size/mtime
        self._items: list[NewItem] = []             # decoded, waiting for a full batch
        self._rows: list[np.ndarray] = []

    def take(self, outcomes: list, arrays: list[np.ndarray], stats: IngestStats) -> int:
        """Sort one chunk's outcomes; returns how many settled without a commit."""
        rows = iter(arrays)
        final = 0
        for kind, f, x, st in outcomes:
            if kind == DECODED:
                row = next(rows)
                if x.sha256 in self.seen:
                    self.aliases.append(x)
                else:
                    self.seen.add(x.sha256)
                    self._items.append(x)
                    self._rows.append(row)
            elif kind == UNCHANGED:
                stats.unchanged += 1
                final += 1
            elif kind == SKIP:
                stats.skipped.append({"path": f.relpath, "reason": x})
                final += 1
            elif kind == FAILED:
                item, reason = x
                if item.sha256 in self.seen:       # a later copy of content met before
                    self.aliases.append(item)
                else:
                    self.seen.add(item.sha256)
                    self.failed[item.sha256] = reason
                    stats.skipped.append({"path": f.relpath, "reason": reason})
                    final += 1
            elif kind == TOUCH:
                self.touches.append((f.relpath, x, st.st_size, st.st_mtime_ns))
                stats.unchanged += 1
                final += 1
            else:                                  # KNOWN: stored content under a new path
                self.aliases.append(x)
        return final

    def embed(self, final: bool = False) -> None:
        """Embed the full batches waiting (all of them when ``final``) and hand them on."""
        n = len(self._rows) if final else len(self._rows) // self.batch_size * self.batch_size
        if n == 0:
            return
        emb = self.embedder.embed_arrays(np.stack(self._rows[:n]))
        self.writer.add(self._items[:n], l2_normalize(_check_dim(emb, self.embedder)))
        del self._items[:n], self._rows[:n]


class _Writer:
    """Commits (LMDB write + fsync) on one thread, overlapping the next batches' inference; at
    most one commit is in flight, so order and memory stay bounded."""

    def __init__(self, store: GalleryStore, model_hash: str, commit_every: int, stats: IngestStats,
                 on_done: Callable[[int], None] | None) -> None:
        self.store, self.model_hash, self.commit_every = store, model_hash, commit_every
        self.stats, self.on_done = stats, on_done
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="indexer-commit")
        self._in_flight: list[Future] = []
        self._items: list[NewItem] = []             # embedded, waiting for the next commit
        self._emb: list[np.ndarray] = []

    def add(self, items: list[NewItem], emb: np.ndarray) -> None:
        self._items.extend(items)
        self._emb.append(emb)
        if len(self._items) >= self.commit_every:
            self.flush()

    def flush(self) -> None:
        """Wait for the commit in flight (re-raising its failure), then start the next one."""
        while self._in_flight:
            self._in_flight.pop().result()
        if self._items:
            self._in_flight.append(self._pool.submit(self._commit, list(self._items),
                                                     np.concatenate(self._emb)))
            self._items.clear()
            self._emb.clear()

    def _commit(self, items: list[NewItem], emb: np.ndarray) -> None:
        self.stats.new += self.store.put_items(items, emb, self.model_hash)
        self.stats.embedded += len(items)
        if self.on_done is not None:
            self.on_done(len(items))        # from the commit thread, after the transaction

    def finish(self) -> None:
        self.flush()
        self.flush()                          # waits for the last commit

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def ingest(store: GalleryStore, files: Sequence[GalleryFile] | Iterable[GalleryFile], embedder: Any,
           *, workers: int | None = None, commit_every: int = 256, progress: bool = True,
           on_done: Callable[[int], None] | None = None) -> IngestStats:
    """Bring ``files`` into ``store`` with embeddings from ``embedder`` (an OnnxEmbedder).

    Reader (``workers`` decode threads, default as many as ``embed_iter`` uses, each reading a
    chunk of one batch) -> mapper (dedupe, batch, embed) -> writer (one commit thread) ->
    logger (tqdm and ``on_done``). ``files`` may be a lazy iterable (``indexer build`` passes
    the gallery walk itself): into a fresh store it is consumed by a helper thread, so walking
    the folder overlaps embedding; into a store that already holds items it is listed first,
    for the one-pass snapshot. ``on_done(n)`` is told of files whose outcome is final:
    committed (called from the commit thread, after the transaction), found unchanged, or
    skipped; the counts add up to ``stats.found``. ``indexer build --ray`` reports shard
    progress through it.
    """
    if commit_every < 1:
        raise ValueError(f"commit_every must be >= 1, got {commit_every}")
    batch_size = int(getattr(embedder, "batch_size", 32))
    workers = workers or min(8, os.cpu_count() or 1)
    fresh = not store.exists
    if not fresh and not isinstance(files, Sequence):
        files = list(files)
    stats = IngestStats(found=0)
    from tqdm.auto import tqdm

    bar = tqdm(total=len(files) if isinstance(files, Sequence) else None, desc="indexing",
               unit="img", disable=not progress)
    snap = (Snapshot({}, set()) if fresh else
            store.snapshot(embedder.model_hash, (f.relpath for f in files if not f.problem)))
    if isinstance(files, Sequence):
        source: Iterator[Sequence[GalleryFile]] = (files[s:s + batch_size]
                                                   for s in range(0, len(files), batch_size))
    else:
        source = prefetch(chunked(files, batch_size, bar), depth=2 * workers + 2)
    writer = _Writer(store, embedder.model_hash, commit_every, stats, on_done)
    mapper = _Mapper(embedder, writer, batch_size)
    reader = read_ahead(source, snap, embedder, workers)
    try:
        for outcomes, arrays in reader:
            stats.found += len(outcomes)
            settled = mapper.take(outcomes, arrays, stats)
            bar.update(len(outcomes))
            if on_done is not None and settled:
                on_done(settled)
            mapper.embed()
        mapper.embed(final=True)
        writer.finish()
        for relpath, i, size, mtime_ns in mapper.touches:
            store.touch_path(relpath, i, size, mtime_ns)
        good = [a for a in mapper.aliases if a.sha256 not in mapper.failed]
        stats.skipped += [{"path": a.relpath, "reason": mapper.failed[a.sha256]}
                          for a in mapper.aliases if a.sha256 in mapper.failed]
        for s in range(0, len(good), commit_every):
            store.put_items(good[s:s + commit_every])
        stats.duplicates = len(good)
        if on_done is not None and mapper.aliases:
            on_done(len(mapper.aliases))
    finally:
        reader.close()
        writer.shutdown()
        bar.close()
    if not fresh:   # a fresh store holds only what this run committed, embedded: nothing missing
        stats.embedded += embed_missing(store, embedder, workers=workers, progress=progress)
    return stats


def _check_dim(emb: np.ndarray, embedder: Any) -> np.ndarray:
    if emb.ndim != 2 or emb.shape[1] != embedder.dim:
        raise IndexerError(f"{embedder.path}: model says dim {embedder.dim} but produced "
                           f"embeddings of shape {tuple(emb.shape)}")
    return emb


def embed_missing(store: GalleryStore, embedder: Any, *, workers: int | None = None,
                  progress: bool = True, commit_every: int = 256) -> int:
    """Embed stored content that has no embedding for this model yet (a rebuild with a new model).

    Reads the original bytes back from the store, so the gallery folder need not exist any more.
    """
    model_hash = embedder.model_hash
    todo = store.missing_embeddings(model_hash)
    if not todo:
        return 0
    from tqdm.auto import tqdm

    bar = tqdm(total=len(todo), desc="re-embedding stored images", unit="img", disable=not progress)
    done = 0
    buf_ids: list[int] = []
    buf_emb: list[np.ndarray] = []
    try:
        items = ((i, store.get_bytes(i)) for i in todo)
        for keys, emb, failures in embedder.embed_iter(items, workers=workers):
            if keys:
                buf_ids.extend(keys)
                buf_emb.append(l2_normalize(_check_dim(emb, embedder)))
            for i, err in failures:   # stored bytes decoded before; a new model's loader may differ
                warnings.warn(f"id {i}: {getattr(err, 'reason', err)}; left out of this model's index")
            bar.update(len(keys) + len(failures))
            if len(buf_ids) >= commit_every:
                store.put_embeddings(model_hash, buf_ids, np.concatenate(buf_emb))
                done += len(buf_ids)
                buf_ids, buf_emb = [], []
        if buf_ids:
            store.put_embeddings(model_hash, buf_ids, np.concatenate(buf_emb))
            done += len(buf_ids)
    finally:
        bar.close()
    return done
