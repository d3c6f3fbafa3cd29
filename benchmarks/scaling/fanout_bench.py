"""The fan-out's cost: a sharded index searched by one Ray actor per shard (``indexer.ray.fanout``)
against the same parts searched as one in this process (``stream.open_parts``: what
``shards.PartsIndex`` serves), on one machine.

Run from the repository root, in a private network namespace (Ray listens beyond loopback),
under ``nice`` (the machine is shared):

    unshare -n sh -c 'ip link set lo up && nice -n 10 python -m benchmarks.scaling.fanout_bench \\
        --n 1000000 --shards 4 --dim 128'

Synthetic unit vectors (clustered, so IVF lists are uneven as real embeddings' are) are split
into ``--shards`` parts of one trained IVF-Flat index (inner product, ``--nlist`` lists, searched
at ``--nprobe``), written as a sharded index's files (``trained.faiss``, ``held.faiss``,
``SHARD/part.faiss``). A local Ray cluster of ``--shards`` nodes (``ray.cluster_utils.Cluster``:
one raylet per node on this machine, a custom resource per node to pin shard i's actor on node
i) serves them through ``fanout.Router``: queries and answers over each actor's direct,
authenticated connection (the data plane), and, for comparison, the same Router sending every
search as a Ray actor call instead (``RayCallRouter``: the transport before issue 32 item 4, kept
here only). All sides run faiss single-threaded per search (``omp_set_num_threads(1)``:
parallelism comes from the clients' threads) and are measured in alternating rounds:
single-query latency (p50, p95) and queries/s at 1 and 8 client threads. Every query's top-k ids
are compared: each fan-out must return what the one process does. Prints a Markdown table with
ratios to one process; only ratios mean anything on shared cores.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from tqdm import tqdm

NODE_STORE_BYTES = 200 * 2 ** 20


def make_index(root: Path, n: int, shards: int, d: int, nlist: int, seed: int = 0) -> SimpleNamespace:
    """A sharded index's files under ``root`` (what ``Router`` and ``open_parts`` read) and its
    manifest's two fields the router needs; vectors generated shard by shard (never all held)."""
    import faiss

    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((max(64, nlist // 4), d)).astype(np.float32)

    def vectors(m: int, r: np.random.Generator) -> np.ndarray:
        x = centers[r.integers(0, len(centers), m)] + 0.6 * r.standard_normal((m, d)).astype(np.float32)
        faiss.normalize_L2(x)
        return x

    trained = faiss.index_factory(d, f"IVF{nlist},Flat", faiss.METRIC_INNER_PRODUCT)
    trained.train(vectors(min(n, 40 * nlist), rng))
    faiss.write_index(trained, str(root / "trained.faiss"))
    faiss.write_index(trained, str(root / "held.faiss"))        # an empty held-out part
    per = -(-n // shards)
    names = []
    for s in tqdm(range(shards), desc="filling the shards' parts", unit="shard"):
        part = faiss.clone_index(trained)
        lo, hi = s * per, min(n, (s + 1) * per)
        for a in range(lo, hi, 100_000):
            b = min(hi, a + 100_000)
            part.add_with_ids(vectors(b - a, np.random.default_rng(seed + 1 + a)), np.arange(a, b, dtype=np.int64))
        (root / f"s{s}").mkdir()
        faiss.write_index(part, str(root / f"s{s}" / "part.faiss"))
        names.append(f"s{s}")
    from indexer.directory.manifest import ShardedRecord

    return SimpleNamespace(sharded=ShardedRecord(trained="trained.faiss", held="held.faiss",
                                                 shards=names), search_params="")


def start_cluster(nodes: int) -> object:
    """``nodes`` raylets on this machine, node i with the resource ``benchnode{i}``."""
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    c = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, include_dashboard=False, object_store_memory=NODE_STORE_BYTES,
        resources={"benchnode0": 1}))
    for i in range(1, nodes):
        c.add_node(num_cpus=1, object_store_memory=NODE_STORE_BYTES, resources={f"benchnode{i}": 1})
    c.wait_for_nodes()
    return c


def ray_call_router():
    """``fanout.Router`` with its data plane swapped for one Ray actor call per shard and search
    (``ShardSearcher.search``; ``ray.wait`` with the bound): what serving did before the direct
    connections, measured beside them."""
    import faiss
    import ray

    from indexer.ray.fanout import Router

    class RayCallRouter(Router):
        def _fanout(self, q: np.ndarray, k: int, widen: float = 1.0) -> tuple[np.ndarray, np.ndarray, list[int]]:
            refs = [a.search.remote(q, k) for a in self.actors]
            dh, ih = self.held.search(q, k)
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.config.timeout)
            if len(ready) != len(refs):
                raise RuntimeError("a shard did not answer in the benchmark")
            got = ray.get(refs)
            return (*faiss.merge_knn_results(np.stack([g[0] for g in got] + [dh]),
                                             np.stack([g[1] for g in got] + [ih]), keep_max=self.keep_max), [])
    return RayCallRouter


class CompiledGraphSide:
    """The same fan-out on Ray Compiled Graphs (``ray.dag``, ``experimental_compile``): one
    graph, one ``search`` node per shard actor (actors of its own: a compiled graph holds its
    actors' execution loop), the held-out part searched here and merged as the Router does. A
    compiled graph runs one execution at a time from one caller, so concurrent clients take turns
    (a lock); the Router batches them instead."""

    def __init__(self, root: Path, manifest, k: int) -> None:
        import faiss
        import ray
        from ray.dag import InputNode, MultiOutputNode

        from indexer.ann import faiss_index as fx
        from indexer.ray.actor import ShardSearcher

        cls = ray.remote(ShardSearcher)
        self.actors = [cls.options(num_cpus=0, max_concurrency=2,
                                   resources={f"benchnode{i}": 0.01},
                                   runtime_env={"env_vars": {"RAY_worker_niceness": "0"}}).remote(
            str(root / s / "part.faiss"), manifest.search_params, 1, os.urandom(32))
            for i, s in enumerate(manifest.sharded.shards)]
        ray.get([a.ready.remote() for a in self.actors])
        self.held = faiss.read_index(str(root / "held.faiss"))
        fx.set_search_params(self.held, manifest.search_params)
        self.k, self.lock = k, threading.Lock()
        with InputNode() as q:
            dag = MultiOutputNode([a.search.bind(q, k) for a in self.actors])
        self.graph = dag.experimental_compile()

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        import faiss
        import ray

        assert k == self.k, "the graph was compiled for one k"
        with self.lock:
            got = ray.get(self.graph.execute(q))
        dh, ih = self.held.search(q, k)
        return faiss.merge_knn_results(np.stack([g[0] for g in got] + [dh]),
                                       np.stack([g[1] for g in got] + [ih]), keep_max=True)

    def close(self) -> None:
        self.graph.teardown()


def latencies(index, qs: np.ndarray, k: int) -> np.ndarray:
    out = np.empty(len(qs))
    for j in range(len(qs)):
        t0 = time.perf_counter()
        index.search(qs[j:j + 1], k)
        out[j] = time.perf_counter() - t0
    return out


def qps(index, qs: np.ndarray, k: int, clients: int, seconds: float) -> float:
    """Single-query searches per second from ``clients`` threads for ``seconds``."""
    stop, done = threading.Event(), [0] * clients

    def run(c: int) -> None:
        import faiss

        faiss.omp_set_num_threads(1)            # per thread: a new thread would use every core
        j = c
        while not stop.is_set():
            index.search(qs[j % len(qs):j % len(qs) + 1], k)
            done[c] += 1
            j += clients
    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scaling.fanout_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1_000_000, help="vectors (default 1,000,000)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--shards", type=int, default=4, help="shards = Ray nodes = actors (default 4)")
    p.add_argument("--nlist", type=int, default=1024)
    p.add_argument("--nprobe", type=int, default=16)
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--queries", type=int, default=300, help="latency queries per round (default 300)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--seconds", type=float, default=5.0, help="each queries/s measurement (default 5)")
    p.add_argument("--work", type=Path, default=None, help="where the index files go (default: a temp dir)")
    p.add_argument("--compiled-graph", action="store_true",
                   help="also the fan-out on Ray Compiled Graphs (issue 40 step 5)")
    a = p.parse_args()

    import faiss
    import ray

    from indexer.ann import faiss_index as fx
    from indexer.ann import stream
    from indexer.ray.fanout import RayServing, Router

    faiss.omp_set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="fanout-bench-", dir=a.work))
    cluster = None
    try:
        t0 = time.perf_counter()
        manifest = make_index(root, a.n, a.shards, a.dim, a.nlist)
        manifest.search_params = f"nprobe={a.nprobe}"
        print(f"index: {a.n:,} x {a.dim} in {a.shards} shards, IVF{a.nlist} nprobe {a.nprobe} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        local = stream.open_parts([root / s / "part.faiss" for s in manifest.sharded.shards]
                                  + [root / "held.faiss"], faiss.read_index(str(root / "trained.faiss")))
        fx.set_search_params(local, manifest.search_params)
        cluster = start_cluster(a.shards)
        ray.init(address=cluster.address, logging_level="WARNING")
        serving = RayServing(timeout=30.0, placement=lambda i, s: {"resources": {f"benchnode{i}": 0.01}})
        router = Router(root, manifest, serving)
        calls = ray_call_router()(root, manifest, serving)      # the same actors (fanout's pool)
        nodes = {w["node"] for w in router.where()}
        assert len(nodes) == a.shards, f"actors on {len(nodes)} nodes, expected {a.shards}"
        qs = np.ascontiguousarray(np.random.default_rng(7).standard_normal((a.queries, a.dim)), dtype=np.float32)
        faiss.normalize_L2(qs)
        _, i1 = local.search(qs, a.k)                 # recall equal: the same ids for every query
        _, i2, partial = router.search(qs, a.k)
        assert partial == (), partial
        np.testing.assert_array_equal(i2, i1)
        np.testing.assert_array_equal(calls.search(qs, a.k)[1], i1)
        sides = {"one process": local, "fan-out, direct connections": router, "fan-out, Ray calls": calls}
        graph = None
        if a.compiled_graph:
            graph = CompiledGraphSide(root, manifest, a.k)
            np.testing.assert_array_equal(graph.search(qs, a.k)[1], i1)
            sides["fan-out, Ray Compiled Graph"] = graph
        lat: dict = {s: [] for s in sides}
        q1: dict = {s: [] for s in sides}
        q8: dict = {s: [] for s in sides}
        for _ in range(2):                            # warm both (page cache, Ray's workers)
            for ix in sides.values():
                latencies(ix, qs[:50], a.k)
        for r in range(a.rounds):
            order = list(sides.items())[r % len(sides):] + list(sides.items())[:r % len(sides)]
            for name, ix in order:
                lat[name].append(latencies(ix, qs, a.k))
                q1[name].append(qps(ix, qs, a.k, 1, a.seconds))
                q8[name].append(qps(ix, qs, a.k, 8, a.seconds))
            print(f"round {r + 1}/{a.rounds} done", flush=True)
        # Ray's own fixed cost, for scale: a no-op call to one actor, and to all of them at once
        noop = {"one actor": lambda: ray.get(router.actors[0].ready.remote()),
                "every actor": lambda: ray.get([x.ready.remote() for x in router.actors])}
        rtt = {}
        for name, call in noop.items():
            ts = []
            for _ in range(a.queries):
                t0 = time.perf_counter()
                call()
                ts.append(time.perf_counter() - t0)
            rtt[name] = np.percentile(np.array(ts) * 1e3, 50)
        row = {}
        for name in sides:
            ms = np.concatenate(lat[name]) * 1e3
            row[name] = (np.percentile(ms, 50), np.percentile(ms, 95), np.median(q1[name]), np.median(q8[name]))
        base = row["one process"]
        print(f"\nload average {os.getloadavg()[0]:.1f}; {len(os.sched_getaffinity(0))} cores\n")
        print("| side | p50 ms | p95 ms | q/s, 1 client | q/s, 8 clients |")
        print("|---|---|---|---|---|")
        for name, (p50, p95, a1, a8) in row.items():
            print(f"| {name} | {p50:.2f} | {p95:.2f} | {a1:.0f} | {a8:.0f} |")
        for name, fan in row.items():
            if name != "one process":
                print(f"| ratio ({name} / one process) | {fan[0] / base[0]:.2f}x | {fan[1] / base[1]:.2f}x | "
                      f"{fan[2] / base[2]:.2f}x | {fan[3] / base[3]:.2f}x |")
        print()
        for name, fan in row.items():
            if name != "one process":
                print(f"router's own cost per query ({name}, p50 difference): {fan[0] - base[0]:.2f} ms")
        print(f"ids equal for all {len(qs)} queries (k={a.k}) on every side; a no-op Ray call, p50: "
              + ", ".join(f"{n} {v:.2f} ms" for n, v in rtt.items()))
        calls.close()
        router.close()
        if graph is not None:
            graph.close()
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
