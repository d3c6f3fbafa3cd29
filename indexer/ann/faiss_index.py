"""faiss: choosing, training, tuning and persisting the vector index (inner product on
L2-normalised embeddings: cosine). Small galleries get an exact Flat index; above a threshold
``selection.py`` measures a few types on a sample. The search parameter is tuned to the smallest
value reaching a recall@10 target (autofaiss tunes under a latency cap; we promise recall).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, asdict
from pathlib import Path
from typing import Callable, Iterator, Mapping

import faiss
import numpy as np

from embedder.files import atomic_target

from ..errors import IndexerError

INDEX_TYPES = ("auto", "flat", "ivf", "ivfhnsw", "hnsw", "sq8", "sq8rf", "ivfpq", "pqfsrf", "pqfsr8")
# flat: exact. ivf: IVF-Flat. ivfhnsw: IVF-Flat whose nlist centroids are found through an HNSW
# graph (cheap for large nlist). hnsw: an HNSW graph over the vectors. sq8 / ivfpq: IVF over
# 8-bit / PQ codes (compressed, no refine). sq8rf / pqfsrf: IVF over SQ8 codes / 4-bit fast-scan
# PQ codes of the residuals (vector - centroid; about twice as accurate as PQ of the vectors on
# low-rank data) whose k_factor * k best candidates are re-ranked with the exact vectors.
# pqfsr8: the same fast-scan PQ re-ranked with SQ8 codes (a quarter of the memory of the vectors).
HNSW_M = 32                         # graph degree (hnsw, and the ivfhnsw quantizer)
SQ8_K_FACTOR = 2                    # SQ8 ranks almost exactly: 2k candidates are enough to refine
PQFS_K_FACTOR = 8                   # 4-bit PQ is coarse: re-rank 8k candidates
DEFAULT_FLAT_THRESHOLD = 20_000
MIN_POINTS_PER_CENTROID = 39        # faiss warns below this many training points per centroid
TRAIN_POINTS_PER_CENTROID = 64      # k-means sample per centroid: 39 is faiss's floor, 256 its cap;
                                    # 64 trains a 1M gallery's 4096 lists in tens of seconds on 2 cores
KMEANS_ITERATIONS = 10
PQ_TRAIN_POINTS = 256 * MIN_POINTS_PER_CENTROID   # PQ codebooks have 256 centroids each
PQFS_TRAIN_POINTS = 16 * MIN_POINTS_PER_CENTROID  # 4-bit fast-scan codebooks have 16


@contextmanager
def omp_threads(n: int | None) -> Iterator[None]:
    """faiss's OpenMP threads for the calling thread (OpenMP keeps the count per thread) within
    the block, restored after; None: left as it is. One thread where a second buys nothing: after
    a parallel loop libgomp's idle threads spin for milliseconds, taking a core from what runs next."""
    if n is None:
        yield
        return
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(n)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)


@dataclass
class IndexSpec:
    """What to build; stored in the manifest."""

    index_type: str           # one of INDEX_TYPES but "auto"
    factory: str              # faiss.index_factory string
    nlist: int = 0
    pq_m: int = 0
    k_factor: int = 0         # refine types: k_factor * k candidates re-ranked exactly

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_manifest(cls, manifest: Mapping) -> "IndexSpec":
        """The spec an index's manifest records (its fields by name)."""
        return cls(**{f: manifest[f] for f in cls.__dataclass_fields__ if manifest.get(f) is not None})

    @property
    def mergeable(self) -> bool:
        """Whether faiss merge_from works (IVF lists, Flat); HNSW graphs and refine wrappers not."""
        return not self.k_factor and self.index_type != "hnsw"

    @property
    def param(self) -> str:
        """The search parameter tuned to the recall target ("" for exact Flat)."""
        return "nprobe" if self.nlist else "efSearch" if self.index_type == "hnsw" else ""

    def search_params(self, value: int) -> str:
        """faiss.ParameterSpace string for ``value`` of the tuned parameter (and what goes with it)."""
        if not self.param:
            return ""
        out = [f"{self.param}={int(value)}"]
        if self.index_type == "ivfhnsw":   # the graph must return nprobe good centroids
            out.append(f"quantizer_efSearch={max(2 * int(value), 32)}")
        if self.k_factor:
            out.append(f"k_factor_rf={self.k_factor}")
        return ",".join(out)


