"""The shard actor: one part of a sharded index, memory-mapped on its node, searched for the
router over the data plane (:mod:`indexer.ray.link`)."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from multiprocessing.connection import AuthenticationError, answer_challenge, deliver_challenge
from typing import Any

import faiss
import numpy as np

from ..ann import faiss_index as fx
from .link import HANDSHAKE_TIMEOUT_S, connection, tune_fd

_log = logging.getLogger(__name__)

ACCEPT_BACKOFF_S = (0.05, 1.0)   # an actor's accept() failing (EMFILE ...): first and last pause


class ShardSearcher:
    """The Ray actor: one shard's part, memory-mapped on its node, stateless between searches.
    Searches come over the data plane (:meth:`endpoint`): pickled ``(q, k, dq, iq)`` (the
    router's coarse assignment or None), answered ``(D, I)``, a thread per connection."""

    def __init__(self, part_file: str, search_params: str, threads: int = 1, authkey: bytes = b"",
                 host: str | None = None) -> None:
        self.threads = max(1, int(threads))
        faiss.omp_set_num_threads(self.threads)
        self.part_file = part_file
        self.index = fx.no_prefetch(faiss.read_index(part_file, faiss.IO_FLAG_MMAP))
        fx.set_search_params(self.index, search_params)
        self.ivf = plain_ivf(self.index)
        self._authkey = bytes(authkey)
        if len(self._authkey) < 16:
            raise ValueError("ShardSearcher: the data plane needs a key of at least 16 random bytes")
        self._listener = socket.create_server((host or node_ip(), 0), backlog=64)
        threading.Thread(target=self._accept, name="shard-accept", daemon=True).start()

    def ready(self) -> int:
        """The part's vector count (also: the actor is up)."""
        return int(self.index.ntotal)

    def close(self) -> None:
        """Stops accepting connections (tests; an actor's process ends with it)."""
        self._listener.close()

    def endpoint(self) -> tuple[str, int]:
        """Where this actor's data plane listens (a restarted actor has a new port)."""
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """One search as a Ray call (not the serving path: ``benchmarks/scaling/fanout_bench.py``
        measures it beside the data plane)."""
        faiss.omp_set_num_threads(self.threads)        # OpenMP's thread count is per thread
        return self._search(q, k)

    def _search(self, q: np.ndarray, k: int, dq: np.ndarray | None = None,
                iq: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The part's top-k; with the router's coarse assignment (``dq``, ``iq``: the lists each
        query probes) only the lists are scanned, as ``IndexShardsIVF`` scans each part."""
        if iq is not None and self.ivf is not None:     # as many lists as the router sent
            return fx.preassigned(self.ivf, q, k, iq, dq)
        return self.index.search(q, k)      # lists read without prefetch threads: no_prefetch

    def where(self) -> dict:
        """This actor's process and node (tests, ``describe``)."""
        import ray

        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "part": self.part_file}

    def _accept(self) -> None:
        """Accept connections until :meth:`close`; a failing ``accept()`` (EMFILE, ENOBUFS ...) is
        logged and retried after a growing pause, so the port never accepts with nobody serving."""
        pause = ACCEPT_BACKOFF_S[0]
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError as e:
                if self._listener.fileno() == -1:      # closed: the actor is going away
                    return
                _log.warning("shard data plane %s: accept failed (%s); retrying in %.2f s",
                             self.part_file, e, pause)
                time.sleep(pause)
                pause = min(pause * 2, ACCEPT_BACKOFF_S[1])
                continue
            pause = ACCEPT_BACKOFF_S[0]
            try:
                threading.Thread(target=self._serve, args=(sock,), name="shard-conn", daemon=True).start()
            except RuntimeError:                       # no thread to be had: drop this peer
                sock.close()

    def _serve(self, sock: socket.socket) -> None:
        """One router connection: the challenge (bounded: a silent peer is dropped), then
        search after search until the peer closes."""
        # OpenMP's thread count is per thread: a new thread gets every core's worth, and a
        # parallel region for one query then waits for a descheduled sibling on a loaded node
        faiss.omp_set_num_threads(self.threads)
        try:
            conn = connection(sock, HANDSHAKE_TIMEOUT_S)
        except OSError:
            return
        with conn:
            try:
                deliver_challenge(conn, self._authkey)
                answer_challenge(conn, self._authkey)
                tune_fd(conn.fileno(), None)          # authenticated: idle between searches
            except (OSError, EOFError, AuthenticationError):
                return
            while True:
                try:
                    msg = conn.recv()
                except Exception:  # noqa: BLE001 - closed, timed out, or not a pickle: drop the peer
                    return
                try:     # (q, k, dq, iq): the queries, k, and the router's coarse assignment or None
                    q, k, dq, iq = msg
                    answer: Any = self._search(np.ascontiguousarray(q, dtype=np.float32), int(k), dq, iq)
                except Exception as e:  # noqa: BLE001 - the router leaves this shard out, says why
                    answer = f"{type(e).__name__}: {e}"
                try:
                    conn.send(answer)
                except (OSError, EOFError):
                    return


def plain_ivf(index: faiss.Index) -> Any:
    """``index`` as an ``IndexIVF`` when it is one itself (what ``IndexShardsIVF`` takes as a
    part: no transform or refine around it), else None."""
    ix = faiss.downcast_index(index)
    return ix if isinstance(ix, faiss.IndexIVF) else None


def node_ip() -> str:
    """This node's address as Ray knows it (127.0.0.1 on a one-machine cluster)."""
    import ray

    return ray.util.get_node_ip_address()
