"""The one owner of Ray's connection: importing Ray (an optional extra), joining or starting a
cluster with a watchdog, the nodes it has, and where a task or actor should run."""
from __future__ import annotations

import os
import socket
import threading
from typing import Any

from ..errors import IndexerError

INSTALL_HINT = "pip install 'ray[default]>=2.9,<3' (or the project's extra: pip install -e '.[ray]')"


def ray_module() -> Any:
    """The ``ray`` module, or one line saying how to install it."""
    try:
        import ray
    except ImportError:
        raise IndexerError(f"--ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def only_loopback() -> bool:
    """True when this process sees no network interface but ``lo`` (a private network
    namespace, e.g. ``unshare -n``): Ray's listeners then cannot be reached from outside."""
    return all(name == "lo" for _, name in socket.if_nameindex())


def near(node: str | None) -> dict:
    """Ray options that run a task or actor on ``node`` (the one whose task built the shard),
    or elsewhere if that node is gone (soft affinity)."""
    if not node:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=True)}


def check_can_start(address: str | None) -> None:
    """One line for what could never connect, so that a build refuses it before it prints its
    plan or exports a model: Ray not installed, or ``local`` with the loopback down."""
    ray_module()
    if address in (None, "local") and not loopback_works():
        raise IndexerError("--ray local: this machine's loopback (127.0.0.1) accepts no connection, so "
                           "Ray could never reach its own GCS; bring it up (`ip link set lo up`) and rerun")


def connect(address: str | None, num_cpus: int | None = None) -> bool:
    """Join a Ray cluster: ``local`` starts a private one, ``auto`` finds the one ``ray start``
    runs here, else the head's ``HOST:PORT``. Returns whether this call started it."""
    ray = ray_module()
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    local = address in (None, "local")
    check_can_start(address)
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
    """The watchdog's end of a ``ray.init`` that never returns (it blocks in C++; Ray's exit
    handlers would wait on the same GCS): one line, this process's Ray descendants stopped by
    PID, exit 1."""
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
