"""Raw clients a server must survive, shared by the reliability probes (benchmarks/reliability/)
and the serving tests (one copy each): a socket of its own, a slow client, a stream held open."""
from __future__ import annotations

import socket
import time
from urllib.parse import urlparse


def raw_socket(url: str) -> socket.socket:
    """A plain TCP connection to ``url``'s host and port."""
    u = urlparse(url)
    return socket.create_connection((u.hostname, u.port), timeout=30)


def trickle(url: str, head: bytes, seconds: float) -> tuple[bool, bytes, float]:
    """A slow client: send ``head``, then one byte a second for up to ``seconds``.
    Returns (whether the server closed the connection, what it answered, seconds it took)."""
    sock = raw_socket(url)
    sock.sendall(head)
    t0, got, closed = time.monotonic(), b"", False
    while time.monotonic() - t0 < seconds:
        try:
            sock.sendall(b"a")
            sock.settimeout(1)
            d = sock.recv(4096)
            got += d
            if not d:
                closed = True
                break
        except socket.timeout:
            continue
        except OSError:
            closed = True
            break
    sock.close()
    return closed, got, time.monotonic() - t0


def open_stream(url: str, path: str, cookie: str | None) -> tuple[socket.socket, bytes]:
    """A raw GET held open; returns (socket, the answer's status line)."""
    u, s = urlparse(url), raw_socket(url)
    head = f"GET {path} HTTP/1.1\r\nHost: {u.hostname}\r\n" + (f"Cookie: {cookie}\r\n" if cookie else "") + "\r\n"
    s.sendall(head.encode())
    got = b""
    while b"\r\n" not in got:
        chunk = s.recv(4096)
        if not chunk:
            break
        got += chunk
    return s, got.split(b"\r\n", 1)[0]
