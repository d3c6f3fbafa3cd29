"""The streaming plan's samples, drawn shard by shard: the driver holds counts and samples, never
the union of the shards' ids (~60-90 bytes a vector: 9 GiB at 100M). A position is one in the
shards' concatenation (each shard's ids ascending), drawn here (``draw``) and read by each shard in
one pass (``Sample``, ``Source.sample``). Duplicates across shards: ``census``, a k-way merge of
sorted id streams in chunks.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..store.sources import CHUNK, answers


def census(sources: Sequence, size: int = CHUNK) -> tuple[list[int], list[np.ndarray]]:
    """(ids per shard, per shard the ids an earlier shard also holds): content in two shards is
    indexed once, by the first. Ids come ascending, so all ids up to the smallest of the current
    chunks' last ids are settled and dropped: one chunk a shard plus the duplicates in memory."""
    its = [iter(s.id_chunks(size)) for s in sources]
    counts = [0] * len(sources)
    dups: list[list[np.ndarray]] = [[] for _ in sources]

    def refill(i: int) -> np.ndarray | None:
        for c in its[i]:
            if len(c):
                counts[i] += len(c)
                return np.asarray(c, dtype=np.int64)
        return None

    buf = [refill(i) for i in range(len(sources))]
    while any(b is not None for b in buf):
        live = [i for i, b in enumerate(buf) if b is not None]
        bound = min(int(buf[i][-1]) for i in live)
        ids, shard = [], []
        for i in live:
            m = int(np.searchsorted(buf[i], bound, side="right"))
            ids.append(buf[i][:m])
            shard.append(np.full(m, i, dtype=np.int32))
            buf[i] = buf[i][m:] if m < len(buf[i]) else refill(i)
        ids_w, shard_w = np.concatenate(ids), np.concatenate(shard)
        order = np.lexsort((shard_w, ids_w))         # by id, then shard: the first owner first
        ids_w, shard_w = ids_w[order], shard_w[order]
        again = np.zeros(len(ids_w), dtype=bool)
        again[1:] = ids_w[1:] == ids_w[:-1]
        for i in np.unique(shard_w[again]):
            dups[int(i)].append(ids_w[again & (shard_w == i)])
    return counts, [np.sort(np.concatenate(d)) if d else np.zeros(0, np.int64) for d in dups]


def draw(rng: np.random.Generator, n: int, size: int, exclude: np.ndarray | None = None) -> np.ndarray:
    """``size`` distinct positions of [0, n) not in ``exclude``, ascending (all when fewer are
    left), in memory of ``size``, not ``n`` (numpy's ``choice`` permutes all of [0, n))."""
    exclude = np.zeros(0, np.int64) if exclude is None else np.asarray(exclude, dtype=np.int64)
    left = n - len(exclude)
    if size >= left:
        return np.setdiff1d(np.arange(n, dtype=np.int64), exclude)
    got = np.zeros(0, np.int64)
    while len(got) < size:
        more = rng.integers(0, n, size=int((size - len(got)) * 1.1) + 64, dtype=np.int64)
        got = np.union1d(got, np.setdiff1d(more, exclude))
    return np.sort(rng.choice(got, size=size, replace=False))


class Sample:
    """The vectors at ``positions`` of the shards' concatenation, read shard by shard (one pass
    each); positions whose id an earlier shard holds are dropped (``positions`` keeps the rest)."""

    def __init__(self, sources: Sequence, counts: Sequence[int], dups: Sequence[np.ndarray],
                 positions: np.ndarray) -> None:
        positions = np.unique(np.asarray(positions, dtype=np.int64))
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        # one array for every shard's rows, filled in place: concatenating per-shard arrays held
        # the sample twice at its peak (measured: the training sample's read was the plan's peak)
        self.x = np.empty((len(positions), sources[0].dim), dtype=np.float32)
        self.ids = np.empty(len(positions), dtype=np.int64)
        keep = np.ones(len(positions), dtype=bool)
        spans = [(s, *np.searchsorted(positions, self.starts[s:s + 2])) for s in range(len(sources))]
        spans = [(s, lo, hi) for s, lo, hi in spans if hi > lo]
        # remote shards read their rows at once, in parallel; their answers are taken in turn
        asks = [(positions[lo:hi] - self.starts[s],) for s, lo, hi in spans]
        for (s, lo, hi), (i, x) in zip(spans, answers([sources[s] for s, _, _ in spans], "sample", asks)):
            self.ids[lo:hi], self.x[lo:hi] = i, x
            del x
            keep[lo:hi] = ~np.isin(i, dups[s])
        if not keep.all():                   # duplicates of an earlier shard's content: dropped
            self.x, self.ids = self.x[keep], self.ids[keep]
        self.positions = positions[keep]

    def kept(self, positions: np.ndarray) -> np.ndarray:
        """Those of ``positions`` that were not dropped as duplicates."""
        return np.asarray(positions, dtype=np.int64)[np.isin(positions, self.positions)]

    def rows(self, positions: np.ndarray) -> np.ndarray:
        at = np.searchsorted(self.positions, positions)
        if len(positions) and (at.max() >= len(self.positions)
                               or not np.array_equal(self.positions[at], positions)):
            raise KeyError("positions outside the sample")
        return at

    def shard_of(self, positions: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, positions, side="right") - 1


class View:
    """The gallery as ``selection.select`` indexes it (``x[rows]``, ``ids[rows]``, ``x.shape``)
    when only a sample of it is at hand: rows must be positions the sample holds."""

    def __init__(self, sample: Sample, n: int, ids: bool = False) -> None:
        self.sample, self.is_ids = sample, ids
        self.shape = (n,) if ids else (n, sample.x.shape[1])

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        at = self.sample.rows(np.asarray(rows, dtype=np.int64))
        return self.sample.ids[at] if self.is_ids else self.sample.x[at]
