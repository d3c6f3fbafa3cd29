"""``indexer build --ray``: one walk on the driver, one Ray task per shard, then the merge.

Each task is exactly ``indexer build --shard i/n`` over its share (``DIR/shards/i/files.jsonl``),
which resumes, so a retried task ingests only what its dead attempt did not commit; Ray schedules
(placement, GPUs, retries); ``merge_shards`` makes the result equal a single-machine build. With
``sharded`` the shards stay: plan reads run in reader actors (:mod:`indexer.ray.readers`) and a
second pass fills each part on the shard's node. Paths must mean the same files on every node.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from ..ann.neighbours import DbaParams
from ..ann.options import BuildOptions
from ..directory.index_dir import FILE_LIST, PART_FILE, PLAN_FILE, RUN_FILE, SHARDS_DIR, STORE_DIR, IndexDir
from ..directory.lock import writer_lock
from ..directory.manifest import Manifest
from ..errors import IndexerError
from ..ray.cluster import alive_nodes, connect, near, ray_module
from ..ray.readers import task_error
from ..store.walk import read_file_list, split_walk

# ---------------------------------------------------------------------------- progress
class _Progress:
    """Files done per shard, kept by a small Ray actor on the driver's node so one bar covers
    all shards. A new attempt resets its shard's count (never counting an image twice) and
    records its node (``ray.attempt_nodes``)."""

    def __init__(self, n: int) -> None:
        self.done = [0] * n
        self.attempts = [0] * n
        self.nodes: list[list[str]] = [[] for _ in range(n)]

    def start(self, i: int, node: str = "") -> None:
        self.done[i] = 0
        self.attempts[i] += 1
        self.nodes[i].append(node)

    def add(self, i: int, k: int) -> None:
        self.done[i] += k

    def state(self) -> tuple[list[int], list[int], list[list[str]]]:
        return self.done, self.attempts, self.nodes


class _Reporter:
    """Task side of the progress actor: batches counts to one call per ``every`` seconds."""

    def __init__(self, actor: Any, shard: int, every: float = 0.5) -> None:
        self.actor, self.shard, self.every = actor, shard, every
        self.pending, self.last = 0, time.monotonic()
        self.lock = threading.Lock()          # called from ingest's main and commit threads
        # Wait for the actor to take the start: a call still queued in this worker when it is
        # killed would be lost, and the attempt not counted.
        import ray

        ray.get(actor.start.remote(shard, ray.get_runtime_context().get_node_id()))

    def __call__(self, k: int) -> None:
        with self.lock:
            self.pending += k
            if time.monotonic() - self.last >= self.every:
                self.flush()

    def flush(self) -> None:
        if self.pending:
            self.actor.add.remote(self.shard, self.pending)
            self.pending, self.last = 0, time.monotonic()


# ---------------------------------------------------------------------------- the task
def build_shard(gallery: str, shard_dir: str, model: str, shard: int, n: int, opts: dict,
                actor: Any) -> dict:
    """One Ray task: ``indexer build GALLERY --shard shard/n --out shard_dir`` (resumes) on the
    files listed in ``shard_dir/files.jsonl``."""
    from embedder import use_batch_budget

    from .single import build_index
    from ..directory.model import load_embedder

    use_batch_budget()          # a batch job, as `python -m indexer build` on one machine
    report = _Reporter(actor, shard)
    emb = load_embedder(model, device=opts["device"], batch_size=opts["batch_size"],
                        threads=opts["threads"])
    m = build_index(gallery, shard_dir, model, shard=(shard, n), batch_size=opts["batch_size"],
                    workers=opts["workers"], device=opts["device"], progress=False, embedder=emb,
                    on_done=report, files=read_file_list(gallery, Path(shard_dir) / FILE_LIST),
                    prune=opts.get("prune", False))
    with report.lock:
        report.flush()
    import ray

    return m, ray.get_runtime_context().get_node_id()   # the manifest, and where the shard now lives


def fill_part(shard_dir: str, trained_file: str, skip: Any, model_hash: str, dim: int) -> tuple[int, str]:
    """The second Ray pass of ``--sharded``: this shard's vectors into a copy of the trained
    empty index beside its store (``stream.fill``); returns the part's size and the node."""
    import faiss
    import ray

    from ..ann import faiss_index as fx
    from ..ann import stream
    from ..store.sources import StoreSource

    src = StoreSource(Path(shard_dir) / STORE_DIR, model_hash, dim)
    try:
        part = stream.fill(src, faiss.read_index(trained_file), skip)
    finally:
        src.close()
    fx.write_atomic(part, Path(shard_dir) / PART_FILE)
    return int(part.ntotal), ray.get_runtime_context().get_node_id()




