"""The codes-only serving stages for ``scale_bench serve``, each in a process of its own
(``scale_bench.child``): ``_serve_gen`` (a real LMDB store and an IVF-Flat index of low-rank
vectors) and ``_serve`` (one serving mode: the index in RAM, or codes + re-ranking from the
store), so that each mode's memory is its own."""
from __future__ import annotations

import time
from pathlib import Path

from benchmarks.scaling.procmem import peak_rss_mib, status


def _serve_gen(work: str, n: str, d: str, nlist: str) -> dict:
    """A real gallery store (LMDB, one tiny image record + its embedding per vector) and an
    IVF-Flat index of the same low-rank vectors; exact answers of 1000 fresh queries."""
    import hashlib

    import faiss
    import numpy as np
    from tqdm import tqdm

    from benchmarks.inputs.low_rank import low_rank, low_rank_law

    from indexer.ann import faiss_index as fx
    from indexer import GalleryStore, NewItem

    n, d, nlist = int(n), int(d), int(nlist)
    faiss.omp_set_num_threads(2)
    law = low_rank_law(d, 0)
    x = low_rank(n, law, 1)
    model = hashlib.sha256(b"scale-bench").hexdigest()
    t0 = time.perf_counter()
    ids = np.zeros(n, np.int64)
    with GalleryStore(Path(work) / "store", readonly=False, map_size=2 ** 31) as st:
        for s in tqdm(range(0, n, 20_000), desc="writing the store", unit="batch"):
            items = [NewItem(f"g/{i}.png", None, b"", hashlib.sha256(str(i).encode()).hexdigest(), 1, 1)
                     for i in range(s, min(n, s + 20_000))]
            ids[s:s + len(items)] = [it.id for it in items]
            st.put_items(items, x[s:s + len(items)], model)
    store_s = time.perf_counter() - t0
    spec = fx.choose_spec(n, d, "ivf", nlist=nlist)
    index = fx.train(spec, x[fx.training_sample(n, spec)], d, device="cpu")
    fx.add(index, x, ids)
    faiss.write_index(index, str(Path(work) / "index.faiss"))
    q = low_rank(1000, law, seed=2)
    truth = ids[faiss.knn(q, x, 10, metric=faiss.METRIC_INNER_PRODUCT)[1]]
    np.save(Path(work) / "q.npy", q)
    np.save(Path(work) / "truth.npy", truth)
    (Path(work) / "model").write_text(model)
    return {"store_seconds": store_s, "vectors_mib": n * d * 4 / 2 ** 20,
            "store_mib": (Path(work) / "store" / "data.mdb").stat().st_size / 2 ** 20}


def _serve(work: str, mode: str, nprobe: str) -> dict:
    """One serving process: the whole IVF-Flat index in RAM (``ram``), or its codes (``SQ8``,
    ``PQ32``, ...) re-ranked from the store, as ``Index.open(max_memory=...)`` serves them."""

    import faiss
    import numpy as np

    from indexer.ann import served as rerank, tuning
    from indexer import GalleryStore

    faiss.omp_set_num_threads(2)
    q, truth = np.load(Path(work) / "q.npy"), np.load(Path(work) / "truth.npy")
    path = str(Path(work) / "index.faiss")
    t0 = time.perf_counter()
    import gc

    if mode == "ram":
        index = faiss.read_index(path)
        index.nprobe = int(nprobe)
        search = index.search
    else:
        mapped = faiss.read_index(path, faiss.IO_FLAG_MMAP)
        mapped.nprobe = int(nprobe)
        store = GalleryStore(Path(work) / "store")
        vectors = rerank.store_vectors(store, (Path(work) / "model").read_text())
        r = rerank.codes_only(mapped, vectors, 1, codec=mode)
        del mapped
        rerank.release_freed()                     # as Index.open(max_memory=...) does
        search = r.search
    load_s = time.perf_counter() - t0
    found = search(q, 10)[1]                       # warm: every probed list touched once
    times = []
    for _ in range(3):
        t1 = time.perf_counter()
        search(q, 10)
        times.append(time.perf_counter() - t1)
    gc.collect()
    return {"mode": mode, "load_seconds": load_s, "recall": float(tuning.recalls(found, truth).mean()),
            "qps": len(q) / min(times), "peak_rss_mib": peak_rss_mib(), **status()}
