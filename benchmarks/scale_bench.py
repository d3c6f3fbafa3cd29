"""Past one machine: the driver's one walk, and the streaming build against today's merge.

Run from the repository root, under ``nice -n 10`` (the machine is shared):

    python -m benchmarks.scale_bench walk --files 1000000 --shards 8
    python -m benchmarks.scale_bench stream --sizes 1000000,2000000 --baseline-up-to 2000000
    python -m benchmarks.scale_bench stream --sizes 10000000 --baseline-up-to 0

``walk`` makes a synthetic tree of empty ``.jpg`` files (1,000 per folder) and times, each in
its own process (peak RSS is that process's ``ru_maxrss``): what the build did before (every
shard task walks the whole gallery and keeps its share by path hash, and the driver walks it
once more for the progress bar: S + 1 walks) and after (one walk on the driver writing the S
lists, and a task reading its own list). ``stream`` is documented in its own function.
Figures are printed as a Markdown table; ratios against a baseline of the same run are what
counts on these shared cores.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(fn: str, *args: str) -> dict:
    """Run ``fn`` of this file in a fresh process; its JSON result (time, peak RSS)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-m", "benchmarks.scale_bench", "_child", fn, *args], capture_output=True,
                       text=True, env=env, cwd=REPO)
    if p.returncode != 0:
        raise SystemExit(f"{fn} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- walk
def make_tree(root: Path, n: int, per_dir: int = 1000) -> None:
    from tqdm import tqdm

    for s in tqdm(range(0, n, per_dir), desc="making the tree", unit="folder"):
        d = root / f"c{s // per_dir:05d}"
        d.mkdir(parents=True, exist_ok=True)
        for j in range(min(per_dir, n - s)):
            os.close(os.open(d / f"{j:04d}.jpg", os.O_CREAT | os.O_WRONLY, 0o644))


def _task_walk(root: str, shard: str, n: str) -> dict:
    """Before: one shard task's walk (the whole gallery, its share kept by path hash)."""
    from indexer.walk import shard_of, walk_gallery

    t0 = time.perf_counter()
    kept = sum(1 for f in walk_gallery(root) if shard_of(f.relpath, int(n)) == int(shard))
    return {"seconds": time.perf_counter() - t0, "files": kept, "rss_mib": peak_rss_mib()}


def _count_walk(root: str) -> dict:
    """Before: the driver's own walk, counting files for the progress bar."""
    from indexer.walk import walk_gallery

    t0 = time.perf_counter()
    n = sum(1 for _ in walk_gallery(root))
    return {"seconds": time.perf_counter() - t0, "files": n, "rss_mib": peak_rss_mib()}


def _split(root: str, lists_dir: str, n: str) -> dict:
    """After: the driver's one walk, writing the S lists."""
    from indexer.walk import split_walk

    lists = [Path(lists_dir) / str(i) / "files.jsonl" for i in range(int(n))]
    for p in lists:
        p.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    counts = split_walk(root, lists)
    return {"seconds": time.perf_counter() - t0, "files": sum(counts), "rss_mib": peak_rss_mib(),
            "list_mib": sum(p.stat().st_size for p in lists) / 2 ** 20}


def _read_list(root: str, path: str) -> dict:
    """After: a shard task reading its own list (what a retry repeats)."""
    from indexer.walk import read_file_list

    t0 = time.perf_counter()
    n = sum(1 for _ in read_file_list(root, path))
    return {"seconds": time.perf_counter() - t0, "files": n, "rss_mib": peak_rss_mib()}


def bench_walk(files: int, shards: int, keep: Path | None) -> list[str]:
    tmp = Path(tempfile.mkdtemp(prefix="walk-bench-"))
    try:
        root = keep or tmp / "gallery"
        if not (root.exists() and any(root.iterdir())):
            make_tree(root, files)
        for _ in range(2):         # warm the dentry cache, as a long build would find it
            child("_count_walk", str(root))
        before_task = child("_task_walk", str(root), "0", str(shards))
        before_count = child("_count_walk", str(root))
        after_split = child("_split", str(root), str(tmp / "lists"), str(shards))
        after_read = child("_read_list", str(root), str(tmp / "lists" / "0" / "files.jsonl"))
        before_total = shards * before_task["seconds"] + before_count["seconds"]
        after_total = after_split["seconds"] + shards * after_read["seconds"]
        return [
            f"Walk of a synthetic tree of {before_count['files']:,} empty .jpg files (1,000 per folder, "
            f"warm dentry cache), {shards} shards; each row its own process; load average "
            f"{os.getloadavg()[0]:.1f}. Command: `python -m benchmarks.scale_bench walk --files {files} "
            f"--shards {shards}`.", "",
            "| stage | files | seconds | peak RSS MiB |", "|---|---:|---:|---:|",
            f"| before: one shard task's walk (whole tree, keeps 1/{shards}) | {before_task['files']:,} | "
            f"{before_task['seconds']:.1f} | {before_task['rss_mib']:.0f} |",
            f"| before: the driver's counting walk | {before_count['files']:,} | {before_count['seconds']:.1f} | "
            f"{before_count['rss_mib']:.0f} |",
            f"| before: total walking ({shards} tasks + driver; {shards + 1} walks of the tree) | | "
            f"{before_total:.1f} | |",
            f"| after: the driver's one walk, writing {shards} lists ({after_split['list_mib']:.0f} MiB) | "
            f"{after_split['files']:,} | {after_split['seconds']:.1f} | {after_split['rss_mib']:.0f} |",
            f"| after: one shard task reading its list | {after_read['files']:,} | {after_read['seconds']:.1f} | "
            f"{after_read['rss_mib']:.0f} |",
            f"| after: total ({shards} list reads + 1 walk) | | {after_total:.1f} | |",
            f"| before / after, total seconds of tree walking and listing | | {before_total / after_total:.1f}x | |",
        ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------- streaming build
class RssSampler:
    """Peak anonymous RSS (RssAnon, sampled every 0.1 s): ``ru_maxrss`` also counts the clean
    file pages a process maps (the memory-mapped shards and index), which the kernel can drop."""

    def __init__(self) -> None:
        import threading

        self.peak = 0
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def now(self) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def run(self) -> None:
        while not self.stop.wait(0.1):
            self.peak = max(self.peak, self.now())

    def done(self) -> float:
        self.stop.set()
        self.t.join()
        return max(self.peak, self.now()) / 2 ** 20


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
        from indexer import sources

        return sources.knn_over(self.chunks(), q, k, drop)

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
    """The synthetic shards: the low-rank generator of index_bench.py, in chunks of 250k."""
    import numpy as np

    from benchmarks.index_bench import low_rank, low_rank_law

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

    from indexer import stream

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

    from indexer import faiss_index, stream

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

    from indexer import faiss_index, stream

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

    from indexer import stream

    faiss.omp_set_num_threads(2)
    rs = RssSampler()
    fields = json.loads((Path(work) / "fields.json").read_text())
    files = [Path(work) / f"part-{i}.faiss" for i in range(int(shards))] + [Path(work) / "held.faiss"]
    trained = faiss.read_index(str(Path(work) / "trained.faiss"))
    t0 = time.perf_counter()
    n = stream.merge_ondisk(trained, files, Path(work) / "merged.faiss", fields["search_params"])
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

    from indexer import stream

    srcs = _sources(work, int(shards))
    q = np.load(Path(work) / "queries.npy")
    return q, stream.exact_truth(srcs, q, 10, exclude=np.zeros(0, np.int64),
                                 dups=[np.zeros(0, np.int64)] * len(srcs))


def _eval(work: str, shards: str) -> dict:
    """Fresh recall@10 (1000 queries from the generator, not gallery vectors) of the merged
    on-disk index and of the shards searched as one; queries/s of both, interleaved."""
    import faiss

    from benchmarks.index_bench import timed_batches

    from indexer import faiss_index, stream, tuning

    faiss.omp_set_num_threads(2)
    fields = json.loads((Path(work) / "fields.json").read_text())
    q, truth = _truth(work, shards)
    trained = faiss.read_index(str(Path(work) / "trained.faiss"))
    files = [Path(work) / f"part-{i}.faiss" for i in range(int(shards))] + [Path(work) / "held.faiss"]
    sharded = stream.open_parts(files, trained)
    faiss_index.set_search_params(sharded, fields["search_params"])
    merged = stream.read_ondisk(Path(work) / "merged.faiss")
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

    from indexer import selection, tuning

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

    from indexer import faiss_index, selection, tuning

    faiss.omp_set_num_threads(2)
    fields = json.loads((Path(work) / "fields.json").read_text())
    trained = faiss.read_index(str(Path(work) / "trained.faiss"))
    nlist = faiss.extract_index_ivf(trained).nlist if faiss_index._is_ivf(trained) else None
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


def bench_stream(n: int, shards: int, d: int, baseline: bool, work_root: Path | None,
                 index_type: str, nlist: int = 0, only_plan: bool = False) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="stream-bench-", dir=work_root))
    rows = []
    try:
        w, s = str(tmp), str(shards)
        gen = child("_gen", w, str(n), s, str(d))
        print(f"  generated {n:,} x {d} in {shards} shards: {gen}", flush=True)
        plan = child("_plan", w, s, index_type, str(nlist))
        print(f"  plan: {plan}", flush=True)
        if only_plan:
            return [{"n": n, "d": d, "shards": shards, "plan": plan, "load": os.getloadavg()[0]}]
        fills = [child("_fill", w, s, str(i)) for i in range(shards)]
        print(f"  fill: {fills}", flush=True)
        tune = child("_tune", w, s)
        print(f"  tune: {tune}", flush=True)
        merge = child("_merge", w, s)
        print(f"  merge: {merge}", flush=True)
        ev = child("_eval", w, s)
        print(f"  eval: {ev}", flush=True)
        row = {"n": n, "d": d, "shards": shards, "gen": gen, "plan": plan, "fill": fills,
               "tune": tune, "merge": merge, "eval": ev, "load": os.getloadavg()[0]}
        if baseline:
            row["same_type"] = child("_baseline_same", w, s)
            print(f"  one process, the stream's type: {row['same_type']}", flush=True)
            row["baseline"] = child("_baseline", w, s)
            print(f"  baseline: {row['baseline']}", flush=True)
        rows.append(row)
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_parity(n: int, shards: int, d: int, seeds: int, work_root: Path | None) -> list[dict]:
    """Streamed vs one process, same type, several seeds on the same shards: how far apart the
    two builds' fresh recall@10 lie next to how far each lies from itself across seeds (the
    seed draws the held-out tuning queries and the k-means sample of both)."""
    tmp = Path(tempfile.mkdtemp(prefix="parity-bench-", dir=work_root))
    rows = []
    try:
        w, s = str(tmp), str(shards)
        child("_gen", w, str(n), s, str(d))
        for seed in range(seeds):
            plan = child("_plan", w, s, "auto", "0", str(seed))
            for i in range(shards):
                child("_fill", w, s, str(i))
            tune = child("_tune", w, s)
            child("_merge", w, s)
            ev = child("_eval", w, s)
            same = child("_baseline_same", w, s, str(seed))
            rows.append({"n": n, "seed": seed, "spec": plan["spec"], "stream_params": tune["params"],
                         "stream_recall": ev["recall_merged"], **{f"one_{k}": v for k, v in same.items()}})
            print(f"  seed {seed}: {rows[-1]}", flush=True)
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def parity_table(rows: list[dict], cmd: str) -> list[str]:
    import numpy as np

    out = [f"Streamed build vs one process of the same type, per seed (fresh recall@10, 1,000 "
           f"generated queries). Command: `{cmd}`.", "",
           "| n | seed | index | streamed: params, recall | one process: params, recall | one process at "
           "the streamed params | streamed - one process (own tuning) | streamed - one process (same params) |",
           "|---:|---:|---|---|---|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['n']:,} | {r['seed']} | {r['spec']} | {r['stream_params']}, {r['stream_recall']:.4f} | "
                   f"{r['one_params']}, {r['one_recall']:.4f} | {r['one_recall_at_stream_params']:.4f} | "
                   f"{r['stream_recall'] - r['one_recall']:+.4f} | "
                   f"{r['stream_recall'] - r['one_recall_at_stream_params']:+.4f} |")
    for key, name in (("stream_recall", "streamed"), ("one_recall", "one process")):
        v = np.array([r[key] for r in rows])
        out.append(f"\n{name}: mean {v.mean():.4f}, range {v.min():.4f}-{v.max():.4f} over {len(v)} seeds")
    return out