class _RayFill:
    """``build_sharded``'s ``fill_parts``: one Ray task per shard, with the ingest tasks'
    resources, on the shard's node if alive; ``nodes``: where each part was filled."""

    def __init__(self, ray: Any, dirs: list[Path], res: dict, max_retries: int, model_hash: str,
                 dim: int, progress: bool, nodes: list) -> None:
        self.ray, self.dirs, self.res, self.max_retries = ray, dirs, res, max_retries
        self.model_hash, self.dim, self.progress, self.near = model_hash, dim, progress, nodes
        self.nodes: list[str | None] = [None] * len(dirs)

    def __call__(self, trained_file: Path, skip: list) -> None:
        ray = self.ray
        task = ray.remote(fill_part)
        refs = [task.options(max_retries=self.max_retries, retry_exceptions=False, **self.res, **near(node))
                .remote(str(d), str(trained_file), sk, self.model_hash, self.dim)
                for d, sk, node in zip(self.dirs, skip, self.near)]
        from tqdm.auto import tqdm

        with tqdm(total=len(refs), desc="filling the shards' parts (Ray)", unit="shard",
                  disable=not self.progress) as bar:
            pending = list(refs)
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                i = refs.index(ready[0])
                try:
                    self.nodes[i] = ray.get(ready[0])[1]
                except ray.exceptions.RayError as e:
                    for p in pending:
                        ray.cancel(p)
                    raise IndexerError(f"filling shard {i}'s part failed: {task_error(e)}; rerun the "
                                       "same command to resume") from None
                bar.update(1)


# ---------------------------------------------------------------------------- the driver




