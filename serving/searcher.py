"""Searcher: one or more read-only indexes answering image queries, with thumbnails and probes.

Several indexes can be open at once (say one built with a baseline embedder and one with a DAS
embedder); every query and probe can run on each so the models are compared side by side, as
the paper does in Figs. V-VI. Indexes are opened read-only and are safe for concurrent queries
(onnxruntime sessions and faiss CPU searches are re-entrant; LMDB readers are per thread), so
one Searcher serves all web workers. Directories given to :meth:`Searcher.open` are watched:
after ``indexer add/remove`` the new state replaces the old between requests (serving.reload).
"""
from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from PIL import Image

from embedder import ImageLoadError
from embedder.images import DEFAULT_MAX_PIXELS
from embedder.preprocess import Preprocessing
from indexer import Index, IndexDir, check_counts

from . import probes
from .reload import IndexWatcher
from .results import ProbeReport, Query, RequestError, Result, SearchResult, UnknownIdError, check_k
from .thumbs import ThumbnailCache, framed
from .uploads import bounded_decode

ImageSource = str | Path | bytes | Image.Image


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
        self.decode_side = max(_decode_side(idx.manifest) for idx in self.indexes.values())

    @classmethod
    def open(cls, directories: Sequence[str | Path] | str | Path, *, names: Sequence[str] | None = None,
             device: str = "auto", check_model: bool = False, max_memory: int | str | None = None,
             **kw: Any) -> "Searcher":
        """Open each index directory read-only; names default to the directory names.
        ``check_model`` also requires each directory's model.onnx (what a server needs).
        ``max_memory``: each index holds at most that much in RAM, as codes re-ranked with the
        exact vectors of its store (``indexer.rerank``; kept across reloads)."""
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
            opened[name] = Index.open(d, device=device, check_model=check_model, max_memory=max_memory)
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

    def health(self) -> dict[str, str]:
        """index name -> problem, for every index that is not fully served (empty: healthy).
        Each store gets a real read, so a store LMDB cannot read shows up here, not as a 500."""
        problems = {}
        for name in self.indexes:
            try:
                self.index(name).stored()
            except Exception as e:  # noqa: BLE001 - reported, not raised
                problems[name] = f"index {name!r}: gallery store unreadable ({str(e).splitlines()[0]})"
                continue
            try:    # store, index.faiss and manifest agree on the count (issue 19)
                counts = check_counts(self.indexes[name].directory, store=self.indexes[name].store)
                if not counts.ok:
                    problems[name] = f"index {name!r}: {counts.message}"
            except Exception as e:  # noqa: BLE001 - reported, not raised
                problems[name] = f"index {name!r}: {str(e).splitlines()[0]}"
        return {**self.watcher.problems(), **problems}

    def _check_id(self, index: str, id: int) -> dict:
        idx = self.index(index)
        if isinstance(id, bool) or not isinstance(id, (int, np.integer)) or not 0 <= int(id) < 2 ** 63:
            raise UnknownIdError(f"id {id!r} is not in index {index!r} (ids are integers from 0 to 2**53)")
        try:
            return idx.meta(int(id))
        except KeyError:
            raise UnknownIdError(f"id {id!r} is not in index {index!r}") from None

    # -- queries --------------------------------------------------------------------------
    def query(self, image: Query | ImageSource | int | None = None, *, id: int | str | None = None,
              path: str | None = None, index: str | None = None, label: str | None = None,
              name: str | None = None) -> Query:
        """The one way to a Query (the API, the UI and every Searcher method come here): an image,
        decoded now (a bad file fails here with ImageLoadError); else a gallery id (an integer,
        also as the first argument, or the digits a form sends) or a gallery-relative path
        (looked up in the store, never read from disk) in ``index``. A Query is returned as it
        is. ``label`` sets or overrides the query's label. UnknownIdError for an id or path the
        index does not have; RequestError for no query or a malformed id."""
        if isinstance(image, Query):
            return image
        if isinstance(image, (int, np.integer)) and not isinstance(image, bool):
            image, id = None, int(image)
        if image is not None:
            img = bounded_decode(image, name=name, min_side=self.decode_side, max_pixels=DEFAULT_MAX_PIXELS)
            nm = name or (str(image) if isinstance(image, (str, Path)) else "query")
            return Query(image=img, label=label, name=nm)
        index = index or self.default
        if id is None and path is not None:
            id = self.index(index).id_for_path(path)
            if id is None:
                raise UnknownIdError(f"path {path!r} is not in index {index!r}")
        if isinstance(id, str):
            try:
                id = int(id)
            except ValueError:
                raise RequestError(f"id: expected an integer gallery id, got {id!r}") from None
        if id is None:
            raise RequestError("no query: upload an image, or name a gallery image by id or path")
        meta = self._check_id(index, id)
        return Query(id=int(id), source=index, label=label or meta.get("label"), path=meta.get("path"),
                     name=meta.get("path") or f"{index}#{id}")

    def query_image(self, q: Query) -> Image.Image:
        """The query's pixels (for gallery queries, decoded from the source index's LMDB)."""
        if q.image is None:
            data = self.index(q.source).image_bytes(q.id)
            q.image = bounded_decode(data, name=q.name, min_side=self.decode_side,
                                     max_pixels=DEFAULT_MAX_PIXELS)
        return q.image

    def embed(self, q: Query, index: str | None = None) -> np.ndarray:
        """The query's embedding in ``index``'s space, cached on the query."""
        index = index or self.default
        if index not in q.embeddings:
            idx = self.index(index)
            v = None
            if self._own(q, index):
                try:
                    v = idx.embeddings([q.id])[0]
                except KeyError:  # stored without an embedding for this model: embed afresh
                    v = None
            if v is None:
                v = idx.embedder.embed([self.query_image(q)])[0]
            q.embeddings[index] = np.asarray(v, dtype=np.float32)
        return q.embeddings[index]

    def _own(self, q: Query, index: str) -> bool:
        """Whether the gallery query is an item of ``index``: ids are content hashes, so the same
        photo has the same id in every index that holds it (and is left out of its results)."""
        if q.id is None:
            return False
        return q.source == index or q.id in self.index(index)

    def _exclude(self, q: Query, index: str, exclude_self: bool = True) -> int | None:
        return q.id if exclude_self and self._own(q, index) else None

    # -- search ---------------------------------------------------------------------------
    def check_dba(self, dba: bool | None, index: str | None = None) -> bool | None:
        """``dba`` as a request may ask it of ``index``: None (the index's default) and False
        always; True only of an index built with DBA neighbourhoods (else a RequestError)."""
        name = index or self.default
        if dba and not self.index(name).has_dba:
            raise RequestError(f"dba: index {name!r} was built without DBA re-ranking "
                               "(rebuild it with `indexer build --dba`)")
        return dba

    def nearest(self, emb: np.ndarray, k: int = 10, *, index: str | None = None,
                exclude: Sequence[int | None] | None = None, thumbnails: bool = False,
                dba: bool | None = None) -> list[list[Result]]:
        """Top-k Results of (n, d) query embeddings in ``index``; ``exclude[i]`` is an id to
        leave out of row i (the query itself; with DBA, also out of its neighbours' augmented
        vectors). ``dba``: DBA re-ranking (None: the index's default, on when it has it). Ids
        the store no longer has are skipped."""
        index = index or self.default
        k = check_k(k)
        emb = np.ascontiguousarray(np.atleast_2d(np.asarray(emb, dtype=np.float32)))
        idx = self.index(index)
        dba = self.check_dba(dba, index)
        exclude = list(exclude) if exclude is not None else [None] * len(emb)
        scores, ids = idx.search_embeddings(emb, min(k, len(idx)), dba=dba, exclude=exclude)
        rows = [idx.hits(scores[r], ids[r])[:k] for r in range(len(emb))]
        return [[Result(h.id, h.score, h.label, h.path, index,
                        self.thumbnail(index, h.id) if thumbnails else None) for h in row] for row in rows]

    def search(self, query: Query | ImageSource | int, k: int = 10, *, index: str | None = None,
               exclude_self: bool = True, thumbnails: bool = False, dba: bool | None = None) -> SearchResult:
        """Top-k for one query (an image, a gallery id, or a Query). A gallery query is left out
        of its own results unless exclude_self is False. ``dba``: as :meth:`nearest`."""
        return self.search_batch([query], k, index=index, exclude_self=exclude_self, thumbnails=thumbnails,
                                 dba=dba)[0]

    def search_batch(self, queries: Sequence[Query | ImageSource | int], k: int = 10, *,
                     index: str | None = None, exclude_self: bool = True,
                     thumbnails: bool = False, dba: bool | None = None) -> list[SearchResult]:
        """Top-k for many queries: uploads are embedded in one batched session run."""
        index = index or self.default
        self.index(index)  # an unknown index fails before any decoding
        check_k(k)
        self.check_dba(dba, index)
        qs = [self.query(q) for q in queries]
        if not qs:
            return []
        todo = [q for q in qs if index not in q.embeddings and not self._own(q, index)]
        if todo:
            embs = self.index(index).embedder.embed([self.query_image(q) for q in todo])
            for q, v in zip(todo, embs):
                q.embeddings[index] = np.asarray(v, dtype=np.float32)
        emb = np.stack([self.embed(q, index) for q in qs])
        excl = [self._exclude(q, index, exclude_self) for q in qs]
        rows = self.nearest(emb, k, index=index, exclude=excl, thumbnails=thumbnails, dba=dba)
        return [SearchResult(index, q, r) for q, r in zip(qs, rows)]

    def search_all(self, query: Query | ImageSource | int, k: int = 10, **kw: Any) -> dict[str, SearchResult]:
        """The same query on every open index, side by side."""
        q = self.query(query)
        return {name: self.search(q, k, index=name, **kw) for name in self.indexes}

    # -- thumbnails -----------------------------------------------------------------------
    def thumbnail_png(self, index: str, id: int) -> bytes:
        """PNG thumbnail of gallery item ``id``, from LMDB bytes (cached)."""
        self._check_id(index, id)
        idx = self.index(index)
        return self.thumbs.get((index, int(id)), lambda: idx.image_bytes(int(id)))

    def thumbnail(self, index: str, id: int, match: bool | None = None) -> Image.Image:
        img = Image.open(io.BytesIO(self.thumbnail_png(index, id)))
        img.load()
        return framed(img, match)

    # -- probes ---------------------------------------------------------------------------
    def shift_pair(self, index: str, label: str, *, exclude: int | None = None,
                   seed: int | None = 0) -> tuple[int, int] | None:
        """Two gallery ids of ``label`` (not the query) whose difference is the shift; None when
        the class has fewer than two other images."""
        ids = [i for i in self.index(index).ids_for_label(label) if i != exclude]
        if len(ids) < 2:
            return None
        rng = np.random.default_rng(seed)
        a, b = rng.choice(len(ids), size=2, replace=False)
        return int(ids[a]), int(ids[b])

    def probe(self, query: Query | ImageSource | int, k: int = 6, *, index: str | None = None,
              topk: int = 4, scales: Sequence[float] | None = probes.DEFAULT_SCALES, n_random: int = 0,
              scale_range: float = 0.5, shifts: Sequence[float] = probes.DEFAULT_SHIFTS,
              shift_label: str | None = None, seed: int | None = 0,
              thumbnails: bool = False) -> ProbeReport:
        """Semantic scaling and shifting probes (supp. section L) for one query on one index."""
        index = index or self.default
        self.index(index)
        check_k(k)
        q = self.query(query)
        v = self.embed(q, index)
        excl = self._exclude(q, index)
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
            if label is None:
                notes.append("semantic shifting skipped: the query's label is unknown; pick a class")
            elif label not in set(self.index(index).labels()):
                notes.append(f"semantic shifting skipped: class {label!r} is not in index {index!r}")
            else:
                pair = self.shift_pair(index, label, exclude=excl, seed=seed)
                if pair is None:
                    notes.append(f"semantic shifting skipped: class {label!r} has fewer than two "
                                 f"gallery images besides the query")
                else:
                    ga, gb = self.index(index).embeddings(list(pair))
                    e, n = probes.semantic_shifting(v, ga, gb, shifts=shifts)
                    embs.append(e)
                    names += [f"{x} ({label})" for x in n]
                    notes.append(f"semantic shifting on {index}: difference of gallery images "
                                 f"#{pair[0]} and #{pair[1]} of class {label!r}")
                    kinds += ["shifting"] * len(n)
        all_emb = np.concatenate([v[None]] + embs) if embs else v[None]
        rows = self.nearest(all_emb, k, index=index, exclude=[excl] * len(all_emb), thumbnails=thumbnails)
        orig = rows[0]
        table = probes.stability_rows([r.id for r in orig], [r.score for r in orig], [r.label for r in orig],
                                 [(nm, kd, [r.id for r in rs], [r.score for r in rs], [r.label for r in rs])
                                  for nm, kd, rs in zip(names, kinds, rows[1:])],
                                 k, q.label)
        results = {"original": orig, **{nm: rs for nm, rs in zip(names, rows[1:])}}
        return ProbeReport(index, q, k, table, results, notes)

    def probe_all(self, query: Query | ImageSource | int, k: int = 6, **kw: Any) -> dict[str, ProbeReport]:
        """The same probes on every open index (the paper's baseline vs DAS comparison)."""
        q = self.query(query)
        return {name: self.probe(q, k, index=name, **kw) for name in self.indexes}

    def describe(self, index: str | None = None) -> dict[str, Any]:
        """Manifest plus live facts, for the Index tab and GET /api/indexes."""
        index = index or self.default
        idx = self.index(index)
        return {"name": index, "directory": str(self.directories.get(index, "")), "size": len(idx),
                "dim": idx.dim, "labels": len(idx.labels()), "manifest": idx.manifest.to_dict(),
                "memory": getattr(idx.faiss, "summary", None)}   # codes only: indexer.rerank


def _decode_side(manifest: dict) -> int:
    """The decode size an index's embedder needs (from the preprocessing its manifest records)."""
    try:
        pre = (manifest.get("model") or {}).get("metadata", {}).get("preprocessing")
        return Preprocessing.from_dict(json.loads(pre)).decode_side
    except (TypeError, ValueError, AttributeError):
        return Preprocessing().decode_side


__all__ = ["Searcher", "Query", "Result", "SearchResult", "ProbeReport", "UnknownIdError", "RequestError",
           "ImageLoadError"]
