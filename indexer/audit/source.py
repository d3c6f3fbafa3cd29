"""The audit's one seam to the rest of ``indexer``: every name it needs is imported here, from
the package's face only, so that when indexer's modules move only this file changes. It reads
the gallery's ids and stored vectors (every part's store: even a codes-only index stores every
vector), the labels (the store's label table) and the index's own faiss search (any layout).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from embedder.vectors import l2_normalize
from indexer import GalleryStore, Index, IndexDir, IndexerError, check_counts

#: index types whose search scores are exact inner products of the stored vectors (Flat, IVF
#: lists of full vectors, HNSW, or codes re-ranked with the full vectors); the others' scores
#: come from codes (SQ8, PQ) and are recomputed here from the stored vectors.
EXACT_SCORE_TYPES = frozenset({"flat", "ivf", "ivfhnsw", "hnsw", "sq8rf", "pqfsrf"})


@dataclass
class Gallery:
    """An opened index for the audit: ids (in stream order), labels, the search, the images."""

    index: Any
    ids: np.ndarray                         # (n,) int64, the order rows have everywhere
    label_names: list[str]                  # code -> label
    codes: np.ndarray                       # (n,) int32 label code per row, -1 = no label
    exact_scores: bool
    _sorter: np.ndarray = field(repr=False, default=None)   # type: ignore[assignment]

    @property
    def directory(self) -> Path:
        return Path(self.index.directory)

    def close(self) -> None:
        """Close the index's store: LMDB allows one environment a path per process, so a writer
        in this process (``indexer add`` after an audit, in a service or a test) needs it shut."""
        self.index.close()

    @property
    def dim(self) -> int:
        return int(self.index.dim)

    @property
    def has_labels(self) -> bool:
        return bool((self.codes >= 0).any())

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """Row of each id (-1: not in the gallery, e.g. faiss's -1 padding)."""
        ids = np.asarray(ids, dtype=np.int64)
        s = self._sorter
        pos = np.searchsorted(self.ids, ids, sorter=s).clip(0, len(s) - 1)
        rows = s[pos]
        return np.where(self.ids[rows] == ids, rows, -1)

    def chunks(self, size: int = 65_536) -> Iterator[tuple[int, np.ndarray]]:
        """(first row, normalised float32 vectors) of the gallery in row order, ``size`` rows at
        a time (one chunk in memory at a time; the rows' ids are ``self.ids[start:...]``)."""
        start = raw = 0
        for cids, x in _stream(self.index, size):
            if self._first is not None:                 # a copy stored in a later shard too: skipped
                x = x[self._first[raw:raw + len(cids)]]
            raw += len(cids)
            if len(x):
                yield start, l2_normalize(np.asarray(x, dtype=np.float32))
                start += len(x)

    _first: np.ndarray | None = field(repr=False, default=None)

    def vectors(self, rows: np.ndarray) -> np.ndarray:
        """Stored normalised vectors of ``rows`` (random reads from the store)."""
        return l2_normalize(self.index.embeddings(self.ids[np.asarray(rows)]))

    def search(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The index's own faiss search (no DBA re-ranking: the plain kNN of the vectors)."""
        ans = self.index.faiss.search(np.ascontiguousarray(x, dtype=np.float32), k)
        if ans.partial:
            raise IndexerError(f"{self.directory}: shards {list(ans.partial)} did not answer; the "
                               "audit needs every shard (retry, or raise --shard-timeout)")
        return ans.scores, ans.ids

    def identical_files(self) -> dict[int, list[str]]:
        """Row -> the paths of its files, for each image the gallery holds as more than one file
        (byte-identical copies are stored once, under every path: the graph cannot pair them)."""
        parts = self.index.layout.parts
        ids = []
        for part in parts:
            with GalleryStore(part.store_dir) as st:
                ids.append(st.path_ids())
        u, n = np.unique(np.concatenate(ids), return_counts=True)
        many = set(u[n > 1].tolist())
        if not many:
            return {}
        paths: dict[int, list[str]] = {}
        for part in parts:
            with GalleryStore(part.store_dir) as st:
                for i, ps in st.paths_of(many).items():
                    paths.setdefault(i, []).extend(ps)
        rows = self.rows_of(np.fromiter(paths, np.int64, len(paths)))
        return {int(r): sorted(ps) for r, ps in zip(rows, paths.values()) if r >= 0}

    def meta(self, row: int) -> dict:
        return self.index.meta(int(self.ids[row]))

    def image_bytes(self, row: int) -> bytes:
        return self.index.image_bytes(int(self.ids[row]))


def _stream(index: Any, size: int = 65_536, vectors: bool = True) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, vectors) chunks of every part's store embedded by the index's model."""
    for part in index.layout.parts:
        with GalleryStore(part.store_dir) as st:           # closed: one environment a path per process
            yield from st.iter_embeddings(index.model_hash, size, vectors=vectors)


def ray_serving(address: str, timeout: float) -> Any:
    """``--ray``/``--shard-timeout`` as ``Index.open``'s ``ray``: strict, since a graph with a
    shard left out would be wrong without a word (a shard that does not answer fails the audit)."""
    from indexer import RayServing

    return RayServing(address=address, timeout=timeout, strict=True)


def open_gallery(directory: str | Path, *, device: str = "cpu", ray: Any = None) -> Gallery:
    """Open ``directory`` for the audit; one ``IndexerError`` line when it is damaged (any file
    the index's own checks refuse), when the store(s) and the faiss index disagree on the count
    (naming ``indexer repair``), or when it holds no image."""
    directory = Path(directory)
    if not directory.is_dir():
        raise IndexerError(f"{directory}: no index directory here")
    counts = check_counts(directory)
    if not counts.ok:
        raise IndexerError(counts.message)
    index = Index.open(directory, device=device, ray=ray)
    ids_parts = [c for c, _ in _stream(index, vectors=False)]
    ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, dtype=np.int64)
    first = None
    _, where = np.unique(ids, return_index=True)
    if len(where) != len(ids):              # content stored in two shards: indexed once, by the first
        first = np.zeros(len(ids), dtype=bool)
        first[where] = True
        ids = ids[first]
    if len(ids) != len(index):
        raise IndexerError(f"{directory}: the store(s) hold {len(ids)} vectors of the index's model "
                           f"but the faiss index holds {len(index)}; run `python -m indexer repair "
                           f"--index {directory}` first")
    if not len(ids):
        raise IndexerError(f"{directory}: the index holds no image to audit")
    sorter = np.argsort(ids, kind="stable")
    names = sorted(index.labels())
    codes = np.full(len(ids), -1, dtype=np.int32)
    g = Gallery(index, ids, names, codes, index.manifest.index_type in EXACT_SCORE_TYPES, sorter, first)
    for c, lab in enumerate(names):
        rows = g.rows_of(np.asarray(index.ids_for_label(lab), dtype=np.int64))
        rows = rows[rows >= 0]
        codes[rows[codes[rows] < 0]] = c        # an image stored under two labels keeps the first
    return g


__all__ = ["Gallery", "open_gallery", "EXACT_SCORE_TYPES"]


def manifest_file(directory: str | Path) -> Path:
    """The index's manifest (its version: every change rewrites it last); IndexerError when
    ``directory`` is not an index."""
    return IndexDir(directory).require().manifest_file
