"""``indexer build --ray``: one walk on the driver, one Ray task per shard, then the merge.

The driver walks the gallery once and writes each shard's share to ``DIR/shards/i/files.jsonl``
(:func:`indexer.walk.split_walk`); a task, and any retry of it, reads only its own list. Ray is
the scheduler (placement, GPUs, retries of tasks whose worker or node died); the work
inside each task is exactly ``indexer build --shard i/n``, which is resumable: a retried task
finds what its dead attempt committed in ``DIR/shards/i/store.lmdb`` and ingests only the rest,
so an image is never stored twice. ``merge_shards`` then trains one quantizer over the union,
which is why the result equals a single-machine build. With ``sharded`` the shards stay: the
plan's reads run in one reader actor per shard (:mod:`indexer.ray_sources`) and a second pass
fills each shard's part, both on the node whose task built the shard.

Every path (gallery, ``DIR``) must mean the same files on every node: a shared filesystem. Each
shard's LMDB store has one writer (its task) and is read by the merge only after that task ended.
Ray is imported lazily: it is an optional extra (``pip install "das-retrieval[ray]"``).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .errors import IndexerError
from .index_dir import FILE_LIST, PART_FILE, PLAN_FILE, SHARDS_DIR, STORE_DIR, IndexDir
from .lock import writer_lock
from .manifest import Manifest
from .options import BuildOptions
from .ray_sources import task_error
from .walk import read_file_list, split_walk

INSTALL_HINT = "pip install 'ray[default]>=2.9,<3' (or the project's extra: pip install -e '.[ray]')"
# Test and drill hook: "i:N:MARKER" makes shard i's worker SIGKILL itself once N of its files
# are settled (committed, or skipped), on the attempt that creates MARKER (so the retry runs to
# the end). It exercises the real failure path: Ray notices a dead worker and retries the task.
FAULT_ENV = "DAS_RAY_KILL_SHARD"
# Test and drill hook for losing a whole node: "i:N:MARKER" makes shard i's task, on the attempt
# that creates MARKER, write its node id there once N of its files are settled and then wait
# (at most HOLD_S) with its work committed so far, so that a test can remove that node mid-task.
HOLD_ENV = "DAS_RAY_HOLD_SHARD"
HOLD_S = 300.0
RUN_FILE = "ray.json"     # OUT/shards/ray.json: the last --ray build's facts (nodes, attempts)


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise IndexerError(f"--ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def only_loopback() -> bool:
    """True when this process sees no network interface but ``lo`` (a private network
    namespace, e.g. ``unshare -n``): Ray's listeners then cannot be reached from outside."""
    return all(name == "lo" for _, name in socket.if_nameindex())


# ---------------------------------------------------------------------------- progress
class _Progress:
    """Files done per shard, kept by a small Ray actor so that one bar can cover all shards.

    A new attempt of a shard resets its count (a retry re-counts what the dead attempt stored,
    as "unchanged"), so the total never counts an image twice. Also keeps the node each attempt
    ran on (a retry after a node died runs elsewhere: the build's ``ray.attempt_nodes``).
    Runs on the driver's node (``_ingest_shards``): an actor on a worker node would die with it
    and take the build down with the task that Ray was about to retry.
    """

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
        self.pending, self.total, self.last = 0, 0, time.monotonic()
        self.lock = threading.Lock()          # called from ingest's main and commit threads
        # Wait for the actor to take the start: a call still queued in this worker when it is
        # killed would be lost, and the attempt not counted.
        import ray

        ray.get(actor.start.remote(shard, ray.get_runtime_context().get_node_id()))

    def __call__(self, k: int) -> None:
        with self.lock:
            self.pending += k
            self.total += k
            if time.monotonic() - self.last >= self.every:
                self.flush()

    def flush(self) -> None:
        if self.pending:
            self.actor.add.remote(self.shard, self.pending)
            self.pending, self.last = 0, time.monotonic()


