"""The serving fan-out's data plane without Ray (indexer.ray.fanout): a shard searcher's port answers
only a peer that passes the HMAC challenge with its key, never unpickles anything before that,
and answers (D, I) equal to the part's own search.

Real parts: a faiss IVF part written to disk and memory-mapped, a real TCP socket on 127.0.0.1,
the stdlib's challenge. The Ray side (placement, node loss, restarts) is
tests/serving/test_ray_serving.py.
"""
from __future__ import annotations

import pickle
import secrets
import socket
import time
from multiprocessing.connection import AuthenticationError, Connection
from pathlib import Path

import faiss
import numpy as np
import pytest

from indexer.ray.actor import ShardSearcher
from indexer.ray.link import open_link

D, NLIST = 16, 8


@pytest.fixture(scope="module")
def part(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """An IVF8,Flat part of 2,000 vectors on disk, and 20 queries."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2000, D)).astype(np.float32)
    index = faiss.index_factory(D, f"IVF{NLIST},Flat")
    index.train(x)
    index.add_with_ids(x, np.arange(1000, 3000, dtype=np.int64))
    path = tmp_path_factory.mktemp("fanout-link") / "part.faiss"
    faiss.write_index(index, str(path))
    return path, rng.standard_normal((20, D)).astype(np.float32)


@pytest.fixture()
def searcher(part):
    key = secrets.token_bytes(32)
    s = ShardSearcher(str(part[0]), "nprobe=3", 1, key, host="127.0.0.1")
    yield s, key
    s.close()


def test_a_peer_with_the_key_gets_the_parts_answers(part, searcher) -> None:
    path, q = part
    s, key = searcher
    index = faiss.read_index(str(path))
    index.nprobe = 3
    # the router's coarse assignment (what IndexShardsIVF computes once for every part)
    dq, iq = faiss.extract_index_ivf(index).quantizer.search(q, 3)
    with open_link(s.endpoint(), key, timeout=10) as conn:
        for k in (1, 5, 2500):                    # past the part's size: -1 padding, as faiss
            want_d, want_i = index.search(q, k)
            for coarse in ((None, None), (dq, iq)):   # the part's own search, or the lists named
                conn.send((q, k, *coarse))
                assert conn.poll(10)
                d, i = conn.recv()
                np.testing.assert_array_equal(i, want_i)
                np.testing.assert_allclose(d, want_d, rtol=1e-6)
        # scanning the lists named: a wrong assignment gives another answer (the lists are used)
        conn.send((q, 5, dq, np.ascontiguousarray(np.roll(iq, 1, axis=0))))
        assert conn.poll(10) and not np.array_equal(conn.recv()[1], index.search(q, 5)[1])
        conn.send(("not a query", 3))              # a bad message: an error string, not a crash
        assert conn.poll(10) and isinstance(conn.recv(), str)
        conn.send((q[:2], 3, None, None))          # and the connection still serves
        assert conn.poll(10) and conn.recv()[1].shape == (2, 3)


def test_a_wrong_key_is_refused(searcher) -> None:
    s, _ = searcher
    with pytest.raises(AuthenticationError):
        open_link(s.endpoint(), secrets.token_bytes(32), timeout=10)


class _Marker:
    """Unpickling this creates a file: proof that the peer's bytes were unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_nothing_is_unpickled_before_the_challenge(searcher, tmp_path: Path) -> None:
    """A peer without the key that sends a pickle at once (skipping the challenge) is cut off
    and its pickle never loaded: pickles from the network run code."""
    s, _ = searcher
    marker = tmp_path / "unpickled"
    sock = socket.create_connection(s.endpoint(), timeout=10)
    sock.settimeout(None)                         # Connection reads the fd raw: blocking
    conn = Connection(sock.detach())
    closed = False
    try:
        conn.send_bytes(pickle.dumps(_Marker(str(marker))))     # at once: no challenge answered
        conn.send_bytes(pickle.dumps(_Marker(str(marker))))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:        # its challenge, its failure notice, then EOF
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                break
            try:
                conn.recv_bytes()
            except (EOFError, OSError):
                closed = True
                break
    finally:
        conn.close()
    assert closed, "the searcher kept a connection that never passed the challenge"
    time.sleep(0.2)
    assert not marker.exists()
    # the searcher still serves peers that know the key (one bad peer costs it nothing)
    with open_link(s.endpoint(), searcher[1], timeout=10) as good:
        good.send((np.zeros((1, D), np.float32), 1, None, None))
        assert good.poll(10) and good.recv()[1].shape == (1, 1)


def test_a_short_key_is_refused(part) -> None:
    with pytest.raises(ValueError, match="16 random bytes"):
        ShardSearcher(str(part[0]), "", 1, b"short", host="127.0.0.1")
