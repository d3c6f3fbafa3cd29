"""What the Ray tests share: loopback up in a fresh network namespace, the module-level guard,
and a local multi-node cluster (``ray.cluster_utils.Cluster``: several raylets on this machine,
the way Ray tests its own multi-node behaviour), with nodes that can be killed and brought back.

Ray listens beyond loopback, so every module that starts Ray runs only inside a private network
namespace: the main run does not collect those modules (each directory's conftest lists them in
``collect_ignore``); ``tests/indexer/test_ray_netns.py`` runs each one there (``RAY_MODULES``).
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

NODE_STORE_BYTES = 100 * 2 ** 20          # object store per raylet: tests pass ids and small arrays


def loopback_up() -> None:
    """`ip link set lo up` (a new namespace starts with lo down), done by hand because
    iproute2 is not on every machine; SIOCGIFFLAGS / SIOCSIFFLAGS on a struct ifreq."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, siocgifflags, req))[1]
        if not flags & iff_up:
            fcntl.ioctl(s, siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))


def require_private_network(module: str) -> None:
    """Skip the calling module (at import) unless only loopback exists here."""
    from indexer.ray.cluster import only_loopback

    if not only_loopback():
        pytest.skip(f"Ray listens beyond loopback: run {module} in a private network namespace "
                    f"(unshare -n python -m pytest {module}; the main run does it)",
                    allow_module_level=True)


def node_resource(i: int) -> str:
    """The custom resource only node ``i`` has: ``.options(resources={node_resource(i): 0.01})``
    pins a task or actor there (tests use it to put work on a node they will kill)."""
    return f"testnode{i}"


@dataclass
class LocalCluster:
    """A running ``ray.cluster_utils.Cluster``: node 0 is the head (never killed: it holds the
    GCS), nodes 1.. are workers. ``kill(i)`` takes a worker node down at once (its raylet and
    every worker process on it, as a lost machine), ``revive(i)`` starts a new raylet with the
    same resources (a new node id: Ray cannot know it is the same machine)."""

    cluster: Any
    cpus: int
    nodes: list[Any] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.cluster.address

    def node_id(self, i: int) -> str:
        return self.nodes[i].node_id

    def kill(self, i: int, timeout: float = 120.0) -> None:
        """Remove worker node ``i`` at once and, when this process is a driver, wait until the
        cluster has marked it dead (missed health checks: ~5 s, ``HEALTH_CHECK``); until then Ray may still
        place work there, which then dies with it."""
        assert i > 0, "node 0 is the head: killing it kills the cluster"
        node = self.nodes[i].node_id
        self.cluster.remove_node(self.nodes[i], allow_graceful=False)
        import ray

        if not ray.is_initialized():
            return
        deadline = time.monotonic() + timeout
        while any(n["NodeID"] == node and n.get("Alive") for n in ray.nodes()):
            assert time.monotonic() < deadline, f"node {i} ({node}) still alive {timeout:.0f} s after its removal"
            time.sleep(0.2)

    def revive(self, i: int) -> str:
        self.nodes[i] = self.cluster.add_node(num_cpus=self.cpus, object_store_memory=NODE_STORE_BYTES,
                                              resources={node_resource(i): 1})
        self.cluster.wait_for_nodes()
        return self.nodes[i].node_id


# How fast the GCS declares a removed node dead: checks every 1 s instead of 3 s (5 misses in a
# row: ~5 s, not ~15 s; each node-loss test waits for it once or twice). The per-check timeout
# stays Ray's 10 s, so a live raylet on a busy machine is not declared dead: only a removed
# one, whose port refuses at once, fails 5 checks in 5 s.
HEALTH_CHECK = {"health_check_period_ms": 1000}


@contextmanager
def local_cluster(n_nodes: int = 3, cpus_per_node: int = 1, head_cpus: int = 0) -> Iterator[LocalCluster]:
    """``n_nodes`` raylets on this machine (one head + workers), each with its ``node_resource(i)``;
    workers have ``cpus_per_node`` CPUs, the head ``head_cpus`` (0 keeps every task that needs a
    CPU off the head, so that such work always runs on a node that can be killed). This process
    joins it as a driver (a CLI run in a subprocess joins with ``--ray cluster.address``). Starts
    in ~10 s here. Shut down on exit, driver first."""
    import ray
    from ray.cluster_utils import Cluster

    loopback_up()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=head_cpus, include_dashboard=False, object_store_memory=NODE_STORE_BYTES,
        resources={node_resource(0): 1}, _system_config=HEALTH_CHECK))
    lc = LocalCluster(cluster, cpus_per_node, [cluster.head_node])
    try:
        for i in range(1, n_nodes):
            lc.nodes.append(cluster.add_node(num_cpus=cpus_per_node, object_store_memory=NODE_STORE_BYTES,
                                             resources={node_resource(i): 1}))
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        yield lc
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