def plan_table(rows: list[dict], cmd: str) -> list[str]:
    out = [f"The driver's plan alone (census, held-out sets, exact answers, training), its own "
           f"process; peak RSS = `ru_maxrss`, anon = sampled peak `RssAnon`. Command: `{cmd}`.", "",
           "| n x d (shards) | index | plan s | peak RSS MiB | anon MiB | stage s |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        pl = r["plan"]
        st = ", ".join(f"{k} {v:.0f}" for k, v in pl["stages"].items())
        out.append(f"| {r['n']:,} x {r['d']} ({r['shards']}) | {pl['spec']} | {pl['seconds']:.0f} | "
                   f"{pl['rss_mib']:,.0f} | {pl['anon_mib']:,.0f} | {st} |")
    return out


def stream_table(rows: list[dict], cmd: str) -> list[str]:
    out = [f"Streaming build of low-rank synthetic vectors (`index_bench.low_rank`) in shards, each "
           "stage its own process (peak RSS = `ru_maxrss`, which counts the memory-mapped shard "
           "and index pages too; anon = sampled peak `RssAnon`, the process's own memory); fresh "
           f"recall@10 on 1000 generated queries against exact search. Command: `{cmd}`.", "",
           "| n x d (shards) | index | plan s (RSS / anon MiB) | fill s per shard (RSS / anon) | "
           "tune s (RSS / anon) | merge s (RSS / anon) | index MiB | merge RSS / (1.5 x index + 1 GiB) "
           "| fresh recall@10 merged / sharded | one process, the stream's type: fresh recall@10 (its own "
           "tuning) / at the stream's parameters | q/s sharded / merged | today's merge s (RSS / anon), recall |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        pl, tu, me, ev = r["plan"], r["tune"], r["merge"], r["eval"]
        fill_s = max(f["seconds"] for f in r["fill"])
        fill_rss = max(f["rss_mib"] for f in r["fill"])
        fill_anon = max(f["anon_mib"] for f in r["fill"])
        goal = 1.5 * me["index_mib"] + 1024
        b = r.get("baseline")
        base = (f"{b['seconds']:.0f} ({b['rss_mib']:,.0f} / {b['anon_mib']:,.0f}), {b['recall']:.3f} "
                f"[{b['index']}]" if b else "-")
        st = r.get("same_type")
        same = (f"{st['recall']:.3f} ({st['params']}) / {st['recall_at_stream_params']:.3f}" if st else "-")
        out.append(f"| {r['n']:,} x {r['d']} ({r['shards']}) | {pl['spec']} ({tu['params']}) | "
                   f"{pl['seconds']:.0f} ({pl['rss_mib']:,.0f} / {pl['anon_mib']:,.0f}) | {fill_s:.0f} "
                   f"({fill_rss:,.0f} / {fill_anon:,.0f}) | {tu['seconds']:.0f} ({tu['rss_mib']:,.0f} / "
                   f"{tu['anon_mib']:,.0f}) | {me['seconds']:.0f} ({me['rss_mib']:,.0f} / {me['anon_mib']:,.0f}) | "
                   f"{me['index_mib']:,.0f} | {me['rss_mib'] / goal:.2f} | {ev['recall_merged']:.3f} / "
                   f"{ev['recall_sharded']:.3f} | {same} | {ev['qps_sharded'] / ev['qps_merged']:.2f}x | {base} |")
    return out


# ---------------------------------------------------------------------------- codes-only serving
def _status() -> dict:
    """This process's memory now (VmRSS, RssAnon: its own; RssFile: mapped file pages) in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k = line.split(":")[0]
            if k in ("VmRSS", "RssAnon", "RssFile"):
                out[k] = int(line.split()[1]) / 1024
    return out


def _serve_gen(work: str, n: str, d: str, nlist: str) -> dict:
    """A real gallery store (LMDB, one tiny image record + its embedding per vector) and an
    IVF-Flat index of the same low-rank vectors; exact answers of 1000 fresh queries."""
    import hashlib

    import faiss
    import numpy as np
    from tqdm import tqdm

    from benchmarks.index_bench import low_rank, low_rank_law

    from indexer import faiss_index as fx
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

    from indexer import rerank, tuning
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
            "qps": len(q) / min(times), "peak_rss_mib": peak_rss_mib(), **_status()}


def bench_serve(n: int, d: int, nlist: int, nprobe: int, codecs: list[str], work_root: Path | None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="serve-bench-", dir=work_root))
    try:
        gen = child("_serve_gen", str(tmp), str(n), str(d), str(nlist))
        print(f"  gallery: {gen}", flush=True)
        rows = []
        for mode in ["ram", *codecs]:
            rows.append(child("_serve", str(tmp), mode, str(nprobe)))
            print(f"  {rows[-1]}", flush=True)
        return {"n": n, "d": d, "nlist": nlist, "nprobe": nprobe, "gen": gen, "rows": rows,
                "load": os.getloadavg()[0]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def serve_table(r: dict, cmd: str) -> list[str]:
    base = r["rows"][0]
    out = [f"Serving {r['n']:,} x {r['d']} (IVF{r['nlist']},Flat, nprobe {r['nprobe']}; vectors "
           f"{r['gen']['vectors_mib']:,.0f} MiB, LMDB store {r['gen']['store_mib']:,.0f} MiB): each mode "
           "its own process, memory read from /proc/self/status after 4 batches of 1000 fresh "
           "queries (RssAnon: the process's own; RssFile: mapped pages of the store and index "
           f"files, which the kernel can drop). Load average {r['load']:.1f}. Command: `{cmd}`.", "",
           "| serving | load s | RssAnon MiB | RssFile MiB | VmRSS MiB | peak RSS MiB | RssAnon saved vs in-RAM "
           "/ vectors' size | recall@10 | q/s vs in-RAM |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        saved = (base["RssAnon"] - row["RssAnon"]) / r["gen"]["vectors_mib"]
        name = "whole IVF-Flat index in RAM" if row["mode"] == "ram" else f"{row['mode']} codes + re-rank of 10k from LMDB"
        out.append(f"| {name} | {row['load_seconds']:.1f} | {row['RssAnon']:,.0f} | {row['RssFile']:,.0f} | "
                   f"{row['VmRSS']:,.0f} | {row['peak_rss_mib']:,.0f} | {saved:.2f} | {row['recall']:.4f} | "
                   f"{row['qps'] / base['qps']:.2f}x |")
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "_child":
        print(json.dumps(globals()[sys.argv[2]](*sys.argv[3:])))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("walk", help="one walk on the driver vs one walk per shard task")
    w.add_argument("--files", type=int, default=1_000_000)
    w.add_argument("--shards", type=int, default=8)
    w.add_argument("--keep", type=Path, default=None, help="make (or reuse) the tree here, and keep it")
    st = sub.add_parser("stream", help="the streaming build in shards vs today's merge")
    st.add_argument("--sizes", default="1000000", help="gallery sizes, comma-separated")
    st.add_argument("--shards", type=int, default=4)
    st.add_argument("--dim", type=int, default=128)
    st.add_argument("--baseline-up-to", type=int, default=2_000_000,
                    help="also run today's merge at sizes up to this (it holds ~3 copies of the vectors)")
    st.add_argument("--index-type", default="auto")
    st.add_argument("--nlist", type=int, default=0,
                    help="IVF-Flat with this many lists instead of the measured choice (as `indexer "
                         "build --nlist`): k-means cost grows with nlist, a budget for 2 cores at 10M")
    st.add_argument("--work", type=Path, default=None, help="scratch folder (default: $TMPDIR)")
    st.add_argument("--only-plan", action="store_true",
                    help="generate and run the driver's plan only (its peak RSS against N)")
    pa = sub.add_parser("parity", help="streamed vs one process of the same type, over seeds")
    pa.add_argument("--size", type=int, default=1_000_000)
    pa.add_argument("--shards", type=int, default=4)
    pa.add_argument("--dim", type=int, default=128)
    pa.add_argument("--seeds", type=int, default=3)
    pa.add_argument("--work", type=Path, default=None, help="scratch folder (default: $TMPDIR)")
    sv = sub.add_parser("serve", help="a codes-only serving process (--max-memory) vs the index in RAM")
    sv.add_argument("--size", type=int, default=1_000_000)
    sv.add_argument("--dim", type=int, default=128)
    sv.add_argument("--nlist", type=int, default=1024)
    sv.add_argument("--nprobe", type=int, default=16)
    sv.add_argument("--codecs", default="SQ8,PQ32", help="codes to serve, comma-separated")
    sv.add_argument("--work", type=Path, default=None, help="scratch folder (default: $TMPDIR)")
    args = ap.parse_args()
    if args.cmd == "serve":
        import shlex

        r = bench_serve(args.size, args.dim, args.nlist, args.nprobe, args.codecs.split(","), args.work)
        print("\n".join(serve_table(r, "python -m benchmarks.scale_bench " + shlex.join(sys.argv[1:]))))
        print(json.dumps(r))
        return
    if args.cmd == "parity":
        import shlex

        rows = bench_parity(args.size, args.shards, args.dim, args.seeds, args.work)
        print("\n".join(parity_table(rows, "python -m benchmarks.scale_bench " + shlex.join(sys.argv[1:]))))
        print(json.dumps(rows))
        return
    if args.cmd == "stream":
        import shlex

        rows = []
        for n in (int(v) for v in args.sizes.split(",") if v):
            print(f"stream {n:,} ...", flush=True)
            rows += bench_stream(n, args.shards, args.dim, n <= args.baseline_up_to, args.work,
                                 args.index_type, args.nlist, args.only_plan)
        cmd = "python -m benchmarks.scale_bench " + shlex.join(sys.argv[1:])
        if args.only_plan:
            print("\n".join(plan_table(rows, cmd)))
            print(json.dumps(rows))
            return
        print("\n".join(stream_table(rows, cmd)))
        print(json.dumps(rows))
        return
    if args.cmd == "walk":
        print("\n".join(bench_walk(args.files, args.shards, args.keep)))


if __name__ == "__main__":
    main()
