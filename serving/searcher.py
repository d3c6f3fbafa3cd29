"""Searcher: read-only indexes (say a baseline and a DAS embedder) answering image queries and
probes side by side (the paper's Figs. V-VI); one Searcher serves all web workers. One request,
one index state: each method looks the index up ONCE (:meth:`snapshot`) and passes it down, so a
reload after ``indexer add/remove`` (serving.reload) never swaps a request's Index."""
from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from PIL import Image

from embedder import ImageLoadError
from indexer import Index, IndexDir, check_counts
from indexer.audit import served_audit

from . import probes, queries
from .reload import IndexWatcher
from .results import (ProbeReport, Query, RequestError, Result, SearchResult, Snapshot, UnknownIdError,
                      check_k)
from .thumbs import ThumbnailCache, framed
from .uploads import bounded_decode

ImageSource = str | Path | bytes | Image.Image
IndexRef = str | Snapshot | None       # an index name (None: the default) or a request's Snapshot


def _index_name(directory: Path, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", directory.resolve().name).strip("-") or "index"
    name, n = base, 2
    while name in taken:
        name, n = f"{base}-{n}", n + 1
    return name


class Searcher:
    """Search service over named indexes; the first one is the default."""

    def __init__(self, indexes: Mapping[str, Index], *, thumb_size: int = 160,
                 cache_size: int = 4096, directories: Mapping[str, Path] | None = None):
        if not indexes:
            raise ValueError("Searcher: expected at least one index")
        self.indexes: dict[str, Index] = dict(indexes)
        self.directories: dict[str, Path] = dict(directories or {})
        self.thumbs = ThumbnailCache(cache_size, thumb_size)
        self.watcher = IndexWatcher(self.indexes, self.directories)
        self.decode_side = max(idx.decode_side for idx in self.indexes.values())

    @classmethod
    def open(cls, directories: Sequence[str | Path] | str | Path, *, names: Sequence[str] | None = None,
             device: str = "auto", check_model: bool = False, max_memory: int | str | None = None,
             ray: Any = None, **kw: Any) -> "Searcher":
        """Open each index directory read-only; ``max_memory`` (``indexer.ann.served``) and ``ray``
        (one actor per shard; ``SearchResult.partial`` names a shard left out) survive reloads."""
        if isinstance(directories, (str, Path)):
            directories = [directories]
        dirs = [Path(d) for d in directories]
        if names is not None and len(names) != len(dirs):
            raise ValueError(f"names: expected {len(dirs)} names for {len(dirs)} indexes, got {len(names)}")
        opened: dict[str, Index] = {}
        paths: dict[str, Path] = {}
        for i, d in enumerate(dirs):
            IndexDir(d).require()
            name = names[i] if names is not None else _index_name(d, set(opened))
            if name in opened:
                raise ValueError(f"names: duplicate index name {name!r}")
            opened[name] = Index.open(d, device=device, check_model=check_model, max_memory=max_memory,
                                      ray=ray)
            paths[name] = d
        return cls(opened, directories=paths, **kw)

    # -- lookup ---------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.indexes)

    @property
    def default(self) -> str:
        return next(iter(self.indexes))

    def index(self, name: str | None = None) -> Index:
        """The index's current state (a changed directory is picked up between requests)."""
        name = name or self.default
        self.watcher.poke(name)
        try:
            return self.indexes[name]
        except KeyError:
            raise UnknownIdError(f"unknown index {name!r}; open indexes: {', '.join(self.indexes)}") from None

    def snapshot(self, index: IndexRef = None) -> Snapshot:
        """The named index as one request sees it (a Snapshot given is used as it is)."""
        if isinstance(index, Snapshot):
            return index
        name = index or self.default
        return Snapshot(name, self.index(name))

    def health(self) -> dict[str, str]:
        """index name -> problem; a real read of each store: an unreadable LMDB shows here, not as a 500."""
        problems = {}
        for name in self.indexes:
            idx = self.index(name)
            try:
                idx.stored()
            except Exception as e:  # noqa: BLE001 - reported, not raised
                problems[name] = f"index {name!r}: gallery store unreadable ({str(e).splitlines()[0]})"
                continue
            try:    # store, index.faiss and manifest agree on the count (issue 19)
                counts = check_counts(idx.directory, store=idx.store)
                if not counts.ok:
                    problems[name] = f"index {name!r}: {counts.message}"
            except Exception as e:  # noqa: BLE001 - reported, not raised
                problems[name] = f"index {name!r}: {str(e).splitlines()[0]}"
            gone = idx.faiss.missing()
            if gone and name not in problems:
                problems[name] = (f"index {name!r}: shard(s) {', '.join(map(str, gone))} not answering "
                                  "(node lost?); answers leave them out until Ray restarts their actors")
        return {**self.watcher.problems(), **problems}

    def _meta(self, snap: Snapshot, id: Any) -> dict:
        if isinstance(id, bool) or not isinstance(id, (int, np.integer)) or not 0 <= int(id) < 2 ** 63:
            raise UnknownIdError(f"id {id!r} is not in index {snap.name!r} (ids are integers from 0 to 2**53)")
        try:
            return snap.index.meta(int(id))
        except KeyError:
            raise UnknownIdError(f"id {id!r} is not in index {snap.name!r}") from None

    # -- queries --------------------------------------------------------------------------
    def query(self, image: Query | ImageSource | int | None = None, *, id: int | str | None = None,
              path: str | None = None, index: IndexRef = None, label: str | None = None,
              name: str | None = None, box: Any = None) -> Query:
        """The one way to a Query: an image (decoded now), else a gallery id or path (looked up in
        the store, never read from disk); ``box``: that region only (its photo stays in the results)."""
        if isinstance(image, Query):
            return image
        if isinstance(image, (int, np.integer)) and not isinstance(image, bool):
            image, id = None, int(image)
        region = queries.parse_box(box)
        if image is not None:
            nm = name or (str(image) if isinstance(image, (str, Path)) else "query")
            if region is None:
                img = bounded_decode(image, name=name, min_side=self.decode_side)
                return Query(image=img, label=label, name=nm)
            return self._region(image, region, nm, label)
        snap = self.snapshot(index)
        if id is None and path is not None:
            id = snap.index.id_for_path(path)
            if id is None:
                raise UnknownIdError(f"path {path!r} is not in index {snap.name!r}")
        if isinstance(id, str):
            try:
                id = int(id)
            except ValueError:
                raise RequestError(f"id: expected an integer gallery id, got {id!r}") from None
        if id is None:
            raise RequestError("no query: upload an image, or name a gallery image by id or path")
        meta = self._meta(snap, id)
        nm = meta.get("path") or f"{snap.name}#{id}"
        if region is not None:
            return self._region(snap.index.image_bytes(int(id)), region, nm, label or meta.get("label"),
                                stored=True)
        return Query(id=int(id), source=snap.name, label=label or meta.get("label"), path=meta.get("path"),
                     name=nm, origin=snap)

    def _region(self, image: ImageSource, box: queries.Box, name: str, label: str | None, *,
                stored: bool = False) -> Query:
        """The box of a decoded image (its own pixels), else of a file or bytes decoded no larger
        than the box needs, within the decode budget (:func:`embedder.regions.load_region`)."""
        if isinstance(image, Image.Image):
            cut = queries.crop(image, box, name)
        else:
            cut = queries.load_region(image, box, self.decode_side, name=name, stored=stored)
        return self.region_query(cut, box, name, label)

    def region_query(self, cut: Image.Image, box: queries.Box, name: str, label: str | None = None) -> Query:
        """A Query of a region already cut (``decode_upload(box=...)``), named with its box."""
        img = bounded_decode(cut, name=name, min_side=self.decode_side)
        return Query(image=img, label=label, name=f"{name} [{','.join(map(str, box))}]")

    def fused(self, parts: Sequence[Query], *, label: str | None = None) -> Query:
        """One Query for several, searched with their normalised mean embedding."""
        queries.check_count(len(parts))
        if not parts:
            raise RequestError("no query: upload an image, or name a gallery image by id or path")
        if len(parts) == 1:
            return parts[0]
        return Query(parts=tuple(parts), label=label or next((p.label for p in parts if p.label), None),
                     name=f"{len(parts)} images fused ({', '.join(p.name for p in parts[:3])}"
                          f"{', ...' if len(parts) > 3 else ''})")

    def query_image(self, q: Query) -> Image.Image:
        """The query's pixels (for gallery queries, decoded from the source index's LMDB)."""
        if q.parts:
            raise RequestError(f"{q.name}: this needs one query image, not several fused")
        if q.image is None:
            data = (q.origin.index if q.origin is not None else self.index(q.source)).image_bytes(q.id)
            q.image = bounded_decode(data, name=q.name, min_side=self.decode_side, stored=True)
        return q.image

    def embed(self, q: Query, index: IndexRef = None) -> np.ndarray:
        """The query's embedding in ``index``'s space, cached on the query."""
        return self._embed(self.snapshot(index), [q])[0]

    def _embed(self, snap: Snapshot, qs: Sequence[Query]) -> np.ndarray:
        """(n, d) embeddings cached on each query: stored vectors for own items, one run for the rest."""
        todo = []
        for q in [p for q in qs for p in (q.parts or (q,))]:
            if snap.name in q.embeddings:
                continue
            if self._own(snap, q):
                try:
                    q.embeddings[snap.name] = np.asarray(snap.index.embeddings([q.id])[0], dtype=np.float32)
                    continue
                except KeyError:  # stored without an embedding for this model: embed afresh
                    pass
            todo.append(q)
        if todo:
            for q, v in zip(todo, snap.index.embed([self.query_image(q) for q in todo])):
                q.embeddings[snap.name] = np.asarray(v, dtype=np.float32)
        for q in qs:
            if q.parts and snap.name not in q.embeddings:
                q.embeddings[snap.name] = queries.fuse(np.stack([p.embeddings[snap.name] for p in q.parts]))
        return np.stack([q.embeddings[snap.name] for q in qs])

    @staticmethod
    def _own(snap: Snapshot, q: Query) -> bool:
        """Whether the gallery query is an item of the index (ids are content hashes: the same
        photo has the same id in every index)."""
        return q.id is not None and (q.source == snap.name or q.id in snap.index)

    # -- search ---------------------------------------------------------------------------
    def check_dba(self, dba: bool | None, index: IndexRef = None) -> bool:
        """None -> the index's default; True on an index built without DBA: RequestError."""
        snap = self.snapshot(index)
        if dba and not snap.index.has_dba:
            raise RequestError(f"dba: index {snap.name!r} was built without DBA re-ranking "
                               "(rebuild it with `indexer build --dba`)")
        return snap.index.has_dba if dba is None else bool(dba)

    def check_labels(self, labels: Sequence[str] | None, index: IndexRef = None) -> tuple[str, ...]:
        """The labels a search is restricted to (none: the whole gallery); one the index lacks:
        RequestError naming it."""
        if not labels:
            return ()
        snap = self.snapshot(index)
        try:
            return tuple(snap.index.check_labels(labels))
        except ValueError as e:
            raise RequestError(f"{e}; index {snap.name!r}") from None

    def _nearest(self, snap: Snapshot, emb: np.ndarray, k: int, exclude: Sequence[int | None] | None,
                 thumbnails: bool, dba: bool, labels: Sequence[str] = ()) -> tuple[list[list[Result]], list[int],
                                                                                  list[float | None]]:
        """Each row's Results (k, dba and labels checked), the shards the answer left out (Ray), and
        each row's novelty p-value (None: the index has no DBA neighbourhoods, or within labels)."""
        found = snap.index.answer(emb, k, dba=dba, exclude=exclude, labels=labels)
        return [[Result(h.id, h.score, h.label, h.path, snap.name,
                        self.thumbnail(snap, h.id) if thumbnails else None)
                 for h in snap.index.hits(s, i)] for s, i in zip(found.scores, found.ids)], list(found.partial), \
            found.p_values()

    def nearest(self, emb: np.ndarray, k: int = 10, *, index: IndexRef = None,
                exclude: Sequence[int | None] | None = None, thumbnails: bool = False,
                dba: bool | None = None, labels: Sequence[str] | None = None) -> list[list[Result]]:
        """Top-k Results of (n, d) embeddings; ``exclude[i]``: an id left out of row i."""
        snap = self.snapshot(index)
        return self._nearest(snap, np.atleast_2d(np.asarray(emb, dtype=np.float32)), check_k(k),
                             None if exclude is None else list(exclude), thumbnails, self.check_dba(dba, snap),
                             self.check_labels(labels, snap))[0]

    def search(self, query: Query | ImageSource | int, k: int = 10, *, index: IndexRef = None,
               exclude_self: bool = True, thumbnails: bool = False, dba: bool | None = None,
               labels: Sequence[str] | None = None) -> SearchResult:
        """Top-k for one query; a gallery query is left out of its own results (exclude_self)."""
        return self.search_batch([query], k, index=index, exclude_self=exclude_self, thumbnails=thumbnails,
                                 dba=dba, labels=labels)[0]

    def search_batch(self, queries: Sequence[Query | ImageSource | int], k: int = 10, *,
                     index: IndexRef = None, exclude_self: bool = True, thumbnails: bool = False,
                     dba: bool | None = None, labels: Sequence[str] | None = None) -> list[SearchResult]:
        """Top-k for many queries: uploads are embedded in one batched session run; ``labels``:
        only images of these labels answer."""
        snap = self.snapshot(index)     # an unknown index, k, dba or label fails before any decoding
        k, dba, only = check_k(k), self.check_dba(dba, snap), self.check_labels(labels, snap)
        qs = [self.query(q, index=snap) for q in queries]
        if not qs:
            return []
        excl = [q.id if exclude_self and self._own(snap, q) else None for q in qs]
        rows, missing, novelty = self._nearest(snap, self._embed(snap, qs), k, excl, thumbnails, dba, only)
        return [SearchResult(snap.name, q, r, dba, missing, p) for q, r, p in zip(qs, rows, novelty)]

    def search_all(self, query: Query | ImageSource | int, k: int = 10, **kw: Any) -> dict[str, SearchResult]:
        """The same query on every open index, side by side."""
        q = self.query(query)
        return {name: self.search(q, k, index=q.on(name), **kw) for name in self.indexes}

    # -- thumbnails -----------------------------------------------------------------------
    def thumbnail_png(self, index: IndexRef, id: int) -> bytes:
        """PNG thumbnail of gallery item ``id``, from LMDB bytes (cached)."""
        snap = self.snapshot(index)
        self._meta(snap, id)
        return self.thumbs.get((snap.name, int(id)), lambda: snap.index.image_bytes(int(id)))

    def thumbnail(self, index: IndexRef, id: int, match: bool | None = None) -> Image.Image:
        img = Image.open(io.BytesIO(self.thumbnail_png(index, id)))
        img.load()
        return framed(img, match)

    # -- probes ---------------------------------------------------------------------------
    def probe(self, query: Query | ImageSource | int, k: int = 6, *, index: IndexRef = None,
              topk: int = 4, scales: Sequence[float] | None = probes.DEFAULT_SCALES, n_random: int = 0,
              scale_range: float = 0.5, shifts: Sequence[float] = probes.DEFAULT_SHIFTS,
              shift_label: str | None = None, seed: int | None = 0,
              thumbnails: bool = False) -> ProbeReport:
        """Semantic scaling and shifting probes (supp. section L) for one query on one index."""
        snap = self.snapshot(index)
        idx, k = snap.index, check_k(k)
        q = self.query(query, index=snap)
        v = self._embed(snap, [q])[0]
        excl = q.id if self._own(snap, q) else None
        notes: list[str] = []
        names: list[str] = []
        kinds: list[str] = []
        embs: list[np.ndarray] = []
        if scales or n_random:
            e, n = probes.semantic_scaling(v, topk=topk, scales=scales, n_random=n_random,
                                           scale_range=scale_range, seed=seed)
            embs.append(e); names += n; kinds += ["scaling"] * len(n)
        label = q.label if (q.label is not None and shift_label is None) else shift_label
        if shifts:
            ids = [i for i in idx.ids_for_label(label) if i != excl] if label is not None else []
            if label is None:
                notes.append("semantic shifting skipped: the query's label is unknown; pick a class")
            elif label not in set(idx.labels()):
                notes.append(f"semantic shifting skipped: class {label!r} is not in index {snap.name!r}")
            elif len(ids) < 2:
                notes.append(f"semantic shifting skipped: class {label!r} has fewer than two "
                             f"gallery images besides the query")
            else:   # two gallery images of the class (not the query): their difference is the shift
                a, b = (int(ids[j]) for j in np.random.default_rng(seed).choice(len(ids), size=2, replace=False))
                ga, gb = idx.embeddings([a, b])
                e, n = probes.semantic_shifting(v, ga, gb, shifts=shifts)
                embs.append(e)
                names += [f"{x} ({label})" for x in n]
                notes.append(f"semantic shifting on {snap.name}: difference of gallery images "
                             f"#{a} and #{b} of class {label!r}")
                kinds += ["shifting"] * len(n)
        all_emb = np.concatenate([v[None]] + embs) if embs else v[None]
        rows = self._nearest(snap, all_emb, k, [excl] * len(all_emb), thumbnails, idx.has_dba)[0]
        orig = rows[0]
        table = probes.stability_rows([r.id for r in orig], [r.score for r in orig], [r.label for r in orig],
                                      [(nm, kd, [r.id for r in rs], [r.score for r in rs], [r.label for r in rs])
                                       for nm, kd, rs in zip(names, kinds, rows[1:])],
                                      k, q.label)
        results = {"original": orig, **{nm: rs for nm, rs in zip(names, rows[1:])}}
        return ProbeReport(snap.name, q, k, table, results, notes)

    def probe_all(self, query: Query | ImageSource | int, k: int = 6, **kw: Any) -> dict[str, ProbeReport]:
        """The same probes on every open index (the paper's baseline vs DAS comparison)."""
        q = self.query(query)
        return {name: self.probe(q, k, index=q.on(name), **kw) for name in self.indexes}

    def audit(self, index: IndexRef = None) -> dict[str, Any]:
        """The gallery audit (``indexer.audit``), computed once per index version."""
        snap = self.snapshot(index)
        directory = self.directories.get(snap.name)
        if directory is None:
            raise RequestError(f"index {snap.name!r} was not opened from a directory: no audit")
        return served_audit(directory)

    def copies(self, query: Query, data: bytes | None, results: Sequence[Result],
               index: IndexRef = None) -> list[dict[str, bool]]:
        """Each result's ``{"copy": bool}``: whether it is the query's own picture (resized,
        re-encoded, cropped; :func:`indexer.audit.copies.copies`). ``data``: the uploaded bytes,
        None for a gallery query (its stored bytes)."""
        from indexer.audit.copies import copies

        snap = self.snapshot(index)
        own = data if data is not None else (query.origin.index if query.origin is not None
                                             else self.index(query.source)).image_bytes(query.id)
        found = copies(lambda _: own, snap.index.image_bytes, [[(r.id, r.score) for r in results]])[0]
        return [{"copy": c} for c in found]

    def label_counts(self, index: IndexRef = None) -> dict[str, int]:
        """Each label of the index (what a search's ``labels`` takes) and its number of images."""
        idx = self.snapshot(index).index
        return {lab: len(idx.ids_for_label(lab)) for lab in sorted(idx.labels())}

    def describe(self, index: IndexRef = None) -> dict[str, Any]:
        """Manifest plus live facts, for the Index tab and GET /api/indexes."""
        snap = self.snapshot(index)
        idx = snap.index
        return {"name": snap.name, "directory": str(self.directories.get(snap.name, "")), "size": len(idx),
                "dim": idx.dim, "labels": len(idx.labels()), "manifest": idx.manifest.to_dict(),
                "memory": idx.faiss.summary}   # codes only: indexer.ann.served


__all__ = ["Searcher", "Snapshot", "Query", "Result", "SearchResult", "ProbeReport", "UnknownIdError",
           "RequestError", "ImageLoadError"]
