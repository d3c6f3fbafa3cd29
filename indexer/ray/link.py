"""The fan-out's data plane: Ray places, restarts and pings the actors; queries and (D, I) answers
go over a direct TCP connection per actor (:func:`open_link`), authenticated both ways by the
stdlib's HMAC challenge with a per-actor random key (never logged; nothing unpickled before it).
Why: a Ray call costs 1-4 ms on a loaded node, the whole search ~1 ms (docs/benchmarks/scaling.md).
A failed or late connection is closed, its shard left out of that answer, the actor asked again."""
from __future__ import annotations

import os
import socket
import struct
import threading
import time
from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, deliver_challenge
from typing import Any

HANDSHAKE_TIMEOUT_S = 10.0    # an actor drops a connection that has not passed the challenge by then
LINK_HANDSHAKE_S = 2.0        # the router's connect + challenge to an actor, in the background
CONNECT_SLICE_S = 1.0         # at most this much of a fan-out's bound waits for reconnections


def connection(sock: socket.socket, timeout: float | None) -> Connection:
    """``sock`` as a ``Connection`` with no Nagle delay (a search is one small write each way)
    and reads and writes bounded by ``timeout``; on failure the socket is closed (OSError)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)                           # blocking fd: Connection reads it raw
        tune_fd(sock.fileno(), timeout)
        return Connection(sock.detach())
    except OSError:
        sock.close()
        raise


def tune_fd(fd: int, timeout: float | None) -> None:
    """SO_RCVTIMEO/SO_SNDTIMEO on a blocking socket fd (None: no bound): a read or write that
    waits longer fails with OSError instead of hanging."""
    s = socket.socket(fileno=os.dup(fd))
    try:
        t = 0.0 if timeout is None else max(timeout, 0.001)
        tv = struct.pack("ll", int(t), int((t - int(t)) * 1e6))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    finally:
        s.close()


def open_link(endpoint: tuple[str, int], authkey: bytes, timeout: float,
              handshake: float | None = None) -> Connection:
    """A connection to a shard actor's data plane, authenticated both ways within ``handshake``
    seconds (default ``timeout``); its reads and writes stay bounded by ``timeout``."""
    hs = timeout if handshake is None else handshake
    conn = connection(socket.create_connection(endpoint, timeout=hs), hs)
    try:
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
        tune_fd(conn.fileno(), timeout)
    except BaseException:
        conn.close()
        raise
    return conn


class ShardLink:
    """The router's connections to one shard actor: idle ones reused (one per search in flight), a
    broken or late one closed and the actor asked where it listens now. New connections are made by a
    background thread (bounded by ``LINK_HANDSHAKE_S``), never inside a search: an actor that accepts
    TCP but never sends the challenge cannot hold every search."""

    def __init__(self, actor: Any, authkey: bytes, endpoint: tuple[str, int] | None, timeout: float) -> None:
        self.actor, self.authkey, self.endpoint, self.timeout = actor, authkey, endpoint, timeout
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.idle: list[Connection] = []
        self.asking: Any = None                    # the pending endpoint() call, if any
        self.connecting = False                    # a background connect is under way
        self.closed = False

    def take(self, ray: Any, until: float | None = None) -> Connection | None:
        """A connection to send a search on, or None (the shard is left out of this search);
        ``until``: how long to wait for a new one (default a slice of ``timeout``)."""
        if until is None:
            until = time.monotonic() + min(CONNECT_SLICE_S, self.timeout / 4)
        with self.lock:
            if self.idle:
                return self.idle.pop()
            if not self._start(ray):
                return None
            while not self.idle and self.connecting:
                left = until - time.monotonic()
                if left <= 0:
                    break
                self.changed.wait(left)
            return self.idle.pop() if self.idle else None

    def prepare(self, ray: Any) -> None:
        """Start a background connect now if the next :meth:`take` will need one (a fan-out
        prepares every shard first, so their connects run at once, not one after another)."""
        with self.lock:
            if not self.idle:
                self._start(ray)

    def _start(self, ray: Any) -> bool:
        """(Lock held.) The endpoint asked for if unknown, and a background connect started
        if none is under way; False while the endpoint is not known (the shard is left out)."""
        if self.endpoint is None:
            if self.actor is None:                 # a link to a fixed endpoint: nobody to ask
                return False
            if self.asking is None:
                self.asking = self.actor.endpoint.remote()
            ready, _ = ray.wait([self.asking], timeout=0)
            if not ready:
                return False
            ref, self.asking = self.asking, None
            try:
                self.endpoint = tuple(ray.get(ref))
            except ray.exceptions.RayError:
                return False                       # asked again by the next search
        if not self.connecting:
            self.connecting = True
            threading.Thread(target=self._connect, args=(self.endpoint,), daemon=True,
                             name="shard-link").start()
        return True

    def _connect(self, endpoint: tuple[str, int]) -> None:
        """The background connect: an authenticated connection joins ``idle``, or the endpoint
        is forgotten (the actor is asked where it listens again: it may have restarted)."""
        try:
            conn: Connection | None = open_link(endpoint, self.authkey, self.timeout,
                                                handshake=min(self.timeout, LINK_HANDSHAKE_S))
        except (OSError, EOFError, AuthenticationError):
            conn = None
        with self.lock:
            self.connecting = False
            if conn is None:
                self.endpoint = None
            elif self.closed:
                conn.close()
            else:
                self.idle.append(conn)
            self.changed.notify_all()

    def give(self, conn: Connection) -> None:
        with self.lock:
            self.idle.append(conn)

    def broken(self, conn: Connection) -> None:
        """A connection that failed or answered late: closed (a late answer must not be read by
        the next search), and the endpoint asked for again (the actor may have restarted)."""
        conn.close()
        self.forget()

    def forget(self) -> None:
        with self.lock:
            self.endpoint = None

    def close(self) -> None:
        with self.lock:
            self.closed = True
            conns, self.idle = self.idle, []
        for c in conns:
            c.close()
