"""The streaming build's stages for ``scale_bench stream`` / ``parity`` (and ``plan_memory``),
each run in a process of its own by ``scale_bench.child`` so that its peak memory is its own:
``_gen`` (synthetic low-rank shards as .npy), ``_plan`` (the driver), ``_fill`` (one shard task),
``_tune``, ``_merge``, ``_eval`` (fresh recall@10 and queries/s), ``_baseline`` (today's merge)
and ``_baseline_same`` (one process, the stream's own type). They talk through files in the
work folder (plan.pkl, trained.faiss, part-i.faiss, fields.json) and return JSON-able dicts."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from benchmarks.scaling.procmem import RssSampler, peak_rss_mib


class NpySource:
    """A synthetic shard in two .npy files, read with plain file reads (no memory map), so a
    stage's RSS is its own working memory, not the pages of the shard it streamed through."""

    def __init__(self, ids_path: str | Path, x_path: str | Path) -> None:
        import numpy as np

        self._ids = np.load(ids_path, mmap_mode="r")    # read a chunk at a time, never whole
        self.path = str(x_path)
        with open(self.path, "rb") as f:
            major, _ = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, _, _ = read(f)
            self.offset = f.tell()
        self.n, self.dim = shape
        self.row = 4 * self.dim

    def ids(self):
        import numpy as np

        return np.array(self._ids)

    def id_chunks(self, size: int = 65_536):
        import numpy as np

        for s in range(0, self.n, size):
            yield np.array(self._ids[s:s + size])

    def count(self) -> int:
        return int(self.n)

    def sample(self, positions):
        import numpy as np

        return np.array(self._ids[positions]), self._rows(positions)

    def chunks(self, size: int = 65_536):
        import numpy as np

        with open(self.path, "rb") as f:
            f.seek(self.offset)
            for s in range(0, self.n, size):
                m = min(size, self.n - s)
                x = np.fromfile(f, dtype=np.float32, count=m * self.dim).reshape(m, self.dim)
                yield np.array(self._ids[s:s + m]), x

    def knn(self, q, k: int, drop):
        """This shard's exact top-k of ``q`` (``stream.exact_truth`` asks each shard for it)."""
        from embedder.knn import exact_knn

        return exact_knn(q, self.chunks(), k, "ip", exclude=drop)

    def _rows(self, pos):
        import numpy as np

        out = np.empty((len(pos), self.dim), dtype=np.float32)
        buf = memoryview(out).cast("B")       # read in place: no list of rows, no second copy
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for j, p in enumerate(pos):
                os.preadv(fd, [buf[j * self.row:(j + 1) * self.row]], self.offset + int(p) * self.row)
        finally:
            os.close(fd)
        return out

    def get(self, ids):
        import numpy as np

        return self._rows(np.searchsorted(self._ids, ids))


def _gen(work: str, n: str, shards: str, d: str) -> dict:
    """The synthetic shards: the low-rank generator (inputs/low_rank.py), in chunks of 250k."""
    import numpy as np

    from benchmarks.inputs.low_rank import low_rank, low_rank_law

    n, shards, d = int(n), int(shards), int(d)
    law = low_rank_law(d, 0)
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    for i in range(shards):
        m = n // shards + (1 if i < n % shards else 0)
        ids = np.unique(rng.integers(0, 2 ** 49, size=int(m * 1.01) + 16))
        ids = np.sort(rng.permutation(ids)[:m]) * shards + i          # disjoint across shards
        np.save(Path(work) / f"ids{i}.npy", ids.astype(np.int64))
        x = np.lib.format.open_memmap(Path(work) / f"x{i}.npy", mode="w+", dtype=np.float32, shape=(m, d))
        for c, s in enumerate(range(0, m, 250_000)):
            k = min(250_000, m - s)
            x[s:s + k] = low_rank(k, law, seed=1_000 + 100_000 * i + c)
        x.flush()
        del x
    np.save(Path(work) / "queries.npy", low_rank(1000, law, seed=2))
    return {"seconds": time.perf_counter() - t0, "rss_mib": peak_rss_mib()}


def _sources(work: str, shards: int) -> list:
    return [NpySource(Path(work) / f"ids{i}.npy", Path(work) / f"x{i}.npy") for i in range(shards)]


