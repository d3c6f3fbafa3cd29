"""Database-side augmentation (DBA): each gallery vector replaced, for ranking, by the
similarity^alpha-weighted mean of its k nearest gallery vectors (itself included, weight 1),
re-normalised. Why: an atypical photo is pulled towards its close neighbours, mostly of its
class (R@1 on unseen cub-dev species: docs/benchmarks/indexer.md). A per-request switch: the
faiss index keeps the plain vectors and DBA re-orders its top ``depth`` candidates by their
augmented vectors (``neighbours.npz``), one (depth x d) product.

Per item the file keeps its ``k`` nearest *other* items: ``k - 1`` make the augmented vector, the
last is a spare, so a query that is itself a gallery item is answered as if it were not
(:func:`rerank`, ``exclude``: else leave-one-out figures are inflated). ``indexer add/remove``
(:func:`update`) searches again only the items whose lists can change (equal to a fresh build).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from embedder.knn import exact_knn
from embedder.vectors import l2_normalize

from ..directory.manifest import Manifest, NeighboursRecord
from ..errors import IndexerError

NEIGHBOURS_FILE = "neighbours.npz"
#: Chosen on cub-dev validation species, held-out halves, 10 splits (benchmarks/indexer/neighbour_rerank.py,
#: docs/benchmarks/indexer.md): the best R@1 (within 0.05 of k=8, alpha=7) with the best MAP@R among those.
DEFAULT_K = 8
DEFAULT_ALPHA = 5.0
DEFAULT_DEPTH = 100         # candidates from the plain index that a DBA search re-orders
_BLOCK = 4096               # gallery rows per block of the exact k-NN (bounded memory)
_AUG_BLOCK = 512            # rows per block of augmented vectors: a (512, k - 1, d) gather, 37 MB at 2,560-d
_MARGIN = 1e-5              # float slack when deciding whether an added item may enter a list
#: the augmented vectors are kept (file and memory) in half precision: half of DBA's n x d in the
#: server; rounding moves a coordinate by <= 3e-5 and left leave-one-out R@1 / MAP@R as they were
#: (int8 pair, cub-val 94.26 / 68.40 vs 68.41, cub-test 95.50 / 72.34; 2026-11-30). The price: a
#: query's 100 re-ranked rows converted, ~0.75 ms at 2,560-d (numpy or faiss: 0.3-0.45 ms a 100 x
#: 2,560 block); request p50 1.09x plain instead of ~1.0x (docs/benchmarks/indexer.md)
AUG_DTYPE = np.float16

Vectors = Callable[[np.ndarray], np.ndarray]    # ids -> their plain (normalised) vectors


@dataclass(frozen=True)
class DbaParams:
    """``k``: gallery vectors averaged, the item itself included (k >= 2); ``alpha``: the weight
    exponent of a neighbour's inner product; ``depth``: plain candidates re-ordered per query."""

    k: int = DEFAULT_K
    alpha: float = DEFAULT_ALPHA
    depth: int = DEFAULT_DEPTH

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 2:
            raise IndexerError(f"DBA k={self.k!r}: expected an integer >= 2 (the item and at least one neighbour)")
        if not np.isfinite(self.alpha) or self.alpha < 0:
            raise IndexerError(f"DBA alpha={self.alpha!r}: expected a finite number >= 0")
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 1:
            raise IndexerError(f"DBA depth={self.depth!r}: expected a positive integer")

    @classmethod
    def from_record(cls, rec: NeighboursRecord) -> "DbaParams":
        """The manifest's record (its keys' types checked when it was read)."""
        if rec.method != "dba":
            raise IndexerError(f"manifest neighbours method {rec.method!r}: expected 'dba'")
        return cls(rec.k, float(rec.alpha), rec.depth)


