"""faiss: choosing, training, tuning and persisting the vector index.

Inner product on L2-normalised embeddings (cosine). Small galleries get an exact Flat index;
above a threshold, IVF-Flat with ``nlist`` derived from the gallery size; IVF-PQ and IVF-SQ8 are
options for large galleries. ``nprobe`` is tuned to the smallest value that reaches a recall@10
target against exact search (autofaiss tunes under a latency cap instead; we promise recall).
"""
from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, asdict
from pathlib import Path

import faiss
import numpy as np

from .errors import IndexerError
from .manifest import atomic_target

INDEX_TYPES = ("auto", "flat", "ivf", "ivfpq", "sq8")
DEFAULT_FLAT_THRESHOLD = 20_000
MIN_POINTS_PER_CENTROID = 39        # faiss warns below this many training points per centroid
TRAIN_POINTS_PER_CENTROID = 64      # k-means sample per centroid: 39 is faiss's floor, 256 its cap;
                                    # 64 trains a 1M gallery's 4096 lists in tens of seconds on 2 cores
KMEANS_ITERATIONS = 10
PQ_TRAIN_POINTS = 256 * MIN_POINTS_PER_CENTROID   # PQ codebooks have 256 centroids each


@dataclass
class IndexSpec:
    """What to build; stored in the manifest."""

    index_type: str           # "flat" | "ivf" | "ivfpq" | "sq8"
    factory: str              # faiss.index_factory string
    nlist: int = 0
    pq_m: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def nlist_for(n: int) -> int:
    """Number of IVF lists for ``n`` vectors.

    The usual 4*sqrt(n) (rounded to a power of two), but never fewer than 39 training points per
    centroid, so a small gallery forced onto IVF still trains cleanly.
    """
    if n < MIN_POINTS_PER_CENTROID:
        return 1
    target = 2 ** round(math.log2(max(1.0, 4 * math.sqrt(n))))
    return int(max(1, min(target, n // MIN_POINTS_PER_CENTROID)))


def pq_m_for(dim: int) -> int:
    """Sub-quantizers for IVF-PQ: about 4 dims each (good recall), a divisor of dim, <= 64."""
    for m in sorted({d for d in range(1, dim + 1) if dim % d == 0}, key=lambda m: abs(m - dim // 4)):
        if m <= 64:
            return m
    return 1


def choose_spec(n: int, dim: int, index_type: str = "auto",
                flat_threshold: int = DEFAULT_FLAT_THRESHOLD, nlist: int | None = None) -> IndexSpec:
    if index_type not in INDEX_TYPES:
        raise IndexerError(f"index type {index_type!r}: expected one of {', '.join(INDEX_TYPES)}")
    if n <= 0:
        raise IndexerError("cannot build an index of an empty gallery")
    if index_type == "auto":
        index_type = "flat" if n < flat_threshold else "ivf"
    if index_type == "flat":
        return IndexSpec("flat", "IDMap2,Flat")
    nl = int(nlist) if nlist else nlist_for(n)
    if nl < 1 or nl > n:
        raise IndexerError(f"nlist {nl}: expected 1 <= nlist <= gallery size {n}")
    if index_type == "ivf":
        return IndexSpec("ivf", f"IVF{nl},Flat", nl)
    if index_type == "sq8":
        return IndexSpec("sq8", f"IVF{nl},SQ8", nl)
    m = pq_m_for(dim)
    if n < PQ_TRAIN_POINTS:
        raise IndexerError(f"ivfpq needs at least {PQ_TRAIN_POINTS} images to train its "
                           f"codebooks, the gallery has {n}; use ivf or sq8")
    return IndexSpec("ivfpq", f"IVF{nl},PQ{m}", nl, m)


def use_gpu(device: str = "auto") -> bool:
    if device == "cpu":
        return False
    n = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if device in ("cuda", "gpu") and n == 0:
        raise IndexerError(f"device {device!r}: faiss sees no GPU")
    return n > 0


def training_sample(n: int, spec: IndexSpec, seed: int = 0) -> np.ndarray:
    """Row numbers used to train the quantizer: deterministic for a given gallery size.

    Rows are positions in the id-sorted gallery, so a single-process build and a merge of
    shards pick the very same vectors.
    """
    if spec.index_type == "flat":
        return np.zeros(0, dtype=np.int64)
    want = max(spec.nlist * TRAIN_POINTS_PER_CENTROID, PQ_TRAIN_POINTS if spec.pq_m else 0)
    if n <= want:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=want, replace=False)).astype(np.int64)


def new_index(spec: IndexSpec, dim: int) -> faiss.Index:
    return faiss.index_factory(dim, spec.factory, faiss.METRIC_INNER_PRODUCT)


def train(spec: IndexSpec, x_train: np.ndarray, dim: int, *, device: str = "auto",
          seed: int = 0) -> faiss.Index:
    """An empty, trained index (the shared quantizer that shards merge into)."""
    index = new_index(spec, dim)
    if spec.index_type == "flat":
        return index
    ivf = faiss.extract_index_ivf(index)
    ivf.cp.seed = seed
    ivf.cp.niter = KMEANS_ITERATIONS
    clustering_index = None
    if use_gpu(device):   # k-means on the GPU, the rest stays a CPU index (code path untested here)
        clustering_index = faiss.index_cpu_to_all_gpus(faiss.IndexFlatIP(dim))
        ivf.clustering_index = clustering_index
    index.train(np.ascontiguousarray(x_train, dtype=np.float32))
    if clustering_index is not None:
        ivf.clustering_index = None
    return index


def add(index: faiss.Index, x: np.ndarray, ids: np.ndarray, chunk: int = 65536) -> None:
    x = np.ascontiguousarray(x, dtype=np.float32)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    for s in range(0, len(ids), chunk):
        index.add_with_ids(x[s:s + chunk], ids[s:s + chunk])


def index_ids(index: faiss.Index) -> np.ndarray:
    """Every id an index holds (sorted), for syncing it with the store after a crash."""
    if isinstance(index, (faiss.IndexIDMap, faiss.IndexIDMap2)) or hasattr(index, "id_map"):
        return np.sort(faiss.vector_to_array(index.id_map).astype(np.int64))
    ivf = faiss.extract_index_ivf(index)
    inv = ivf.invlists
    parts = []
    for l in range(ivf.nlist):
        sz = inv.list_size(l)
        if sz:
            ptr = inv.get_ids(l)
            parts.append(faiss.rev_swig_ptr(ptr, sz).copy())
            inv.release_ids(l, ptr)
    return np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)


def set_nprobe(index: faiss.Index, nprobe: int) -> None:
    if nprobe:
        faiss.extract_index_ivf(index).nprobe = int(nprobe)


def exact_neighbours(x: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """Exact top-k row numbers by inner product (the ground truth for tuning)."""
    flat = faiss.IndexFlatIP(x.shape[1])
    flat.add(np.ascontiguousarray(x, dtype=np.float32))
    return flat.search(np.ascontiguousarray(queries, dtype=np.float32), k)[1]


def recall_vs_exact(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean fraction of the exact top-k that the approximate top-k also returned."""
    k = truth.shape[1]
    hits = sum(len(np.intersect1d(f[f >= 0], t, assume_unique=False)) for f, t in zip(found, truth))
    return hits / (k * len(truth))


def tuning_queries(n: int, n_queries: int = 1000, exclude_rows: np.ndarray | None = None,
                   seed: int = 0) -> np.ndarray:
    """Rows used as self-queries for tuning: held out of quantizer training when enough are."""
    rng = np.random.default_rng(seed + 1)
    pool = np.arange(n)
    if exclude_rows is not None and n - len(exclude_rows) >= min(n_queries, n) // 2:
        pool = np.setdiff1d(pool, exclude_rows)
    return np.sort(rng.choice(pool, size=min(n_queries, len(pool)), replace=False))


def tune_nprobe(index: faiss.Index, x: np.ndarray, ids: np.ndarray, *, target: float = 0.95,
                k: int = 10, n_queries: int = 1000, exclude_rows: np.ndarray | None = None,
                seed: int = 0) -> tuple[int, float]:
    """Smallest nprobe whose recall@k against exact search reaches ``target``.

    Queries are gallery vectors held out of quantizer training where possible, and each is
    held out of its own results (top k+1 minus itself, in both the exact and the approximate
    answer): a vector always finds itself in its own list, which would flatter the recall that
    queries from outside the gallery get. For IVF-Flat,
    recall is monotone in nprobe (a larger nprobe scans a superset of lists), so a doubling
    search followed by bisection finds the smallest value in O(log nlist) measurements. For
    flat indexes the answer is exact: (0, 1.0). If the target is unreachable (PQ), returns
    nlist and the recall it reached.
    """
    if not hasattr(index, "nlist") and not _is_ivf(index):
        return 0, 1.0
    n = len(ids)
    k = min(k, n)
    q_rows = tuning_queries(n, n_queries, exclude_rows, seed)
    queries = np.ascontiguousarray(x[q_rows], dtype=np.float32)
    own = ids[q_rows]
    truth = _drop_self(ids[exact_neighbours(x, queries, k + 1)], own, k)
    nlist = faiss.extract_index_ivf(index).nlist

    cache: dict[int, float] = {}

    def recall(nprobe: int) -> float:
        if nprobe not in cache:
            params = faiss.SearchParametersIVF(nprobe=nprobe)
            found = _drop_self(index.search(queries, k + 1, params=params)[1], own, k)
            cache[nprobe] = recall_vs_exact(found, truth)
        return cache[nprobe]

    lo, hi = 0, 1           # invariant: recall(lo) < target (lo=0: nothing scanned)
    while recall(hi) < target:
        if hi >= nlist:
            return nlist, recall(nlist)
        lo, hi = hi, min(hi * 2, nlist)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if recall(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi, recall(hi)


def _drop_self(found: np.ndarray, own: np.ndarray, k: int) -> np.ndarray:
    """Each row's ids without the query's own id, first k (padded with -1)."""
    out = np.full((len(found), k), -1, dtype=np.int64)
    for r, (row, o) in enumerate(zip(found, own)):
        row = row[row != o][:k]
        out[r, :len(row)] = row
    return out


def _is_ivf(index: faiss.Index) -> bool:
    try:
        faiss.extract_index_ivf(index)
        return True
    except (RuntimeError, AttributeError):
        return False


def write_atomic(index: faiss.Index, path: str | Path) -> None:
    """Write the index beside ``path`` and rename it into place (see manifest.atomic_target)."""
    with atomic_target(path) as tmp:
        faiss.write_index(index, tmp)


class SearchableIndex:
    """A read-only faiss index for concurrent queries.

    CPU faiss searches are const and release the GIL, so threads share one index without a
    lock. GPU indexes are not thread-safe, so GPU searches are serialised.
    """

    def __init__(self, path: str | Path, nprobe: int = 0, device: str = "auto") -> None:
        self.path = Path(path)
        cpu = faiss.read_index(str(path))
        set_nprobe(cpu, nprobe) if _is_ivf(cpu) else None
        self.cpu_index = cpu
        self.index = cpu
        self.gpu = False
        self._lock = threading.Lock()
        if use_gpu(device):
            try:    # code path for GPU machines; untestable on the CPU-only CI
                self.index = faiss.index_cpu_to_all_gpus(cpu)
                self.gpu = True
            except RuntimeError:
                self.index = cpu
        self.d = cpu.d
        self.ntotal = cpu.ntotal

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        q = np.ascontiguousarray(q, dtype=np.float32)
        k = max(1, min(int(k), max(1, self.ntotal)))
        if self.gpu:
            with self._lock:
                return self.index.search(q, k)
        return self.index.search(q, k)