def _fault(spec: str | None, shard: int) -> Callable[[int], None] | None:
    if not spec:
        return None
    i, after, marker = spec.split(":", 2)
    if int(i) != shard or os.path.exists(marker):
        return None

    def check(done: int) -> None:
        if done >= int(after):
            Path(marker).write_text(f"shard {shard} killed after {done} files, pid {os.getpid()}\n")
            os.kill(os.getpid(), signal.SIGKILL)
    return check


def _hold(spec: str | None, shard: int) -> Callable[[int], None] | None:
    """``HOLD_ENV``'s check: once ``done`` reaches N, write this node's id to MARKER and wait
    (the node is meant to be removed meanwhile); ``None`` when the spec is not for this attempt."""
    if not spec:
        return None
    i, after, marker = spec.split(":", 2)
    if int(i) != shard or os.path.exists(marker):
        return None
    held = threading.Event()

    def check(done: int) -> None:
        if done >= int(after) and not held.is_set():
            held.set()
            import ray

            Path(marker).write_text(json.dumps({"node": ray.get_runtime_context().get_node_id(),
                                                "pid": os.getpid(), "done": done}) + "\n")
            time.sleep(HOLD_S)
    return check


# ---------------------------------------------------------------------------- the task
def build_shard(gallery: str, shard_dir: str, model: str, shard: int, n: int, opts: dict,
                actor: Any, fault: str | None, hold: str | None = None) -> dict:
    """One Ray task: ``indexer build GALLERY --shard shard/n --out shard_dir`` (resumes) on the
    files the driver listed for it in ``shard_dir/files.jsonl`` (no walk of the gallery).
    ``fault``, ``hold``: the driver's ``FAULT_ENV`` and ``HOLD_ENV`` (a worker's environment is
    its raylet's, not the driver's)."""
    from .build import build_index
    from .model import load_embedder

    report = _Reporter(actor, shard)
    die = _fault(fault, shard)
    wait = _hold(hold, shard)

    def on_done(k: int) -> None:
        report(k)
        if die is not None:
            die(report.total)
        if wait is not None:
            wait(report.total)

    emb = load_embedder(model, device=opts["device"], batch_size=opts["batch_size"],
                        threads=opts["threads"])
    m = build_index(gallery, shard_dir, model, shard=(shard, n), batch_size=opts["batch_size"],
                    workers=opts["workers"], device=opts["device"], progress=False, embedder=emb,
                    on_done=on_done, files=read_file_list(gallery, Path(shard_dir) / FILE_LIST))
    with report.lock:
        report.flush()
    import ray

    return {**m, "node": ray.get_runtime_context().get_node_id()}   # where the shard now lives


def fill_part(shard_dir: str, trained_file: str, skip: Any, model_hash: str, dim: int) -> tuple[int, str]:
    """The second Ray pass of ``--sharded``: this shard's vectors, read from its own store, into
    a copy of the trained empty index, written beside the store (``stream.fill``). Returns the
    part's size and the node that filled it."""
    import faiss
    import ray

    from . import faiss_index as fx
    from . import stream
    from .sources import StoreSource

    src = StoreSource(Path(shard_dir) / STORE_DIR, model_hash, dim)
    try:
        part = stream.fill(src, faiss.read_index(trained_file), skip)
    finally:
        src.close()
    fx.write_atomic(part, Path(shard_dir) / PART_FILE)
    return int(part.ntotal), ray.get_runtime_context().get_node_id()


def _near(node: str | None) -> dict:
    """Ray options that run a task or actor on ``node`` (the one whose task built the shard),
    or elsewhere if that node is gone (soft affinity)."""
    if not node:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=True)}