def _plan(work: str, shards: str, index_type: str, nlist: str = "0", seed: str = "0") -> dict:
    """Stage 1, the driver: union of ids, held-out sets, exact answers, selection, training."""
    import pickle

    import faiss

    from indexer.ann import stream

    faiss.omp_set_num_threads(2)
    rs = RssSampler()
    t0 = time.perf_counter()
    p = stream.plan(_sources(work, int(shards)), index_type=index_type, device="cpu",
                    nlist=int(nlist) or None, seed=int(seed))
    sec = time.perf_counter() - t0
    faiss.write_index(p.trained, str(Path(work) / "trained.faiss"))
    trained, p.trained = p.trained, None
    with open(Path(work) / "plan.pkl", "wb") as f:
        pickle.dump(p, f)
    return {"seconds": sec, "rss_mib": peak_rss_mib(), "anon_mib": rs.done(), "stages": p.seconds,
            "spec": p.spec.factory, "held": len(p.held_query_ids),
            "train_points": int(p.fields.get("train_points", 0)),
            "train_sample_mib": p.fields.get("train_points", 0) * p.qt.shape[1] * 4 / 2 ** 20}


def _fill(work: str, shards: str, i: str) -> dict:
    """Stage 2, one shard task: its vectors into a copy of the trained empty index."""
    import pickle

    import faiss

    from indexer.ann import faiss_index, stream

    faiss.omp_set_num_threads(2)
    rs = RssSampler()
    with open(Path(work) / "plan.pkl", "rb") as f:
        p = pickle.load(f)
    trained = faiss.read_index(str(Path(work) / "trained.faiss"))
    t0 = time.perf_counter()
    index = stream.fill(_sources(work, int(shards))[int(i)], trained, p.skip[int(i)])
    faiss_index.write_atomic(index, Path(work) / f"part-{i}.faiss")
    return {"seconds": time.perf_counter() - t0, "rss_mib": peak_rss_mib(), "anon_mib": rs.done()}


def _tune(work: str, shards: str) -> dict:
    """Stage 3, the driver: tune on the shards searched as one; the held-out part."""
    import pickle

    import faiss

    from indexer.ann import faiss_index, stream

    faiss.omp_set_num_threads(2)
    rs = RssSampler()
    with open(Path(work) / "plan.pkl", "rb") as f:
        p = pickle.load(f)
    p.trained = faiss.read_index(str(Path(work) / "trained.faiss"))
    files = [Path(work) / f"part-{i}.faiss" for i in range(int(shards))]
    t0 = time.perf_counter()
    fields = stream.tune_and_check(p, stream.open_parts(files, p.trained), 0.95)
    faiss_index.write_atomic(stream.held_part(p), Path(work) / "held.faiss")
    (Path(work) / "fields.json").write_text(json.dumps({k: v for k, v in fields.items() if k != "candidates"}))
    return {"seconds": time.perf_counter() - t0, "rss_mib": peak_rss_mib(), "anon_mib": rs.done(),
            "params": fields["search_params"], "heldout_recall": fields["recall_at_10"]}


def _merge(work: str, shards: str) -> dict:
    """Stage 4: the parts combined into one on-disk IVF index (faiss.contrib.ondisk)."""
    import faiss

    from benchmarks.scaling import ondisk

    faiss.omp_set_num_threads(2)
    rs = RssSampler()
    fields = json.loads((Path(work) / "fields.json").read_text())
    files = [Path(work) / f"part-{i}.faiss" for i in range(int(shards))] + [Path(work) / "held.faiss"]
    trained = faiss.read_index(str(Path(work) / "trained.faiss"))
    t0 = time.perf_counter()
    n = ondisk.merge_ondisk(trained, files, Path(work) / "merged.faiss", fields["search_params"])
    sec = time.perf_counter() - t0
    # the index's own size: its small file (quantizer, list table) + codes and ids; the .ivfdata
    # file is larger on paper (each list's capacity is a power of two) but sparse on disk
    ivf = faiss.extract_index_ivf(trained)
    own = (Path(work) / "merged.faiss").stat().st_size + n * (ivf.code_size + 8)
    data = (Path(work) / "merged.ivfdata").stat()
    return {"seconds": sec, "rss_mib": peak_rss_mib(), "anon_mib": rs.done(), "count": n,
            "index_mib": own / 2 ** 20, "ivfdata_apparent_mib": data.st_size / 2 ** 20,
            "ivfdata_allocated_mib": data.st_blocks * 512 / 2 ** 20}


def _truth(work: str, shards: str) -> "object":
    import numpy as np

    from indexer.ann import stream

    srcs = _sources(work, int(shards))
    q = np.load(Path(work) / "queries.npy")
    return q, stream.exact_truth(srcs, q, 10, exclude=np.zeros(0, np.int64),
                                 dups=[np.zeros(0, np.int64)] * len(srcs))


