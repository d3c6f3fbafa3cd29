"""A faiss index as served: whole in RAM (:class:`SearchableIndex`), or, on a node that holds only
the codes (``--max-memory``): compressed IVF lists in RAM, exact vectors read from the store(s).

Why: IVF-Flat holds every vector in the serving process (5.2 GB at 10M x 128), and the store
already holds them on disk. Under a budget the lists are re-encoded once at start-up with the same
coarse quantizer (SQ8, SQ4 or PQ via ``add_core``: no vector changes list); a query takes
RERANK_FACTOR x k candidates from the codes, ranked by exact inner products read from the store
(``ReRanked``): when they contain the in-RAM top k the answer is the in-RAM one (faiss's
``IndexRefineFlat`` would keep the exact vectors in RAM).
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import faiss
import numpy as np

from ..errors import IndexerError, size_text
from ..searchable import Answer, Searchable
from . import faiss_index as fx

RERANK_FACTOR = 10          # k' = 10 k candidates from the codes (the top 100 for k = 10)
TRAIN_POINTS = 65_536       # codec training sample (SQ ranges, PQ codebooks: 256 x 39 at least)
CHUNK = 65_536              # rows of a Flat index re-encoded at a time
BLOCK = 64                  # queries re-ranked at a time (a block gathers 64 x k' x d floats:
                            # small, so that what a block frees goes back rather than pile up)
Vectors = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]   # ids -> (found ids, their rows)


class SearchableIndex(Searchable):
    """A read-only faiss index for concurrent queries, whole in RAM:
    CPU searches release the GIL and share one index without a lock; GPU searches serialise."""

    def __init__(self, path: str | Path, nprobe: int = 0, device: str = "auto",
                 search_params: str = "", mmap: bool = False) -> None:
        self.path = Path(path)
        cpu = fx.no_prefetch(faiss.read_index(str(path), faiss.IO_FLAG_MMAP if mmap else 0))   # mmap: ReRanked
        fx.set_nprobe(cpu, nprobe) if fx.is_ivf(cpu) else None    # manifests without search_params
        fx.set_search_params(cpu, search_params)
        self.cpu_index = cpu
        self.index = cpu
        self.gpu = False
        self._lock = threading.Lock()
        if fx.use_gpu(device) and not mmap:      # mmap: about to be re-encoded (ReRanked)
            try:    # code path for GPU machines; untestable on the CPU-only CI
                self.index = faiss.index_cpu_to_all_gpus(cpu)
                self.gpu = True
            except RuntimeError:
                self.index = cpu
        self.d = cpu.d
        self.ntotal = cpu.ntotal

    def search(self, q: np.ndarray, k: int, widen: float = 1.0) -> Answer:
        q = np.ascontiguousarray(q, dtype=np.float32)
        k = max(1, min(int(k), max(1, self.ntotal)))
        if self.gpu:        # a GPU index takes no per-call nprobe: its own
            with self._lock:
                return Answer(*self.index.search(q, k))
        return Answer(*fx.search_wider(self.index, q, k, widen))


# ---------------------------------------------------------------------------- sizes and codecs
def codecs(dim: int) -> list[tuple[str, int]]:
    """(name, bytes a vector's code takes), most accurate first: what a budget picks from."""
    m = fx.pq_m_for(dim)
    out = [("SQ8", dim), ("SQ4", (dim + 1) // 2), (f"PQ{m}", m)]
    if m % 2 == 0 and m >= 8:
        out.append((f"PQ{m // 2}", m // 2))
    return out


def _ivf_parts(index: faiss.Index) -> list[faiss.Index]:
    """The indexes whose lists make up ``index``: the parts of a sharded index searched as one
    (``IndexShardsIVF`` or, a small sharded gallery, ``IndexShards`` of Flat), else itself."""
    if isinstance(index, (faiss.IndexShardsIVF, faiss.IndexShards)):
        return [faiss.downcast_index(index.at(i)) for i in range(index.count())]
    return [index]


def _is_flat_lists(ivf: faiss.IndexIVF) -> bool:
    return isinstance(faiss.downcast_index(ivf), faiss.IndexIVFFlat)


def lists(parts: Sequence[faiss.Index]) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(list number, vectors, ids) of every non-empty list of IVF-Flat parts (the vectors are
    views on the parts' memory-mapped pages), or (0, chunk, ids) of an ``IDMap2,Flat`` index."""
    for part in parts:
        if not fx.is_ivf(part):                 # IDMap2,Flat (small galleries): one "list"
            flat = faiss.downcast_index(part.index)
            ids = faiss.vector_to_array(part.id_map).astype(np.int64)
            x = faiss.rev_swig_ptr(flat.get_xb(), part.ntotal * part.d).reshape(-1, part.d)
            for s in range(0, len(ids), CHUNK):
                yield 0, x[s:s + CHUNK], ids[s:s + CHUNK]
            continue
        ivf = faiss.extract_index_ivf(part)
        inv = ivf.invlists
        for l in range(ivf.nlist):
            n = inv.list_size(l)
            if n:
                codes = faiss.rev_swig_ptr(inv.get_codes(l), n * ivf.code_size)
                yield l, codes.view(np.float32).reshape(n, ivf.d), faiss.rev_swig_ptr(inv.get_ids(l), n)


def _training_sample(parts: Sequence[faiss.Index], ntotal: int, want: int = TRAIN_POINTS) -> np.ndarray:
    """Every step-th vector of every list: spread over the lists, as the gallery is."""
    step = max(1, ntotal // want)
    rows = [x[::step] for _, x, _ in lists(parts)]
    return np.ascontiguousarray(np.concatenate(rows), dtype=np.float32)


def _empty_codes(quantizer: faiss.Index, dim: int, nlist: int, codec: str) -> faiss.IndexIVF:
    ip = faiss.METRIC_INNER_PRODUCT
    if codec == "SQ8":
        return faiss.IndexIVFScalarQuantizer(quantizer, dim, nlist, faiss.ScalarQuantizer.QT_8bit, ip)
    if codec == "SQ4":
        return faiss.IndexIVFScalarQuantizer(quantizer, dim, nlist, faiss.ScalarQuantizer.QT_4bit, ip)
    if codec.startswith("PQ"):
        return faiss.IndexIVFPQ(quantizer, dim, nlist, int(codec[2:]), 8, ip)
    raise IndexerError(f"codec {codec!r}: expected SQ8, SQ4 or PQ<m>")


def compress(index: faiss.Index, codec: str, nprobe: int = 1) -> faiss.Index:
    """The codes of an IVF-Flat (or its parts as one, or IDMap2,Flat) index: one IVF index of
    ``codec`` codes on the same quantizer (Flat: one list), each vector in its original list."""
    parts = _ivf_parts(index)
    dim = index.d
    if fx.is_ivf(parts[0]):
        quantizer = faiss.extract_index_ivf(parts[0]).quantizer
        if isinstance(index, faiss.IndexShardsIVF):
            quantizer = index.quantizer
        nlist = faiss.extract_index_ivf(parts[0]).nlist
        quantizer = faiss.clone_index(faiss.downcast_index(quantizer))   # outlives the maps
    else:
        quantizer, nlist, nprobe = faiss.IndexFlatIP(dim), 1, 1
        quantizer.add(np.zeros((1, dim), np.float32))
    codes = _empty_codes(quantizer, dim, nlist, codec)
    codes.referenced_objects = [quantizer]       # faiss's way to keep what C++ does not own
    with fx.omp_threads(1):                      # tiny k-means of PQ codebooks: see fx.train
        codes.train(_training_sample(parts, int(index.ntotal)))
    batch: list[tuple[int, np.ndarray, np.ndarray]] = []

    def flush() -> None:         # one add_core per CHUNK vectors: a call per small list paid an
        if not batch:            # OpenMP fork/join each (0.2 s a list on the loaded 2 cores)
            return
        x = np.ascontiguousarray(np.concatenate([b[1] for b in batch]), dtype=np.float32)
        ids = np.ascontiguousarray(np.concatenate([b[2] for b in batch]), dtype=np.int64)
        assign = np.concatenate([np.full(len(b[2]), b[0], dtype=np.int64) for b in batch])
        codes.add_core(len(ids), faiss.swig_ptr(x), faiss.swig_ptr(ids), faiss.swig_ptr(assign))
        batch.clear()

    pending = 0
    for l, x, ids in lists(parts):
        batch.append((l, x, ids))
        pending += len(ids)
        if pending >= CHUNK:
            flush()
            pending = 0
    flush()
    codes.nprobe = max(1, int(nprobe))
    return codes


# ---------------------------------------------------------------------------- re-ranking
def store_vectors(store: Any, model_hash: str) -> Vectors:
    """ids -> (the ids the store holds, their exact vectors): a removed image is left out."""
    def get(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        try:
            return ids, np.asarray(store.get_embeddings(model_hash, ids.tolist()), dtype=np.float32)
        except KeyError:                         # one is gone: keep the others
            found, rows = [], []
            for i in ids.tolist():
                try:
                    rows.append(store.get_embeddings(model_hash, [i])[0])
                    found.append(i)
                except KeyError:
                    continue
            dim = len(rows[0]) if rows else 0
            return (np.array(found, dtype=np.int64),
                    np.stack(rows).astype(np.float32) if rows else np.zeros((0, dim), np.float32))
    return get


class ReRanked(Searchable):
    """Codes in RAM: k' = factor x k candidates from
    the codes, ranked by exact inner product with the vectors ``vectors`` reads (the store)."""

    def __init__(self, codes: faiss.Index, vectors: Vectors, *, codec: str, memory_bytes: int,
                 nprobe: int, factor: int = RERANK_FACTOR, budget: int | None = None) -> None:
        self.cpu_index = self.index = codes
        self.vectors, self.codec, self.factor = vectors, codec, int(factor)
        self.d, self.ntotal = codes.d, int(codes.ntotal)
        self.memory_bytes = int(memory_bytes)
        self.summary = {"codes": codec, "rerank_factor": self.factor, "memory_bytes": self.memory_bytes,
                        "max_memory": budget, "nprobe": int(nprobe)}

    def candidates(self, q: np.ndarray, k: int, widen: float = 1.0) -> np.ndarray:
        return fx.search_wider(self.index, q, max(1, min(self.factor * k, self.ntotal)), widen)[1]

    def search(self, q: np.ndarray, k: int, widen: float = 1.0) -> Answer:
        q = np.ascontiguousarray(q, dtype=np.float32)
        k = max(1, min(int(k), max(1, self.ntotal)))
        cand = self.candidates(q, k, widen)
        scores = np.full((len(q), k), -np.inf, dtype=np.float32)
        ids = np.full((len(q), k), -1, dtype=np.int64)
        for s in range(0, len(q), BLOCK):
            c = cand[s:s + BLOCK]
            found, rows = self.vectors(np.unique(c[c >= 0]))
            if not len(found):
                continue
            at = np.minimum(np.searchsorted(found, c), len(found) - 1)
            ok = (c >= 0) & (found[at] == c)
            exact = np.einsum("qd,qkd->qk", q[s:s + BLOCK], rows[at])
            exact = np.where(ok, exact, -np.inf)
            top = np.argsort(-exact, axis=1, kind="stable")[:, :k]
            sc = np.take_along_axis(exact, top, axis=1)
            scores[s:s + BLOCK, :top.shape[1]] = sc
            ids[s:s + BLOCK, :top.shape[1]] = np.where(np.isfinite(sc), np.take_along_axis(c, top, axis=1), -1)
        return Answer(scores, ids)


def choose_codec(ntotal: int, dim: int, nlist: int, budget: int) -> str:
    """The most accurate codec whose index fits ``budget`` bytes; one line when none does.
    PQ needs 256 training points a codebook: below that only SQ codes are offered."""
    offered = [(name, size) for name, size in codecs(dim) if not (name.startswith("PQ") and ntotal < 256)]
    for name, size in offered:
        if fx.memory_bytes(ntotal, size, nlist, dim) <= budget:
            return name
    name, size = offered[-1]
    need = fx.memory_bytes(ntotal, size, nlist, dim)
    raise IndexerError(f"--max-memory {size_text(budget)}: the smallest codes ({name}, "
                       f"{size} bytes a vector) of {ntotal} vectors need about {size_text(need)}")


def codes_only(index: faiss.Index, vectors: Vectors, budget: int, *, codec: str | None = None,
               factor: int = RERANK_FACTOR) -> ReRanked | None:
    """What a node with ``budget`` bytes for its index serves: None when it fits (exact), else
    its codes re-ranked from ``vectors``; ``codec`` forces one (tests, benchmarks)."""
    parts = _ivf_parts(index)
    dim, n = index.d, int(index.ntotal)
    if fx.is_ivf(parts[0]):
        ivf = faiss.extract_index_ivf(parts[0])
        nlist, code_size, nprobe = ivf.nlist, ivf.code_size, int(ivf.nprobe)
        if not _is_flat_lists(ivf):
            need = fx.memory_bytes(n, code_size, nlist, dim)
            if need > budget:
                raise IndexerError(f"--max-memory {size_text(budget)}: this index's own codes "
                                   f"({code_size} bytes a vector) need about {size_text(need)}")
            return ReRanked(index, vectors, codec=f"the index's own {code_size}-byte", memory_bytes=need,
                            nprobe=nprobe, factor=factor, budget=budget)
    else:
        nlist, code_size, nprobe = 1, 4 * dim, 1
    if codec is None and fx.memory_bytes(n, code_size, nlist, dim) <= budget:
        return None
    codec = codec or choose_codec(n, dim, nlist, budget)
    codes = compress(index, codec, nprobe)
    ivf = faiss.extract_index_ivf(codes)
    return ReRanked(codes, vectors, codec=codec, nprobe=nprobe, factor=factor, budget=budget,
                    memory_bytes=fx.memory_bytes(n, ivf.code_size, ivf.nlist, dim))


def serve_codes(fi: Any, store: Any, model_hash: str, budget: int) -> Any:
    """What ``Index.open(..., max_memory=...)`` serves: the opened index (read memory-mapped) as
    it is when it fits ``budget`` bytes, else its codes re-ranked from the index's own store(s)."""
    r = codes_only(fi.cpu_index, store_vectors(store, model_hash), budget)
    if r is None:
        return fi
    release_freed()
    return r


def release_freed() -> None:
    """Hand the re-encoding's freed buffers back to the OS (glibc's ``malloc_trim``; a no-op
    without glibc), which would otherwise count in the RSS this node promises to keep small."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


__all__ = ["ReRanked", "codes_only", "serve_codes", "compress", "choose_codec", "codecs",
           "store_vectors", "RERANK_FACTOR"]
