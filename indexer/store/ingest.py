"""Ingest: read gallery files, dedupe by content, embed while decoding, commit in batches.

The commit unit is one LMDB transaction of a few batches, so a killed build leaves only whole
entries and a rerun picks up exactly the uncommitted files (same size and mtime, then sha256).
One runner (:func:`run`: reader -> embedder -> writer, timed per stage) serves ``build``/``add``
(:func:`ingest`) and :func:`embed_missing`, touching every image once: with a tiny model
inference costs about as much as bookkeeping. The store's prior state is read once up front
(:meth:`GalleryStore.snapshot`), so no thread reads LMDB per image behind the writer's lock.
"""
from __future__ import annotations

import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from embedder.folders import GalleryFile
from embedder.runtime import DECODE_WORKERS, OnnxEmbedder, chunked
from embedder.vectors import l2_normalize

from ..errors import IndexerError
from .gallery import GalleryStore, NewItem, Snapshot
from .reader import DECODED, FAILED, SKIP, TOUCH, UNCHANGED, prefetch, read_chunk


@dataclass
class IngestStats:
    """What one ingest did; printed as the summary and stored in the manifest."""

    found: int = 0
    new: int = 0            # new content committed (bytes + embedding)
    unchanged: int = 0      # path already stored with the same size/mtime or the same sha256
    duplicates: int = 0     # identical content under another path: stored once, path recorded
    embedded: int = 0       # embeddings computed (new content + stored content new to the model)
    absent: int = 0         # stored paths the walk did not find (deleted, or from `add`): kept
    moved: int = 0          # ... whose image the walk found under another path: dropped
    pruned: int = 0         # ... dropped instead (``prune``)
    skipped: list[dict] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)    # per stage of the runner (run)


def run(embedder: OnnxEmbedder, chunks: Iterator, read: Callable[[Any], Any],
        settle: Callable[[Any], Iterable[tuple[Any, np.ndarray]]], commit: Callable[[list, np.ndarray], None],
        *, workers: int | None = None, commit_every: int = 256, seconds: dict | None = None) -> dict:
    """The embedding runner: ``read(chunk)`` in the decode threads, ``settle(result)`` here picks the
    (key, array) pairs to embed; L2-normalised batches go to ``commit(keys, embeddings)`` every
    ``commit_every`` rows on one thread, at most one in flight. Returns ``seconds`` per stage."""
    if commit_every < 1:
        raise ValueError(f"commit_every must be >= 1, got {commit_every}")
    seconds = {} if seconds is None else seconds
    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="indexer-commit")
    in_flight: list[Future] = []
    keys: list = []                     # embedded, waiting for the next commit
    embs: list[np.ndarray] = []

    def write(keys: list, emb: np.ndarray) -> None:
        t = time.perf_counter()
        commit(keys, emb)
        seconds["write"] = seconds.get("write", 0.0) + time.perf_counter() - t

    def flush() -> None:
        """Wait for the commit in flight (re-raising its failure), then start the next one."""
        while in_flight:
            in_flight.pop().result()
        if keys:
            in_flight.append(pool.submit(write, list(keys), np.concatenate(embs)))
            keys.clear()
            embs.clear()

    batches = embedder.run(chunks, read, settle, workers=workers, seconds=seconds)
    try:
        for ks, emb in batches:
            if ks:
                if emb.ndim != 2 or emb.shape[1] != embedder.dim:
                    raise IndexerError(f"{embedder.path}: model says dim {embedder.dim} but produced "
                                       f"embeddings of shape {tuple(emb.shape)}")
                keys.extend(ks)
                embs.append(l2_normalize(emb))
            if len(keys) >= commit_every:
                flush()
        flush()
        flush()                           # waits for the last commit
    finally:
        batches.close()                   # on a failure: the decode threads stop, the walk too
        pool.shutdown(wait=True)
    seconds["total"] = seconds.get("total", 0.0) + time.perf_counter() - t0
    for stage in ("read", "embed", "write", "total"):
        seconds[stage] = round(seconds.get(stage, 0.0), 3)
    return seconds


class _Settle:
    """Settles each read outcome of an ingest, keeps content met twice in this run to one copy,
    and passes new content on to be embedded. What settles only after the last commit
    (aliases of stored content, new size/mtime of unchanged content) is kept here."""

    def __init__(self, stats: IngestStats, bar: Any, on_done: Callable[[int], None] | None) -> None:
        self.stats, self.bar, self.on_done = stats, bar, on_done
        self.seen: set[str] = set()                 # sha256 of content first met in this run
        self.aliases: list[NewItem] = []            # same content as an earlier file / stored content
        self.failed: dict[str, str] = {}            # sha256 -> reason (aliases of a bad file are bad too)
        self.touches: list[tuple[str, int, int, int]] = []   # same content, new size/mtime

    def __call__(self, got: tuple[list, list[np.ndarray]]) -> Iterator[tuple[NewItem, np.ndarray]]:
        outcomes, arrays = got
        stats, rows, final = self.stats, iter(arrays), 0
        stats.found += len(outcomes)
        for kind, f, x, st in outcomes:
            if kind == DECODED:
                row = next(rows)
                if x.sha256 in self.seen:
                    self.aliases.append(x)
                else:
                    self.seen.add(x.sha256)
                    yield x, row
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
        self.bar.update(len(outcomes))
        if self.on_done is not None and final:
            self.on_done(final)