def plan_resources(nodes: list[dict], shards: int, cpus_per_shard: int | None = None) -> dict:
    """What each shard task reserves: one GPU where the cluster has GPUs, and the cluster's CPUs
    per shard but never more than one node holds (an unmeetable request waits forever)."""
    node_cpus = max((int(r.get("CPU", 0)) for r in nodes), default=1) or 1
    total_cpus = sum(int(r.get("CPU", 0)) for r in nodes)
    cpus = cpus_per_shard or max(1, min(node_cpus, total_cpus // max(1, shards)))
    if cpus > node_cpus:
        raise IndexerError(f"--cpus-per-shard {cpus}: no node of the cluster has that many CPUs "
                           f"(largest: {node_cpus})")
    gpus = 1 if sum(r.get("GPU", 0) for r in nodes) >= 1 else 0
    return {"num_cpus": cpus, "num_gpus": gpus}


def default_shards(nodes: list[dict]) -> int:
    """One shard per GPU of the cluster, else one per node."""
    gpus = int(sum(r.get("GPU", 0) for r in nodes))
    return max(1, gpus or len(nodes))


def _check_plan(root: Path, gallery: Path, n: int, model_hash: str) -> None:
    """Refuse to resume shards cut differently (or from another gallery or model): shard i of
    2 is not shard i of 3, and a store resumed under the wrong cut would keep foreign images."""
    plan = {"gallery": str(gallery), "shards": n, "model_hash": model_hash}
    path = root / PLAN_FILE
    if path.exists():
        old = json.loads(path.read_text())
        for key, what in (("shards", "--shards"), ("gallery", "gallery"), ("model_hash", "model")):
            if old.get(key) != plan[key]:
                raise IndexerError(f"{root}: holds shards of another build ({what} {old.get(key)} "
                                   f"instead of {plan[key]}); use the same {what} to resume, or "
                                   "delete that folder to start over")
        return
    if any(root.iterdir()):
        raise IndexerError(f"{root}: exists and is not a --ray shards folder; delete it or choose "
                           "another --out")
    path.write_text(json.dumps(plan, indent=2) + "\n")


def build_with_ray(gallery: str | Path, out: str | Path, model: str | Path | None = None, *,
                   address: str | None = "local", shards: int | None = None,
                   max_retries: int = 3, cpus_per_shard: int | None = None,
                   num_cpus: int | None = None, batch_size: int = 32, workers: int | None = None,
                   device: str = "auto", progress: bool = True, sharded: bool = False, wait: bool = False,
                   options: BuildOptions | None = None, dba: DbaParams | None = None, dba_verdict: bool = False,
                   prune: bool = False, **option_kw: Any) -> Manifest:
    """Build ``gallery`` into ``out`` with one Ray task per shard (``out/shards/<i>``), then merge (or,
    ``sharded``, keep the shards as the parts; ``dba``, ``dba_verdict``, ``prune``: as ``merge_shards``);
    every input checked before Ray starts, ``out``'s
    writer lock held from then on. The manifest's ``ray`` entry (and ``out/shards/ray.json``) says
    shards, attempts, resources and the node of each attempt, reader and fill."""
    from .single import gallery_files, merge_shards
    from ..directory.model import load_embedder

    t0 = time.perf_counter()
    gallery, out = Path(gallery).resolve(), Path(out).resolve()
    gallery_files(gallery)
    build_opts = BuildOptions.of(options, **option_kw)
    for name, v in (("--shards", shards), ("--cpus-per-shard", cpus_per_shard),
                    ("--batch-size", batch_size), ("--workers", workers)):
        if v is not None and v < 1:
            raise ValueError(f"{name}={v}: expected a positive integer")
    if max_retries < 0:
        raise ValueError(f"--max-retries={max_retries}: expected 0 or more")
    if sharded and dba is not None:
        raise ValueError("DBA is not available for a sharded index yet (merge the shards)")
    emb = load_embedder(model, device="cpu", batch_size=batch_size)   # fails fast on a bad model
    ray = ray_module()
    with writer_lock(out, "indexer build --ray", wait=wait):
        started = connect(address, num_cpus)
        try:
            nodes = alive_nodes(ray)
            n = shards or default_shards(nodes)
            res = plan_resources(nodes, n, cpus_per_shard)
            opts = {"batch_size": batch_size, "workers": workers or res["num_cpus"],
                    "threads": res["num_cpus"], "device": device, "prune": prune}
            dirs, found, attempts, where, tried = _ingest_shards(ray, gallery, out / SHARDS_DIR, emb, n,
                                                                 res, opts, max_retries, progress)
            if sharded:
                from ..ray.readers import open_readers
                from .sharded import build_sharded

                fill = _RayFill(ray, dirs, res, max_retries, emb.model_hash, int(emb.dim), progress, where)
                # the plan's reads run where the shards are (ray_sources), the fill as tasks there
                readers = open_readers(ray, dirs, emb.model_hash, int(emb.dim), max_retries=max_retries,
                                       threads=res["num_cpus"], nodes=where)
                try:
                    m = build_sharded(dirs, out, options=build_opts, device=device, progress=progress,
                                      fill_parts=fill, sources=readers, wait=wait)
                finally:
                    for r in readers:
                        r.close()
                plan_nodes = [r.node for r in readers]      # where each reader was at its close
                stage = {"census": "next_ids", "samples": "sample", "truth": "knn"}
                plan_bytes = {k: sum(r.received[v] for r in readers) for k, v in stage.items()}
        finally:
            if started:
                ray.shutdown()
        if not sharded:
            m = merge_shards(dirs, out, options=build_opts, device=device, progress=progress, dba=dba,
                             dba_verdict=dba_verdict, prune=prune)
        ray_facts = {"address": address, "shards": n, "attempts": attempts, **res, "found": found,
                     "nodes": where, "attempt_nodes": tried, "seconds": round(time.perf_counter() - t0, 3)}
        if sharded:     # what the shards' readers sent the driver, where each ran, where each part was filled
            ray_facts.update(plan_bytes=plan_bytes, plan_nodes=plan_nodes, fill_nodes=fill.nodes)
        # where each shard was built (its reader, fill and serving actors' place), for operators
        (out / SHARDS_DIR / RUN_FILE).write_text(json.dumps(ray_facts, indent=2) + "\n")
        return m.replace(extra={**m.extra, "ray": ray_facts})


def _ingest_shards(ray: Any, gallery: Path, root: Path, emb: Any, n: int, res: dict, opts: dict,
                   max_retries: int, progress: bool) -> tuple[list[Path], int, list[int], list, list]:
    """The Ray pass: the one walk split into ``n`` file lists under ``root``, a ``build_shard``
    task each. Returns (shard dirs, files found, attempts, each shard's node, attempt nodes)."""
    root.mkdir(parents=True, exist_ok=True)
    _check_plan(root, gallery, n, emb.model_hash)
    shared = IndexDir(root)                     # tasks read the model from the shared path
    shared.copy_model(emb.path, emb.model_hash)
    dirs = [root / str(i) for i in range(n)]
    for d in dirs:
        d.mkdir(exist_ok=True)
    listed = split_walk(gallery, [d / FILE_LIST for d in dirs], progress)   # the one walk of this build
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(num_cpus=0)(_Progress).options(scheduling_strategy=here).remote(n)
    ray.get(actor.state.remote())               # up before any task reports to it
    task = ray.remote(build_shard).options(max_retries=max_retries, retry_exceptions=False, **res)
    refs = {task.remote(str(gallery), str(d), str(shared.model_file), i, n, opts, actor): i
            for i, d in enumerate(dirs)}
    from tqdm.auto import tqdm

    with tqdm(total=sum(listed), desc=f"indexing ({n} shards on Ray)", unit="img",
              disable=not progress) as bar:
        manifests = _wait_all(ray, refs, actor, n, bar)
        found = sum(m.ingest.found for m, _ in manifests.values())
        bar.n, bar.total = found, max(bar.total or 0, found)   # the shards' own counts are the final word
        bar.refresh()
    nodes = [manifests[i][1] for i in range(n)]
    _, attempts, attempt_nodes = ray.get(actor.state.remote())
    return dirs, found, attempts, nodes, attempt_nodes


def _wait_all(ray: Any, refs: dict, actor: Any, n: int, bar: Any) -> dict[int, tuple]:
    """Each shard's (manifest, node) once all tasks ended, the bar following the actor's counts; the
    first task that fails for good cancels the rest and ends in one line."""
    pending, manifests = list(refs), {}
    while pending:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
        for r in ready:
            i = refs[r]
            try:
                manifests[i] = ray.get(r)
            except ray.exceptions.RayError as e:
                for p in pending:
                    ray.cancel(p)
                attempts = ray.get(actor.state.remote())[1][i]
                raise IndexerError(f"shard {i}/{n} failed after {attempts} attempt(s): "
                                   f"{task_error(e)}; rerun the same command to resume") from None
        bar.n = sum(ray.get(actor.state.remote())[0])
        bar.refresh()
    return manifests