def nlist_for(n: int) -> int:
    """IVF lists for ``n`` vectors: 4*sqrt(n) rounded to a power of two, but never fewer than
    39 training points per centroid."""
    if n < MIN_POINTS_PER_CENTROID:
        return 1
    target = 2 ** round(math.log2(max(1.0, 4 * math.sqrt(n))))
    return int(max(1, min(target, n // MIN_POINTS_PER_CENTROID)))


def pqfs_m_for(dim: int) -> int:
    """Sub-quantizers for 4-bit fast-scan PQ: 2 dims each (4-bit codes are coarse), even, divides dim."""
    m = dim // 2 if dim % 2 == 0 else dim
    return m if m % 2 == 0 else max(2, m - 1)


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
    if index_type == "hnsw":
        return IndexSpec("hnsw", f"IDMap2,HNSW{HNSW_M},Flat")
    nl = int(nlist) if nlist else nlist_for(n)
    if nl < 1 or nl > n:
        raise IndexerError(f"nlist {nl}: expected 1 <= nlist <= gallery size {n}")
    if index_type == "ivf":
        return IndexSpec("ivf", f"IVF{nl},Flat", nl)
    if index_type == "ivfhnsw":
        return IndexSpec("ivfhnsw", f"IVF{nl}_HNSW{HNSW_M},Flat", nl)
    if index_type == "sq8":
        return IndexSpec("sq8", f"IVF{nl},SQ8", nl)
    if index_type == "sq8rf":   # IDMap2: IndexRefine looks vectors up by position, not by id
        return IndexSpec("sq8rf", f"IDMap2,IVF{nl},SQ8,RFlat", nl, k_factor=SQ8_K_FACTOR)
    if index_type in ("pqfsrf", "pqfsr8"):
        m = pqfs_m_for(dim)
        if n < PQFS_TRAIN_POINTS:
            raise IndexerError(f"{index_type} needs at least {PQFS_TRAIN_POINTS} images to train its "
                               f"codebooks, the gallery has {n}; use ivf or sq8rf")
        refine = "RFlat" if index_type == "pqfsrf" else "Refine(SQ8)"
        return IndexSpec(index_type, f"IDMap2,IVF{nl},PQ{m}x4fsr,{refine}", nl, m,   # r: residuals
                         k_factor=PQFS_K_FACTOR)
    m = pq_m_for(dim)
    if n < PQ_TRAIN_POINTS:
        raise IndexerError(f"ivfpq needs at least {PQ_TRAIN_POINTS} images to train its "
                           f"codebooks, the gallery has {n}; use ivf or sq8")
    return IndexSpec("ivfpq", f"IVF{nl},PQ{m}np", nl, m)   # np: no polysemous training (unused, slow)


def use_gpu(device: str = "auto") -> bool:
    if device == "cpu":
        return False
    n = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if device in ("cuda", "gpu") and n == 0:
        raise IndexerError(f"device {device!r}: faiss sees no GPU")
    return n > 0


def train_size(spec: IndexSpec) -> int:
    """How many points train ``spec``'s lists and codes (0: nothing to train)."""
    if not spec.nlist:
        return 0
    return max(spec.nlist * TRAIN_POINTS_PER_CENTROID,
               (PQFS_TRAIN_POINTS if spec.k_factor else PQ_TRAIN_POINTS) if spec.pq_m else 0)


def training_sample(n: int, spec: IndexSpec, seed: int = 0) -> np.ndarray:
    """Row numbers that train the quantizer: positions in the id-sorted gallery, so a
    single-process build and a merge of shards pick the very same vectors."""
    want = train_size(spec)
    if not want:
        return np.zeros(0, dtype=np.int64)
    if n <= want:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=want, replace=False)).astype(np.int64)


def new_index(spec: IndexSpec, dim: int) -> faiss.Index:
    return faiss.index_factory(dim, spec.factory, faiss.METRIC_INNER_PRODUCT)


KMEANS_APPROX_FROM = 8_192         # nlist from which CPU k-means assigns approximately (the crossover
                                    # selection.HNSW_QUANTIZER_FROM uses for the same reason; see
                                    # docs/benchmarks/scaling.md "k-means at 16,384 lists")
KMEANS_PROBE = 8                    # approx: coarse groups (of sqrt(nlist)) a point's centroid is sought in
KMEANS_REFINE = 3                   # approx: k-means iterations after the two-level start (2 were
                                    # within 0.005 of exact at 4,096 and 8,192 lists, 1 was not)
KMEANS_METHODS = ("exact", "approx", "gpu")


def kmeans_method(nlist: int, gpus: int = 0, approx_from: int | None = None,
                  points: int | None = None) -> str:
    """The k-means ``kmeans`` runs: "gpu" (exact) when faiss sees a GPU, "approx" on CPU from
    ``approx_from`` lists (exact assignment of 1M points into 16,384 lists: ~23 min on 2 cores)
    when ``points`` exceed the lists, "exact" otherwise (small indexes keep their centroids)."""
    if gpus > 0:
        return "gpu"
    big = nlist >= (approx_from or KMEANS_APPROX_FROM) and (points is None or points > nlist)
    return "approx" if big else "exact"


def kmeans_field(spec: IndexSpec, points: int, device: str = "auto") -> dict:
    """The manifest's ``kmeans`` entry for an index whose lists ``kmeans`` found from ``points``
    sample vectors (none for an index without lists)."""
    if not spec.nlist:
        return {}
    return {"kmeans": kmeans_method(spec.nlist, int(use_gpu(device)), points=points)}


def kmeans(x_train: np.ndarray, nlist: int, *, device: str = "auto", seed: int = 0,
           method: str | None = None, progress: bool = False) -> np.ndarray:
    """Spherical k-means centroids (IndexIVF.train's for inner product), apart from ``train`` so
    candidates sharing an nlist share one clustering; deterministic for a sample and seed."""
    x_train = np.ascontiguousarray(x_train, dtype=np.float32)
    gpu = use_gpu(device)
    method = method or kmeans_method(nlist, int(gpu), points=len(x_train))
    if method not in KMEANS_METHODS:
        raise IndexerError(f"k-means method {method!r}: expected one of {', '.join(KMEANS_METHODS)}")
    if method == "approx" and len(x_train) > nlist:     # asked for on a sample too small: exact
        return kmeans_approx(x_train, int(nlist), seed=seed, progress=progress)
    km = faiss.Kmeans(x_train.shape[1], int(nlist), niter=KMEANS_ITERATIONS, seed=seed,
                      spherical=True, gpu=gpu)   # GPU path untested on the CPU-only CI
    km.train(x_train)
    return km.centroids


def kmeans_approx(x: np.ndarray, k: int, *, seed: int = 0, refine: int = KMEANS_REFINE,
                  probe: int = KMEANS_PROBE, progress: bool = False,
                  on_iteration: Callable[[int, np.ndarray], None] | None = None) -> np.ndarray:
    """Spherical k-means whose assignment never compares every point with every centroid: two-level
    clustering (faiss.contrib.clustering) starts it; ``refine`` iterations compare each point with the
    centroids of its ``probe`` nearest coarse groups of sqrt(k) (1/16 of the products at 16,384 lists).
    Not faiss's HNSW assignment: slower than exact there on 2 cores, and not deterministic
    (docs/benchmarks/scaling.md). Empty lists split as faiss does; ``on_iteration(i, centroids)``
    after the start (i = 0) and each refinement; ~100 bytes a point beyond the sample."""
    from faiss.contrib.clustering import reassign_centroids, two_level_clustering
    from scipy.sparse import csr_matrix
    from tqdm import tqdm

    n, d = x.shape
    nc1 = max(1, int(math.sqrt(k)))
    # sqrt(k) small k-means: OpenMP barriers on shared cores cost more than the second thread
    # gains (as train's PQ codebooks)
    with omp_threads(1):
        cen, _ = two_level_clustering(x, nc1, k, spherical=True, seed=seed)
    cen = np.ascontiguousarray(cen, dtype=np.float32)
    if on_iteration:
        on_iteration(0, cen)
    rs = np.random.RandomState(seed)
    rows = np.arange(n)
    p = min(probe, nc1)
    for it in tqdm(range(refine), desc="k-means refinement", unit="iteration", disable=not progress):
        groups = faiss.Kmeans(d, nc1, niter=10, seed=seed + it, spherical=True)
        groups.train(cen)                                          # k points: cheap
        parent = faiss.knn(cen, groups.centroids, 1, metric=faiss.METRIC_INNER_PRODUCT)[1][:, 0]
        near = faiss.knn(x, groups.centroids, p, metric=faiss.METRIC_INNER_PRODUCT)[1].astype(np.int32).ravel()
        order = np.argsort(near, kind="stable").astype(np.int32)
        bounds = np.searchsorted(near[order], np.arange(nc1 + 1))
        del near
        best = np.full(n, -np.inf, dtype=np.float32)
        assign = np.zeros(n, dtype=np.int64)
        for g in range(nc1):
            fine = np.flatnonzero(parent == g)
            pts = order[bounds[g]:bounds[g + 1]] // p
            if not len(fine) or not len(pts):
                continue
            s = x[pts] @ cen[fine].T
            j = np.argmax(s, axis=1)
            v = s[np.arange(len(pts)), j]
            better = v > best[pts]
            best[pts[better]], assign[pts[better]] = v[better], fine[j[better]]
        counts = np.bincount(assign, minlength=k)
        sums = csr_matrix((np.ones(n, np.float32), (assign, rows)), shape=(k, n)) @ x
        cen = np.ascontiguousarray(sums / np.maximum(counts, 1)[:, None], dtype=np.float32)
        reassign_centroids(counts, cen, rs)
        faiss.normalize_L2(cen)
        if on_iteration:
            on_iteration(it + 1, cen)
    return cen


def train(spec: IndexSpec, x_train: np.ndarray, dim: int, *, device: str = "auto",
          seed: int = 0, centroids: np.ndarray | None = None, progress: bool = False) -> faiss.Index:
    """An empty, trained index (the shared quantizer shards merge into): IVF centroids from
    ``kmeans`` (or ``centroids``), then codes trained on ``x_train``."""
    index = new_index(spec, dim)
    if not spec.nlist:
        return index
    x_train = np.ascontiguousarray(x_train, dtype=np.float32)
    if centroids is None:
        centroids = kmeans(x_train, spec.nlist, device=device, seed=seed, progress=progress)
    ivf = faiss.extract_index_ivf(index)
    ivf.quantizer.add(np.ascontiguousarray(centroids, dtype=np.float32))
    # The quantizer holds nlist centroids, so IVF skips its own k-means and trains only its codes.
    # PQ codebooks are many tiny k-means (16-256 centroids of 2-8 dims): on one thread they take
    # a fraction of a second, on two shared cores OpenMP barriers made them 10-50x slower.
    with omp_threads(1):
        index.train(x_train)
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


def wider_nprobe(ivf: faiss.IndexIVF, widen: float) -> int:
    """The lists a search ``widen`` times the IVF's own nprobe probes (at least its own, at most all)."""
    return min(int(ivf.nlist), math.ceil(ivf.nprobe * max(1.0, widen)))


def search_wider(index: faiss.Index, q: np.ndarray, k: int, widen: float) -> tuple[np.ndarray, np.ndarray]:
    """``index.search`` probing ``widen`` times its IVF lists (capped at nlist), per call: the
    index is shared by concurrent searches, so its own nprobe is never changed. A bare IVF, one
    behind an id map or a refine stage (its k_factor kept), or the parts of a sharded one."""
    if widen > 1 and isinstance(index, faiss.IndexShardsIVF):
        # its search insists each part's nprobe equal the call's: assign here, scan each part
        # (what IndexShardsIVF does inside), merge
        dq, iq = index.quantizer.search(q, wider_nprobe(faiss.extract_index_ivf(index.at(0)), widen))
        got = [preassigned(faiss.extract_index_ivf(index.at(i)), q, k, iq, dq) for i in range(index.count())]
        return faiss.merge_knn_results(np.stack([d for d, _ in got]), np.stack([i for _, i in got]),
                                       keep_max=faiss.is_similarity_metric(index.metric_type))
    ivf = faiss.try_extract_index_ivf(index) if widen > 1 else None
    if ivf is None:
        return index.search(q, k)
    wide = faiss.SearchParametersIVF(nprobe=wider_nprobe(ivf, widen))
    inner = index
    while isinstance(inner, (faiss.IndexIDMap, faiss.IndexIDMap2)):
        inner = faiss.downcast_index(inner.index)
    if isinstance(inner, faiss.IndexRefine):     # its own parameters type, the IVF's inside
        return index.search(q, k, params=faiss.IndexRefineSearchParameters(
            k_factor=inner.k_factor, base_index_params=wide))
    return index.search(q, k, params=wide)


def preassigned(ivf: faiss.IndexIVF, q: np.ndarray, k: int, iq: np.ndarray,
                dq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``ivf.search_preassigned`` of lists ``iq`` (their centroid scores ``dq``), as many a query
    as ``iq`` has columns: faiss's wrapper insists on the index's own nprobe and takes no
    parameters, so the C call is made with the lists' count as this call's nprobe."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    iq, dq = np.ascontiguousarray(iq, dtype=np.int64), np.ascontiguousarray(dq, dtype=np.float32)
    d, i = np.empty((len(q), k), np.float32), np.empty((len(q), k), np.int64)
    params = faiss.SearchParametersIVF(nprobe=int(iq.shape[1]))
    ivf.search_preassigned_c(len(q), faiss.swig_ptr(q), k, faiss.swig_ptr(iq), faiss.swig_ptr(dq),
                             faiss.swig_ptr(d), faiss.swig_ptr(i), False, params)
    return d, i


def set_search_params(index: faiss.Index, params: str) -> None:
    """Apply a faiss.ParameterSpace string ("nprobe=8,k_factor_rf=2"; "" does nothing); faiss
    also writes it into the index file."""
    if params:
        faiss.ParameterSpace().set_index_parameters(index, params)
        if isinstance(index, faiss.IndexShardsIVF) and "quantizer_efSearch=" in params:
            # the shards' shared quantizer is not one of its parts: ParameterSpace misses it
            ef = int(params.split("quantizer_efSearch=")[1].split(",")[0])
            faiss.downcast_index(index.quantizer).hnsw.efSearch = ef


def remove(index: faiss.Index, stale: np.ndarray,
           kept: Callable[[], tuple[np.ndarray, np.ndarray]]) -> None:
    """Drop ``stale`` ids; ``kept()``: (x, ids) the index must hold afterwards, read only when
    needed: HNSW graphs and refine wrappers cannot remove, so they are refilled (training kept)."""
    try:
        index.remove_ids(np.ascontiguousarray(stale, dtype=np.int64))
    except RuntimeError:
        index.reset()
        add(index, *kept())


def memory_bytes(ntotal: int, code_size: int, nlist: int, dim: int) -> int:
    """The one memory model of an index (the build's budget, ``selection.predicted_bytes``, and
    the serving budget, :mod:`indexer.ann.served`): codes + 8-byte ids, and the coarse centroids."""
    return int(ntotal * (code_size + 8) + nlist * dim * 4)


def is_ivf(index: faiss.Index) -> bool:
    """Whether ``index`` is (or wraps) an IVF index: what has lists, a quantizer and nprobe."""
    try:
        faiss.extract_index_ivf(index)
        return True
    except (RuntimeError, AttributeError):
        return False


def no_prefetch(index: faiss.Index) -> faiss.Index:
    """Turn off the prefetch threads of memory-mapped inverted lists (returns ``index``): faiss
    starts 32 on every search of ``OnDiskInvertedLists``, pure overhead over the page cache
    (3.4 ms against 0.48 ms a query, benchmarks.scaling.mmap_search). Same answers."""
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        lists = faiss.downcast_InvertedLists(ivf.invlists)
        if isinstance(lists, faiss.OnDiskInvertedLists):
            lists.prefetch_nthread = 0
    return index


def write_atomic(index: faiss.Index, path: str | Path) -> None:
    """Write the index beside ``path`` and rename it into place (see embedder.files.atomic_target)."""
    with atomic_target(path) as tmp:
        faiss.write_index(index, tmp)
