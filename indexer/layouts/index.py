"""``Index``: the read-only, thread-safe query face of an index directory (what serving uses).
``Index.open`` is the one factory: it opens the layout in a serving mode (in RAM, codes only under
``max_memory``, over Ray) and hands the Index every part at construction, never swapped after."""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, NamedTuple, Sequence

import numpy as np

from embedder.knn import drop_self
from embedder.preprocess import Preprocessing
from embedder.vectors import l2_normalize

from ..ann.faiss_index import omp_threads
from ..ann.neighbours import Neighbourhoods
from ..ann.subset import subset_search
from ..directory.model import load_embedder
from ..errors import IndexerError
from ..searchable import Searchable
from ..store.gallery import GalleryStore
from .layout import Layout, layout_of


class Found(NamedTuple):
    """What :meth:`Index.answer` gives: the searchable's :class:`Answer` (scores, ids, partial) and
    ``novelty``, each query's p-value of having no close match (with DBA neighbourhoods:
    :func:`indexer.ann.new_photos.novelty`; None without them or within labels)."""

    scores: np.ndarray
    ids: np.ndarray
    partial: tuple[int, ...] = ()
    novelty: np.ndarray | None = None

    def p_values(self) -> list[float | None]:
        """``novelty`` as one float (or None) per query row."""
        return [None] * len(self.ids) if self.novelty is None else [float(p) for p in self.novelty]


@dataclass
class Hit:
    id: int
    score: float
    label: str | None
    path: str