def _eval(work: str, shards: str) -> dict:
    """Fresh recall@10 (1000 queries from the generator, not gallery vectors) of the merged
    on-disk index and of the shards searched as one; queries/s of both, interleaved."""
    import faiss

    from benchmarks.indexer.index_bench import timed_batches
    from benchmarks.scaling import ondisk

    from indexer.ann import faiss_index, stream, tuning

    faiss.omp_set_num_threads(2)
    fields = json.loads((Path(work) / "fields.json").read_text())
    q, truth = _truth(work, shards)
    trained = faiss.read_index(str(Path(work) / "trained.faiss"))
    files = [Path(work) / f"part-{i}.faiss" for i in range(int(shards))] + [Path(work) / "held.faiss"]
    sharded = stream.open_parts(files, trained)
    faiss_index.set_search_params(sharded, fields["search_params"])
    merged = ondisk.read_ondisk(Path(work) / "merged.faiss")
    r_m = tuning.recalls(merged.search(q, 10)[1], truth).mean()
    r_s = tuning.recalls(sharded.search(q, 10)[1], truth).mean()
    same = float((merged.search(q, 10)[1] == sharded.search(q, 10)[1]).mean())
    t = timed_batches({"merged": lambda: merged.search(q, 10), "sharded": lambda: sharded.search(q, 10)},
                      rounds=5)
    return {"recall_merged": r_m, "recall_sharded": r_s, "same_ids": same,
            "qps_merged": len(q) / t["merged"], "qps_sharded": len(q) / t["sharded"]}


def _baseline(work: str, shards: str) -> dict:
    """Today's merge, as ``build.merge_shards`` does it: every shard's vectors loaded, one
    concatenated copy, ``selection.build(..., parts=...)`` (the type chosen among all candidates);
    fresh recall@10 on the same queries."""
    import faiss
    import numpy as np

    from indexer.ann import selection, tuning

    faiss.omp_set_num_threads(2)
    rs = RssSampler()
    t0 = time.perf_counter()
    parts = [(np.load(Path(work) / f"ids{i}.npy"), np.load(Path(work) / f"x{i}.npy")) for i in range(int(shards))]
    all_ids = np.concatenate([p[0] for p in parts])
    order = np.argsort(all_ids, kind="stable")
    all_ids = all_ids[order]
    x = np.concatenate([p[1] for p in parts])[order]
    index, fields = selection.build(all_ids, x, device="cpu", parts=parts)
    sec = time.perf_counter() - t0
    anon = rs.done()
    del x, parts
    q, truth = _truth(work, shards)
    r = tuning.recalls(index.search(q, 10)[1], truth).mean()
    return {"seconds": sec, "rss_mib": peak_rss_mib(), "anon_mib": anon, "recall": r,
            "index": f"{fields['index_type']} {fields['factory']} ({fields['search_params']})",
            "index_mib": faiss.serialize_index(index).size / 2 ** 20}


def _baseline_same(work: str, shards: str, seed: str = "0") -> dict:
    """One process, the streamed build's own type: every vector loaded, ``selection.build`` with
    the index type and nlist the stream chose, tuned on its own held-out queries to the same
    target; fresh recall@10 at its own search parameters and at the stream's. The like-for-like
    check of "recall equal to one index's": today's merge (``_baseline``) may choose another
    type (a refine type, which the stream cannot use), so its recall differs by the type too."""
    import faiss
    import numpy as np

    from indexer.ann import faiss_index, selection, tuning

    faiss.omp_set_num_threads(2)
    fields = json.loads((Path(work) / "fields.json").read_text())
    trained = faiss.read_index(str(Path(work) / "trained.faiss"))
    ivf = faiss.try_extract_index_ivf(trained)      # None for a flat (or HNSW) index
    nlist = ivf.nlist if ivf is not None else None
    parts = [(np.load(Path(work) / f"ids{i}.npy"), np.load(Path(work) / f"x{i}.npy")) for i in range(int(shards))]
    all_ids = np.concatenate([p[0] for p in parts])
    order = np.argsort(all_ids, kind="stable")
    all_ids, x = all_ids[order], np.concatenate([p[1] for p in parts])[order]
    t0 = time.perf_counter()
    index, own = selection.build(all_ids, x, index_type=fields["index_type"], nlist=nlist, device="cpu",
                                 parts=parts, seed=int(seed))
    sec = time.perf_counter() - t0
    del x, parts
    q, truth = _truth(work, shards)
    r_own = tuning.recalls(index.search(q, 10)[1], truth).mean()
    faiss_index.set_search_params(index, fields["search_params"])
    r_stream = tuning.recalls(index.search(q, 10)[1], truth).mean()
    return {"seconds": sec, "params": own["search_params"], "recall": r_own,
            "stream_params": fields["search_params"], "recall_at_stream_params": r_stream,
            "heldout_recall": own["recall_at_10"]}