class _RayFill:
    """``build_sharded``'s ``fill_parts``: one Ray task per shard, with the ingest tasks'
    resources, on the node whose task built the shard (elsewhere if it is gone); ``nodes``: where
    each part was filled (the build's ``ray.fill_nodes``)."""

    def __init__(self, ray: Any, dirs: list[Path], res: dict, max_retries: int, model_hash: str,
                 dim: int, progress: bool, nodes: list) -> None:
        self.ray, self.dirs, self.res, self.max_retries = ray, dirs, res, max_retries
        self.model_hash, self.dim, self.progress, self.near = model_hash, dim, progress, nodes
        self.nodes: list[str | None] = [None] * len(dirs)

    def __call__(self, trained_file: Path, skip: list) -> None:
        ray = self.ray
        task = ray.remote(fill_part)
        refs = [task.options(max_retries=self.max_retries, retry_exceptions=False, **self.res, **_near(node))
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
def connect(address: str | None, num_cpus: int | None = None) -> bool:
    """Join a Ray cluster. ``local`` starts a private instance on this machine; ``auto`` finds
    the one ``ray start`` runs here; anything else is the head's ``HOST:PORT``. Returns whether
    this call started it (and so must shut it down)."""
    ray = _ray()
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    local = address in (None, "local")
    if local and not loopback_works():
        raise IndexerError("--ray local: this machine's loopback (127.0.0.1) accepts no connection, so "
                           "Ray could never reach its own GCS; bring it up (`ip link set lo up`) and rerun")
    watchdog = threading.Timer(connect_timeout(), _give_up, args=(address or "local",))
    watchdog.daemon = True
    watchdog.start()
    try:
        if local:
            # address="local": without it ray.init joins the cluster named by RAY_ADDRESS or the
            # last one started on this machine (/tmp/ray/ray_current_cluster, left by any `ray
            # start` or test cluster), and refuses num_cpus there
            ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                     logging_level="WARNING")
        else:
            ray.init(address=address, logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise IndexerError(f"--ray {address}: cannot connect to a Ray cluster: {msg}") from None
    finally:
        watchdog.cancel()
    return True


CONNECT_TIMEOUT_S = 180.0   # Ray starts in ~5 s here, ~30 s on a loaded 2-core machine


def connect_timeout() -> float:
    """How long ``ray.init`` may take (``DAS_RAY_CONNECT_TIMEOUT_S``, default 180 s): Ray itself
    retries an unreachable GCS forever, logging a line every 30 s."""
    try:
        return float(os.environ.get("DAS_RAY_CONNECT_TIMEOUT_S", CONNECT_TIMEOUT_S))
    except ValueError:
        return CONNECT_TIMEOUT_S


def loopback_works() -> bool:
    """Whether a TCP connection to 127.0.0.1 succeeds (a network namespace whose ``lo`` is down
    has no loopback: Ray's local processes could not reach each other)."""
    try:
        with socket.socket() as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen(1)
            with socket.create_connection(srv.getsockname(), timeout=5):
                return True
    except OSError:
        return False


def _give_up(address: str) -> None:
    """The watchdog's end of a ``ray.init`` that never returns: one line, the Ray processes this
    one started stopped (by PID: this process's descendants), and exit 1. ``ray.init`` blocks
    in C++ and cannot be interrupted from Python, and Ray's exit handlers would wait on the
    same GCS, hence the hard exit."""
    # the library prints nothing, except this last line of a process about to end hard
    os.write(2, (f"indexer build: error: --ray {address}: Ray did not come up in {connect_timeout():.0f} s "
                 "(it cannot reach its GCS; see Ray's log lines above); giving up\n").encode())
    for pid in _descendants(os.getpid()):
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    os._exit(1)


def _descendants(pid: int) -> list[int]:
    """PIDs of every process below ``pid`` (Linux /proc; none elsewhere)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive_nodes(ray: Any) -> list[dict]:
    """The resources (``{"CPU": 32.0, "GPU": 4.0, ...}``) of each live node of the cluster."""
    return [n["Resources"] for n in ray.nodes() if n.get("Alive")]


def plan_resources(nodes: list[dict], shards: int, cpus_per_shard: int | None = None) -> dict:
    """What each shard task reserves: one GPU where the cluster has GPUs (onnxruntime and faiss
    then use it), and CPUs: as many as the cluster has per shard, but never more than one node
    holds, since a task runs on one node (a request no node can meet would wait forever)."""
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
                   options: BuildOptions | None = None, **option_kw: Any) -> Manifest:
    """Build ``gallery`` into ``out`` with one Ray task per shard, then merge.

    Shards go to ``out/shards/<i>``; ``options`` (or its fields by name): how the index is
    chosen, as for ``build_index``. With
    ``sharded`` the shards stay there as the index's parts (``shard_build.build_sharded``: one
    training on a sample of their stores, then a second Ray pass in which each shard fills its
    part), instead of being copied into one store and one index. Every input is checked (the
    same checks as ``build_index``) before Ray starts.
    Holds ``out``'s writer lock (:mod:`indexer.lock`) from once the inputs are checked and Ray
    is there to the end of the merge (which re-enters it); ``wait``: wait for another writer.
    Returns the merged manifest with ``ray`` (in ``extra``): shards, attempts per shard,
    resources per task, the node that built each shard (``nodes``) and the nodes of every
    attempt (``attempt_nodes``), with ``--sharded`` where each reader and fill ran; the same facts
    go to ``out/shards/ray.json``.
    """
    from .build import gallery_files, merge_shards
    from .model import load_embedder

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
    emb = load_embedder(model, device="cpu", batch_size=batch_size)   # fails fast on a bad model
    ray = _ray()
    with writer_lock(out, "indexer build --ray", wait=wait):
        started = connect(address, num_cpus)
        try:
            nodes = alive_nodes(ray)
            n = shards or default_shards(nodes)
            res = plan_resources(nodes, n, cpus_per_shard)
            opts = {"batch_size": batch_size, "workers": workers or res["num_cpus"],
                    "threads": res["num_cpus"], "device": device}
            dirs, found, attempts, where, tried = _ingest_shards(ray, gallery, out / SHARDS_DIR, emb, n,
                                                                 res, opts, max_retries, progress)
            if sharded:
                from .ray_sources import open_readers
                from .shard_build import build_sharded

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
            m = merge_shards(dirs, out, options=build_opts, device=device, progress=progress)
        ray_facts = {"address": address, "shards": n, "attempts": attempts, **res, "found": found,
                     "nodes": where, "attempt_nodes": tried, "seconds": round(time.perf_counter() - t0, 3)}
        if sharded:
            ray_facts["plan_bytes"] = plan_bytes      # what the shards' readers sent the driver
            ray_facts["plan_nodes"] = plan_nodes      # where each shard's reader ran
            ray_facts["fill_nodes"] = fill.nodes      # where each shard's part was filled
        # where each shard was built (its reader, fill and serving actors' place), for operators
        (out / SHARDS_DIR / RUN_FILE).write_text(json.dumps(ray_facts, indent=2) + "\n")
        return m.replace(extra={**m.extra, "ray": ray_facts})


def _ingest_shards(ray: Any, gallery: Path, root: Path, emb: Any, n: int, res: dict, opts: dict,
                   max_retries: int, progress: bool) -> tuple[list[Path], int, list[int], list, list]:
    """The Ray pass: the one walk split into ``n`` file lists under ``root``, one ``build_shard``
    task each. Returns (shard directories, files found, attempts per shard, the node that built
    each shard, the nodes each shard's attempts ran on)."""
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
    fault, hold = os.environ.get(FAULT_ENV), os.environ.get(HOLD_ENV)
    refs = {task.remote(str(gallery), str(d), str(shared.model_file), i, n, opts, actor, fault, hold): i
            for i, d in enumerate(dirs)}
    from tqdm.auto import tqdm

    with tqdm(total=sum(listed), desc=f"indexing ({n} shards on Ray)", unit="img",
              disable=not progress) as bar:
        manifests = _wait_all(ray, refs, actor, n, bar)
        found = sum(int(m["ingest"]["found"]) for m in manifests.values())
        bar.n, bar.total = found, max(bar.total or 0, found)   # the shards' own counts are the final word
        bar.refresh()
    nodes = [manifests[i].get("node") for i in range(n)]
    _, attempts, attempt_nodes = ray.get(actor.state.remote())
    return dirs, found, attempts, nodes, attempt_nodes


def _wait_all(ray: Any, refs: dict, actor: Any, n: int, bar: Any) -> dict[int, dict]:
    """Each shard's manifest once all tasks ended, the bar following the actor's counts; the
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