@dataclass
class Neighbourhoods:
    """Every gallery item's neighbour list and augmented vector, rows in ascending id order."""

    params: DbaParams
    ids: np.ndarray         # (n,) int64, ascending
    nbr: np.ndarray         # (n, k) int64: nearest other items, best first, -1 where fewer exist
    sims: np.ndarray        # (n, k) float32: their inner products with the item
    aug: np.ndarray         # (n, d) AUG_DTYPE: augmented, normalised vectors

    def __len__(self) -> int:
        return len(self.ids)

    @cached_property
    def nearest(self) -> np.ndarray:
        """Every item's inner product with its nearest other item, ascending: the reference of
        :func:`indexer.ann.new_photos.novelty` (sorted once per snapshot: 1M items 6 ms; a query
        then costs a binary search, < 1 µs)."""
        return np.sort(self.sims[:, 0])

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Row of each id (-1 for an id not held, e.g. faiss's -1 padding)."""
        ids = np.asarray(ids, dtype=np.int64)
        if not len(self.ids):
            return np.full(ids.shape, -1, np.int64)
        pos = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        return np.where(self.ids[pos] == ids, pos, -1)

    # -- the file ---------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        from embedder.files import atomic_target

        with atomic_target(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, ids=self.ids, nbr=self.nbr, sims=self.sims, aug=self.aug,
                     params=np.array([self.params.k, self.params.alpha, self.params.depth], dtype=np.float64))

    @classmethod
    def load(cls, path: str | Path, params: DbaParams, dim: int) -> "Neighbourhoods":
        """Read ``neighbours.npz``; one line naming the file when it does not match ``params``/``dim``."""
        try:
            with np.load(path, allow_pickle=False) as z:
                nb = cls(params, z["ids"].astype(np.int64), z["nbr"].astype(np.int64),
                         z["sims"].astype(np.float32), z["aug"].astype(AUG_DTYPE, copy=False))
                saved = tuple(z["params"].tolist())
        except (OSError, ValueError, KeyError) as e:
            raise IndexerError(f"{path}: unreadable neighbour file ({str(e).splitlines()[0]}); "
                               "rerun `indexer build` to rewrite it") from None
        n = len(nb.ids)
        if (saved != (params.k, params.alpha, params.depth) or nb.nbr.shape != (n, params.k)
                or nb.sims.shape != (n, params.k) or nb.aug.shape != (n, dim)):
            raise IndexerError(f"{path}: does not match the manifest (k={params.k}, alpha={params.alpha}, "
                               f"{dim}-d); rerun `indexer build` to rewrite it")
        return nb


# ---------------------------------------------------------------------------- building
def neighbour_lists(q_ids: np.ndarray, xq: np.ndarray, ids: np.ndarray, x: np.ndarray, m: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Each query item's ``m`` nearest other gallery items (exact, inner product): (ids, sims),
    (len(q_ids), m), -1 / 0 padded; the item itself dropped by id."""
    nq = len(q_ids)
    if nq == 0:
        return np.zeros((0, m), np.int64), np.zeros((0, m), np.float32)
    sims, nbr = exact_knn(xq, x, m, "ip", ids=ids, own=q_ids, block=_BLOCK)
    return nbr, np.where(nbr >= 0, sims, 0.0).astype(np.float32)


def augment(x_self: np.ndarray, x_nbrs: np.ndarray, sims: np.ndarray, alpha: float) -> np.ndarray:
    """normalise(x + sum_j max(s_j, 0)^alpha x_j): (n, d) from (n, d), (n, m, d), (n, m).
    A padded neighbour (weight 0, any vector) adds nothing."""
    w = np.maximum(sims, 0.0).astype(np.float32) ** np.float32(alpha)
    return l2_normalize(x_self + np.einsum("nm,nmd->nd", w, x_nbrs, dtype=np.float32))


def augment_rows(ids: np.ndarray, x: np.ndarray, nbr: np.ndarray, sims: np.ndarray,
                 rows: np.ndarray, k: int, alpha: float) -> np.ndarray:
    """Augmented vectors (AUG_DTYPE) of gallery ``rows`` from the first k - 1 entries of their
    neighbour lists (gallery ``ids`` ascending, ``x`` aligned), ``_AUG_BLOCK`` rows at a time: the
    whole gallery's (n, k - 1, d) gather at once took 1.8 GB and as long as the k-NN pass itself
    (16 s at 25k x 2,560; 0.6 s in blocks)."""
    out = np.empty((len(rows), x.shape[1]), AUG_DTYPE)
    for b in range(0, len(rows), _AUG_BLOCK):
        r = rows[b:b + _AUG_BLOCK]
        use, s = nbr[r, :k - 1], sims[r, :k - 1].copy()
        s[use < 0] = 0.0
        xn = x[np.searchsorted(ids, np.maximum(use, 0)).clip(0, len(ids) - 1)]
        out[b:b + len(r)] = augment(x[r], xn, s, alpha)
    return out


def _sorted(ids: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(ids, dtype=np.int64)
    order = np.argsort(ids, kind="stable")
    return ids[order], np.ascontiguousarray(np.asarray(x, dtype=np.float32)[order])


def build(ids: np.ndarray, x: np.ndarray, params: DbaParams | None = None,
          *, progress: bool = False) -> Neighbourhoods:
    """Neighbour lists and augmented vectors of a whole gallery: one exact k-NN of the gallery
    against itself, O(n^2 d) (2 Zen 4 cores: 17 s for 25k x 2,560, ~190 GFLOP/s of BLAS). Exact
    on purpose: an IVF-Flat over the same vectors took 7 / 14 / 25 s for 0.94 / 0.98 / 0.995 of
    these lists (its scan is memory-bound), probing lists per cluster 11 s for 0.99 (2026-11-30)."""
    params = params or DbaParams()
    ids, x = _sorted(ids, x)
    nbr = np.full((len(ids), params.k), -1, np.int64)
    sims = np.zeros((len(ids), params.k), np.float32)
    starts = range(0, len(ids), _BLOCK)
    if progress and len(ids) > _BLOCK:
        from tqdm import tqdm

        starts = tqdm(starts, desc="DBA neighbours", unit="block")
    for i in starts:
        nbr[i:i + _BLOCK], sims[i:i + _BLOCK] = neighbour_lists(ids[i:i + _BLOCK], x[i:i + _BLOCK], ids, x, params.k)
    return Neighbourhoods(params, ids, nbr, sims,
                          augment_rows(ids, x, nbr, sims, np.arange(len(ids)), params.k, params.alpha))


def update(nb: Neighbourhoods, ids: np.ndarray, x: np.ndarray) -> tuple[Neighbourhoods, int]:
    """``nb`` brought to the gallery after adds/removes: (new neighbourhoods, items searched
    again); only lists that can change are recomputed, by the exact k-NN a fresh build runs."""
    ids, x = _sorted(ids, x)
    k = nb.params.k
    old_row = nb.rows(ids)                      # row in nb of each current item, -1: added
    added = old_row < 0
    removed = nb.ids[~np.isin(nb.ids, ids)]
    if not added.any() and not len(removed):
        return nb, 0
    nbr = np.where(old_row[:, None] >= 0, nb.nbr[old_row], -1)
    sims = np.where(old_row[:, None] >= 0, nb.sims[old_row], 0.0).astype(np.float32)
    redo = added.copy()
    if len(removed):
        redo |= np.isin(nbr, removed).any(1)
    if added.any() and (~added).any():
        # an old item's list changes only if an added item is at least as close as its last
        # neighbour (or its list is not full yet)
        best, _ = exact_knn(x[~added], x[added], 1, "ip")
        last = np.where(nbr[~added, -1] >= 0, sims[~added, -1], -np.inf)
        old = np.nonzero(~added)[0]
        redo[old[best[:, 0] >= last - _MARGIN]] = True
    rows = np.nonzero(redo)[0]
    for i in range(0, len(rows), _BLOCK):
        r = rows[i:i + _BLOCK]
        nbr[r], sims[r] = neighbour_lists(ids[r], x[r], ids, x, k)
    aug = np.where(old_row[:, None] >= 0, nb.aug[np.maximum(old_row, 0)], 0.0).astype(AUG_DTYPE)
    if len(rows):
        aug[rows] = augment_rows(ids, x, nbr, sims, rows, k, nb.params.alpha)
    return Neighbourhoods(nb.params, ids, nbr, sims, aug), int(len(rows))


# ---------------------------------------------------------------------------- searching
def rerank(nb: Neighbourhoods, q: np.ndarray, cand: np.ndarray, k: int,
           exclude: Sequence[int | None] | None = None, vectors: Vectors | None = None
           ) -> tuple[np.ndarray, np.ndarray]:
    """Re-order each query's plain candidates (``cand``, (n, depth) ids, -1 padded) by inner
    product with their augmented vectors: (scores, ids), (n, k), -1 / NaN padded.
    ``exclude[r]``: the gallery id row r's query *is*: left out of the row, and its neighbours'
    augmented vectors remade without it (``vectors`` reads the plain vectors needed)."""
    q = np.asarray(q, dtype=np.float32)
    n = len(q)
    out_ids = np.full((n, k), -1, np.int64)
    out_sc = np.full((n, k), np.nan, np.float32)
    kk = nb.params.k
    for r in range(n):
        c = cand[r]
        e = None if exclude is None or exclude[r] is None else int(exclude[r])
        c = c[(c >= 0) & (c != (e if e is not None else -1))]
        rows = nb.rows(c)
        c, rows = c[rows >= 0], rows[rows >= 0]     # an id added after this snapshot: not held
        a = nb.aug[rows]
        if e is not None and vectors is not None and len(rows):
            hit = np.nonzero((nb.nbr[rows, :kk - 1] == e).any(1))[0]
            if len(hit):
                a = a.copy()
                try:
                    a[hit] = _without(nb, rows[hit], e, vectors)
                except KeyError:    # a neighbour removed since this snapshot: keep the vectors
                    pass
        s = a.astype(np.float32) @ q[r]
        top = np.argsort(-s, kind="stable")[:k]
        out_ids[r, :len(top)] = c[top]
        out_sc[r, :len(top)] = s[top]
    return out_sc, out_ids


def _without(nb: Neighbourhoods, rows: np.ndarray, e: int, vectors: Vectors) -> np.ndarray:
    """Augmented vectors of ``rows`` made from their first k - 1 neighbours other than ``e``
    (the spare k-th neighbour moves up)."""
    kk = nb.params.k
    lists = [(nb.nbr[r][nb.nbr[r] != e][:kk - 1], nb.sims[r][nb.nbr[r] != e][:kk - 1]) for r in rows]
    need = np.unique(np.concatenate([nb.ids[rows]] + [l[l >= 0] for l, _ in lists]))
    xs = np.asarray(vectors(need), dtype=np.float32)
    at = {int(i): j for j, i in enumerate(need)}
    x_self = xs[[at[int(nb.ids[r])] for r in rows]]
    x_n = np.zeros((len(rows), kk - 1, xs.shape[1]), np.float32)
    w = np.zeros((len(rows), kk - 1), np.float32)
    for j, (l, s) in enumerate(lists):
        for t, (i, si) in enumerate(zip(l, s)):
            if i >= 0:
                x_n[j, t], w[j, t] = xs[at[int(i)]], si
    return augment(x_self, x_n, w, nb.params.alpha)


# ---------------------------------------------------------------------------- in an index directory
def write(directory: str | Path, nb: Neighbourhoods) -> NeighboursRecord:
    """Save ``neighbours.npz`` in ``directory`` (atomically, before the manifest that names it)
    and return the manifest's ``neighbours`` record: parameters, size and sha256."""
    from embedder.hashing import file_sha256

    path = Path(directory) / NEIGHBOURS_FILE
    nb.save(path)
    p = nb.params
    return NeighboursRecord(method="dba", k=p.k, alpha=float(p.alpha), depth=p.depth, file=NEIGHBOURS_FILE,
                            bytes=path.stat().st_size, sha256=file_sha256(path))


#: The arrays of ``neighbours.npz`` and the dtype kind each must have ("i": signed integers,
#: "f": floats); their shapes follow from the manifest (:func:`check`).
_ARRAYS = {"ids": "i", "nbr": "i", "sims": "f", "aug": "f", "params": "f"}
_verified: dict[str, tuple] = {}    # path -> (dev, ino, size, mtime_ns, sha256) last verified here


def _array_headers(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of each array of an ``.npz`` from the zip directory and ``.npy`` headers
    alone (nothing read or unpickled; an object dtype refused); ValueError/OSError otherwise."""
    import zipfile

    out = {}
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        for name in _ARRAYS:
            if f"{name}.npy" not in names:
                raise ValueError(f"no array {name!r} in it (holds {sorted(names)[:6]})")
            with z.open(f"{name}.npy") as f:
                major, _ = np.lib.format.read_magic(f)
                read = (np.lib.format.read_array_header_1_0 if major == 1
                        else np.lib.format.read_array_header_2_0)
                shape, _, dtype = read(f, max_header_size=10_000)
            if dtype.hasobject:
                raise ValueError(f"array {name!r} holds Python objects (a pickle); refused unread")
            out[name] = (tuple(shape), dtype)
    return out


def check(directory: str | Path, manifest: Manifest, *, verify_hash: bool | None = True) -> None:
    """The one check of ``neighbours.npz`` against the manifest (no-op without DBA), at open, by
    ``indexer info`` and ``/api/health``: size, sha256, and its ``.npy`` arrays (never unpickled) of
    the recorded shapes, dtypes and parameters; one line naming the file per failure.
    ``verify_hash``: True always; None only when the file's stamp changed since the last pass here."""
    from ..directory.validate import check_faiss_file, damaged

    rec = manifest.neighbours
    if not rec:
        return
    path = Path(directory) / NEIGHBOURS_FILE
    params = DbaParams.from_record(rec)
    check_faiss_file(path, rec, verify_hash=False)
    if verify_hash is not False and rec.sha256 is not None:
        st = path.stat()
        sig = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, rec.sha256)
        if verify_hash or _verified.get(str(path)) != sig:
            check_faiss_file(path, rec, verify_hash=True)
            _verified[str(path)] = sig
    try:
        heads = _array_headers(path)
        with np.load(path, allow_pickle=False) as z:
            saved = tuple(float(v) for v in np.asarray(z["params"], dtype=np.float64).ravel())
    except Exception as e:  # noqa: BLE001 - zipfile/numpy raise many kinds for a garbled file
        _verified.pop(str(path), None)
        raise damaged(path, f"not a readable neighbour file ({type(e).__name__}: "
                            f"{(str(e).splitlines() or [''])[0][:160]})") from None
    n, k, dim = manifest.count, params.k, manifest.dim
    want = {"ids": (n,), "nbr": (n, k), "sims": (n, k), "aug": (n, dim), "params": (3,)}
    for name, kind in _ARRAYS.items():
        shape, dtype = heads[name]
        if shape != want[name] or dtype.kind != kind:
            _verified.pop(str(path), None)
            raise damaged(path, f"array {name!r} is {shape} {dtype}, the manifest (count {n}, "
                                f"k={k}, {dim}-d) needs {want[name]} of {'integers' if kind == 'i' else 'floats'}")
    if saved != (float(params.k), float(params.alpha), float(params.depth)):
        _verified.pop(str(path), None)
        raise IndexerError(f"{path}: made with k={saved[0]:g}, alpha={saved[1]:g}, depth={saved[2]:g}, "
                           f"the manifest says k={params.k}, alpha={params.alpha:g}, depth={params.depth}; "
                           f"the index is damaged: rebuild it with `python -m indexer build --dba`")


def read(directory: str | Path, manifest: Manifest) -> Neighbourhoods | None:
    """The directory's neighbourhoods when its manifest records DBA (else None), after
    :func:`check` (size, sha256, arrays' shapes and dtypes, k/alpha, row count)."""
    rec = manifest.neighbours
    if not rec:
        return None
    check(directory, manifest)
    path = Path(directory) / NEIGHBOURS_FILE
    return Neighbourhoods.load(path, DbaParams.from_record(rec), manifest.dim)


def remove_file(directory: str | Path) -> None:
    """A rebuild without DBA leaves no stale ``neighbours.npz`` behind."""
    (Path(directory) / NEIGHBOURS_FILE).unlink(missing_ok=True)