# ---------------------------------------------------------------------------- shard task faults
# Put into an `indexer build --ray` from outside, through Ray's own hooks (the product has none):
# the CLI's `ray.init` calls ``RAY_RUNTIME_ENV_HOOK`` (``fault_runtime_env``), which gives the
# job's workers ``FAULT_ENV`` and ``worker_process_setup_hook`` (``install_fault``); each worker
# then wraps ``indexer.build.single.build_index`` (which a shard task imports when it runs) so that
# the fault sees the task's settled file count after each batch. Workers import this module as
# ``tests.ray_testlib`` (the runtime env puts the repository on their path).
HOLD_S = 300.0
FAULT_ENV = "DAS_TEST_SHARD_FAULT"


def shard_hook(name: str, spec: str) -> dict[str, str]:
    """The environment for an `indexer build --ray` process whose shard tasks run ``name``
    (``kill_after``, ``hold_after``) with ``spec`` ("i:N:MARKER")."""
    return {"RAY_RUNTIME_ENV_HOOK": "tests.ray_testlib.fault_runtime_env",
            FAULT_ENV: f"{name}:{spec}"}


def fault_runtime_env(runtime_env: dict | None) -> dict:
    """Ray's driver-side runtime-env hook: the fault's spec and setup hook for every worker."""
    env = dict(runtime_env or {})
    # the setup hook runs before Ray puts the driver's directory on the worker's path
    repo = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    env["env_vars"] = {**env.get("env_vars", {}), FAULT_ENV: os.environ[FAULT_ENV], "PYTHONPATH": path}
    env["worker_process_setup_hook"] = "tests.ray_testlib.install_fault"
    return env


def install_fault() -> None:
    """In each worker: shard tasks' ``build_index`` calls report their settled files to the fault."""
    import indexer.build.single as single

    name, spec = os.environ[FAULT_ENV].split(":", 1)
    build_index = single.build_index

    def wrapped(*args: Any, shard: tuple[int, int] | None = None, on_done: Callable | None = None,
                **kw: Any) -> Any:
        check = globals()[name](spec, shard[0]) if shard is not None else None
        if check is None or on_done is None:
            return build_index(*args, shard=shard, on_done=on_done, **kw)
        settled = [0]

        def counted(k: int) -> None:
            on_done(k)
            settled[0] += k
            check(settled[0])
        return build_index(*args, shard=shard, on_done=counted, **kw)
    single.build_index = wrapped


def _attempt(spec: str, shard: int) -> tuple[int, Path] | None:
    """(N, MARKER) when ``spec`` ("i:N:MARKER") is for this shard's attempt (MARKER not made yet)."""
    i, after, marker = spec.split(":", 2)
    return None if int(i) != shard or os.path.exists(marker) else (int(after), Path(marker))


def kill_after(spec: str, shard: int) -> Callable[[int], None] | None:
    """Shard i's worker SIGKILLs itself once N of its files are settled (committed, or skipped),
    on the attempt that creates MARKER (so the retry runs to the end): the real failure path,
    Ray notices a dead worker and retries the task."""
    got = _attempt(spec, shard)
    if got is None:
        return None
    after, marker = got

    def check(done: int) -> None:
        if done >= after:
            marker.write_text(f"shard {shard} killed after {done} files, pid {os.getpid()}\n")
            os.kill(os.getpid(), signal.SIGKILL)
    return check


def hold_after(spec: str, shard: int) -> Callable[[int], None] | None:
    """Losing a whole node: shard i's task, on the attempt that creates MARKER, writes its node id
    there once N of its files are settled and then waits (at most HOLD_S) with its work committed
    so far, so that a test can remove that node mid-task."""
    got = _attempt(spec, shard)
    if got is None:
        return None
    after, marker = got
    held = threading.Event()

    def check(done: int) -> None:
        if done >= after and not held.is_set():
            held.set()
            import ray

            marker.write_text(json.dumps({"node": ray.get_runtime_context().get_node_id(),
                                          "pid": os.getpid(), "done": done}) + "\n")
            time.sleep(HOLD_S)
    return check