def ingest(store: GalleryStore, files: Sequence[GalleryFile] | Iterable[GalleryFile], embedder: OnnxEmbedder,
           *, workers: int | None = None, commit_every: int = 256, progress: bool = True,
           on_done: Callable[[int], None] | None = None, walked: bool = False, prune: bool = False) -> IngestStats:
    """Bring ``files`` into ``store`` through :func:`run` (``workers`` decode threads). A lazy
    ``files`` is consumed by a helper thread into a fresh store (walking overlaps embedding), else
    listed first (for the snapshot). ``on_done(n)``: files whose outcome is final (they add up to
    ``stats.found``). ``walked``: ``files`` is the whole gallery (a build), so a stored path not
    among them is counted in ``stats.absent`` (its file was deleted, or `add` brought it from
    another folder) and, with ``prune``, dropped (``stats.pruned``); one whose image the gallery
    holds under another path was moved there (a class folder renamed) and is dropped (``stats.moved``)."""
    batch_size = embedder.batch_size
    workers = workers or DECODE_WORKERS
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
        def total(n: int) -> None:
            bar.total = n
            bar.refresh()

        source = prefetch(chunked(files, batch_size, total), depth=2 * workers + 2)
    settle = _Settle(stats, bar, on_done)

    def commit(items: list[NewItem], emb: np.ndarray) -> None:
        stats.new += store.put_items(items, emb, embedder.model_hash)
        stats.embedded += len(items)
        if on_done is not None:
            on_done(len(items))        # from the commit thread, after the transaction

    try:
        run(embedder, source, partial(read_chunk, snap=snap, embedder=embedder), settle, commit,
            workers=workers, commit_every=commit_every, seconds=stats.seconds)
        store.touch_paths(settle.touches)
        good = [a for a in settle.aliases if a.sha256 not in settle.failed]
        stats.skipped += [{"path": a.relpath, "reason": settle.failed[a.sha256]}
                          for a in settle.aliases if a.sha256 in settle.failed]
        for s in range(0, len(good), commit_every):
            store.put_items(good[s:s + commit_every])
        stats.duplicates = len(good)
        if on_done is not None and settle.aliases:
            on_done(len(settle.aliases))
    finally:
        bar.close()
    if walked and not fresh:
        walked_paths = {f.relpath for f in files}
        gone = [p for p in store.paths() if p not in walked_paths]
        if prune and gone:
            store.remove_paths(gone)
            stats.pruned = len(gone)
        elif gone:
            moved = moved_paths(store, gone, walked_paths)
            store.remove_paths(moved)
            stats.moved, stats.absent = len(moved), len(gone) - len(moved)
            stats.duplicates = max(0, stats.duplicates - len(moved))    # their new paths: not copies
    if not fresh:   # a fresh store holds only what this run committed, embedded: nothing missing
        stats.embedded += embed_missing(store, embedder, workers=workers, progress=progress,
                                        seconds=stats.seconds)
    return stats


def moved_paths(store: GalleryStore, gone: Sequence[str], walked: set[str]) -> list[str]:
    """The stored paths among ``gone`` (not found by the walk) whose image the walk found under
    another path: a file or class folder moved or renamed. Kept, they held the image under its
    old label (search showed "dogs/1.jpg" after dogs/ became Dogs/, until 2026-11-30); dropped,
    nothing is lost (an `add`ed copy of a gallery image under another path loses that alias)."""
    ids = {path: store.id_for_path(path) for path in gone}
    held = store.paths_of({i for i in ids.values() if i is not None})
    return [path for path, i in ids.items() if any(q in walked for q in held.get(i, ()))]


def embed_missing(store: GalleryStore, embedder: OnnxEmbedder, *, workers: int | None = None,
                  progress: bool = True, commit_every: int = 256, seconds: dict | None = None) -> int:
    """Embed stored content that has no embedding for this model yet (a rebuild with a new
    model) through :func:`run`, from the stored bytes (the gallery folder may be gone)."""
    model_hash = embedder.model_hash
    todo = store.missing_embeddings(model_hash)
    if not todo:
        return 0
    from tqdm.auto import tqdm

    done = 0

    def settle(got: list[tuple[int, Any]]) -> Iterator[tuple[int, np.ndarray]]:
        bar.update(len(got))
        for i, x in got:
            if isinstance(x, np.ndarray):
                yield i, x
            else:   # stored bytes decoded before; a new model's loader may differ
                warnings.warn(f"id {i}: {getattr(x, 'reason', x)}; left out of this model's index")

    def commit(ids: list[int], emb: np.ndarray) -> None:
        nonlocal done
        store.put_embeddings(model_hash, ids, emb)
        done += len(ids)

    b = embedder.batch_size
    chunks = ([(i, store.get_bytes(i)) for i in todo[s:s + b]] for s in range(0, len(todo), b))
    with tqdm(total=len(todo), desc="re-embedding stored images", unit="img", disable=not progress) as bar:
        run(embedder, chunks, embedder.prepare_chunk, settle, commit, workers=workers,
            commit_every=commit_every, seconds=seconds)
    return done