class Index:
    """An opened index directory, safe for concurrent queries from threads (faiss only read, LMDB
    read-only per process, onnxruntime thread-safe); the embedder loads on first use. A snapshot:
    :meth:`reopen` gives the directory's current state."""

    def __init__(self, layout: Layout, store: GalleryStore, searchable: Searchable,
                 neighbours: Neighbourhoods | None, *, device: str = "auto", max_memory: int | None = None,
                 ray: Any = None, embedder: Any = None) -> None:
        """Every part as :meth:`open` made it (``max_memory``, ``ray``: the serving mode, kept
        by :meth:`reopen`; ``embedder``: a loaded one of this index's model, else loaded lazily)."""
        self.layout, self.manifest, self.files = layout, layout.manifest, layout.d
        self.directory: Path = layout.d.path
        self.store, self.faiss, self.neighbours = store, searchable, neighbours
        self.dim: int = self.manifest.dim
        self.model_hash: str = self.manifest.model_hash
        self.max_memory, self.ray = max_memory, ray
        self._device = device
        self._embedder: Any = embedder
        self._lock = threading.Lock()

    @classmethod
    def open(cls, directory: str | Path, *, device: str = "auto", check_model: bool = False,
             store: GalleryStore | None = None, max_memory: int | str | None = None,
             ray: Any = None, embedder: Any = None) -> "Index":
        """Open an index directory of either layout after checking its files (a damaged one: one line
        naming it). ``check_model``: require ``model.onnx``; ``store``: reuse an open one; ``max_memory``:
        the SERVING budget (codes only, :mod:`indexer.ann.served`); ``ray``: an address or a
        :class:`RayServing` (:mod:`indexer.ray.fanout`); ``embedder``: kept if it is this index's model."""
        if ray is not None and max_memory is not None:
            raise IndexerError("--max-memory and --ray exclude each other: over Ray each shard's "
                               "actor holds its own part")
        layout = layout_of(directory)
        m = layout.manifest
        store, fi, nb = layout.open(device=device, check_model=check_model, store=store,
                                    mmap=max_memory is not None, ray=ray)
        budget = None
        if max_memory is not None:
            from embedder.cli import memory_size

            from ..ann.served import serve_codes

            budget = memory_size(max_memory)
            fi = serve_codes(fi, store, m.model_hash, budget)
        if embedder is not None and (embedder.model_hash, embedder.dim) != (m.model_hash, m.dim):
            embedder = None
        return cls(layout, store, fi, nb, device=device, max_memory=budget, ray=ray, embedder=embedder)

    def reopen(self) -> "Index":
        """The directory's current state as a new Index, sharing this one's store and (same
        model) embedder; this Index stays usable for requests still running on it."""
        return Index.open(self.directory, device=self._device, store=self.store, max_memory=self.max_memory,
                          ray=self.ray, embedder=self._embedder)

    @property
    def embedder(self) -> Any:
        """The index's own embedder (``model.onnx`` in the directory), loaded once, lazily."""
        if self._embedder is None:
            with self._lock:
                if self._embedder is None:
                    emb = load_embedder(self.files.model_file, device=self._device)
                    self.files.check_embedder(emb, self.manifest)
                    self._embedder = emb
        return self._embedder

    def __len__(self) -> int:
        return int(self.faiss.ntotal)

    @property
    def has_dba(self) -> bool:
        """Whether the index was built with DBA neighbourhoods (``indexer build --dba``)."""
        return self.neighbours is not None

    def search_embeddings(self, emb: np.ndarray, k: int = 10, *, dba: bool | None = None,
                          exclude: Sequence[int | None] | None = None,
                          labels: Collection[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) of :meth:`answer` (what most callers need: an index in one process
        never leaves a shard out)."""
        found = self.answer(emb, k, dba=dba, exclude=exclude, labels=labels)
        return found.scores, found.ids

    def answer(self, emb: np.ndarray, k: int = 10, *, dba: bool | None = None,
               exclude: Sequence[int | None] | None = None, labels: Collection[str] | None = None) -> Found:
        """(scores, ids, partial), each (n, k'), k' = min(k, len(self)); id -1 pads short IVF answers;
        ``partial``: shards a Ray-served index left out; ``novelty``: each query's p-value of no close
        match (with DBA neighbourhoods, none within labels). Queries are L2-normalised here. ``dba``: re-rank
        with the augmented vectors (None: as built). ``exclude[r]``: the gallery id query r is, left out
        of its row and, with DBA, of its neighbours' augmented vectors. ``labels``: only images of these
        labels answer (:mod:`indexer.ann.subset`; a label the index lacks: ValueError)."""
        q = np.asarray(emb, dtype=np.float32)
        if q.ndim == 1:
            q = q[None, :]
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise ValueError(f"query embeddings of shape {tuple(np.shape(emb))}: dimension mismatch, "
                             f"expected (n, {self.dim})")
        if k < 1:
            raise ValueError(f"k={k}: expected k >= 1")
        if dba and self.neighbours is None:
            raise ValueError(f"{self.directory}: built without DBA neighbourhoods; rebuild it with "
                             "`indexer build --dba` to re-rank with them")
        dba = self.neighbours is not None if dba is None else bool(dba)
        if exclude is not None and len(exclude) != len(q):
            raise ValueError(f"exclude: expected {len(q)} entries (one per query), got {len(exclude)}")
        own = None if exclude is None or all(e is None for e in exclude) else \
            np.array([-1 if e is None else int(e) for e in exclude], dtype=np.int64)
        allowed = None if not labels else self.label_ids(labels)
        q = l2_normalize(q)
        k = min(k, len(self))
        # One query: faiss parallelises over queries, so a second OpenMP thread only runs trivial
        # loops (IndexIDMap's id translation) and then spins ~10 ms taking a core from the next
        # embedding: on 2 cores searches looped in a script ran 2x slower, served ones ~1.4x
        # (docs/benchmarks/serving.md).
        with omp_threads(1 if len(q) == 1 else None):
            return self._answer(q, k, dba, own, exclude, allowed)

    def _answer(self, q: np.ndarray, k: int, dba: bool, own: np.ndarray | None,
                exclude: Sequence[int | None] | None, allowed: np.ndarray | None) -> Found:
        nb = self.neighbours if dba else None
        # DBA re-ranks the plain top ``depth``; a query that is a gallery item asks one more
        want = min((k if nb is None else max(nb.params.depth, k)) + (own is not None), len(self))
        scores, ids, partial = self.faiss.search(q, want) if allowed is None else \
            subset_search(self.faiss.search, self.embeddings, allowed, q, want, len(self), need=k + (own is not None))
        p = None
        if self.neighbours is not None and allowed is None:     # within labels: not the gallery's reference
            from ..ann.new_photos import novelty

            top = scores[:, 0] if own is None else drop_self(ids, own, 1, scores)[1][:, 0]
            p = novelty(self.neighbours, np.nan_to_num(top, nan=-1.0))
        if nb is not None:
            from ..ann.neighbours import rerank

            return Found(*rerank(nb, q, ids, k, exclude=None if own is None else list(exclude),
                                 vectors=lambda ids: self.embeddings(ids)), partial, p)
        if own is not None:
            ids, scores = drop_self(ids, own, k, scores)
        return Found(scores, ids, partial, p)

    def check_labels(self, labels: str | Collection[str]) -> list[str]:
        """``labels`` as a list, each one the index holds (else ValueError naming the first it lacks)."""
        labels = [labels] if isinstance(labels, str) else list(labels)
        known = set(self.labels())
        missing = [lab for lab in labels if lab not in known]
        if missing:
            raise ValueError(f"label {missing[0][:80]!r}: no image has it (the index has {len(known)} labels"
                             + (f", e.g. {sorted(known)[0]!r})" if known else ")"))
        return labels

    def label_ids(self, labels: str | Collection[str]) -> np.ndarray:
        """The ids of every image of ``labels`` (:meth:`check_labels`), ascending."""
        labels = self.check_labels(labels)
        return np.unique(np.concatenate([np.asarray(self.ids_for_label(lab), np.int64) for lab in labels]))

    def hits(self, scores: np.ndarray, ids: np.ndarray) -> list[Hit]:
        """One query's row of (scores, ids) as Hits; ids the store no longer has are dropped."""
        metas = self.store.get_metas([int(i) for i in ids if i >= 0])
        return [Hit(int(i), float(s), m.get("label"), m["path"])
                for s, i in zip(scores, ids) if (m := metas.get(int(i))) is not None]

    def search(self, images: Sequence[Any], k: int = 10, *, dba: bool | None = None) -> list[list[Hit]]:
        """Embed ``images`` (paths, bytes or PIL images) and return the top-k hits of each
        (``dba``: as :meth:`search_embeddings`); ImageLoadError names an unreadable image."""
        if len(images) == 0:
            return []
        scores, ids = self.search_embeddings(self.embed(images), k, dba=dba)
        return [self.hits(s, i) for s, i in zip(scores, ids)]

    def embed(self, images: Sequence[Any]) -> np.ndarray:
        """(n, dim) embeddings of ``images`` (paths, bytes or PIL images) by the index's own
        model, the space its vectors live in; ImageLoadError names an unreadable image."""
        return self.embedder.embed(list(images))

    @property
    def decode_side(self) -> int:
        """The shorter side an image needs to be decoded at for this index's model, from the
        manifest's preprocessing (before the model loads); the default's when none is recorded."""
        try:
            return Preprocessing.from_dict(json.loads(self.manifest.model.metadata["preprocessing"])).decode_side
        except (KeyError, TypeError, ValueError):
            return Preprocessing().decode_side

    def embeddings(self, ids: Sequence[int]) -> np.ndarray:
        """Stored (normalised) gallery embeddings, in the order of ``ids``; KeyError if unknown."""
        if len(ids) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        return self.store.get_embeddings(self.model_hash, [int(i) for i in ids])

    # -- the gallery behind the index (what serving reads; ids are content hashes) ----------
    def __contains__(self, id: object) -> bool:
        return id in self.store

    def meta(self, id: int) -> dict:
        """path, paths, label, width, height, sha256, bytes of a stored image; KeyError if none."""
        return self.store.get_meta(int(id))

    def metas(self, ids: Sequence[int]) -> dict[int, dict]:
        """:meth:`meta` of those of ``ids`` the store holds, in one read transaction."""
        return self.store.get_metas([int(i) for i in ids])

    def image_bytes(self, id: int) -> bytes:
        return self.store.get_bytes(int(id))

    def id_for_path(self, rel_path: str) -> int | None:
        return self.store.id_for_path(str(rel_path))

    def labels(self) -> list[str]:
        return self.store.labels()

    def ids_for_label(self, label: str) -> list[int]:
        return self.store.ids_for_label(label)

    def stored(self) -> int:
        """How many images the store holds: a real LMDB read (``len(self)`` is faiss's count),
        after reading each database's first record (garbage there: StoreUnavailable)."""
        self.store.probe()
        return len(self.store)

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> "Index":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        m = self.manifest
        return f"Index({str(self.directory)!r}, {m.index_type}, n={len(self)}, dim={self.dim}, nprobe={m.nprobe})"
