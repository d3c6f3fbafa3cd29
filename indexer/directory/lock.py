"""One writer per index directory: an exclusive ``fcntl.flock`` on ``DIR/.writer.lock``.

Why: two writers interleave their ``sync_index`` steps, and the slower one gives up, leaving
stored images faiss never gets. The kernel drops flock when the holder dies (``kill -9``): no
stale lock. The file records the holder (pid, command, start) for the refusal line. Readers never
take it. Re-entrant for its thread (``build --ray`` locks ``--out``, then merges into it);
another thread conflicts like another process.
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import IndexerError

LOCK_FILE = ".writer.lock"

_HELD: dict[str, list] = {}        # realpath of the directory -> [owner thread id, depth]
_HELD_LOCK = threading.Lock()


class IndexBusyError(IndexerError):
    """Another process is writing this index directory (``--wait`` waits for it instead)."""


def lock_path(directory: str | Path) -> Path:
    return Path(directory) / LOCK_FILE


def holder(directory: str | Path) -> dict | None:
    """What the lock file says about its holder ({"pid", "command", "since"}), or None; the last
    holder's record stays after it exits, so pair it with :func:`is_locked`."""
    try:
        raw = lock_path(directory).read_text()
        rec = json.loads(raw) if raw.strip() else None
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def is_locked(directory: str | Path) -> bool:
    """Whether some process holds the writer lock now (a shared-lock probe; never blocks)."""
    path = lock_path(directory)
    if not path.exists():
        return False
    key = os.path.realpath(directory)
    with _HELD_LOCK:
        if key in _HELD:
            return True
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)            # closing drops the probe's shared lock
    return False


def _describe(directory: Path) -> str:
    rec = None
    for _ in range(20):          # the holder writes its record right after taking the lock
        rec = holder(directory)
        if rec and rec.get("pid"):
            break
        time.sleep(0.05)
    if not rec or not rec.get("pid"):
        return f"index {directory} is being written by another process"
    return (f"index {directory} is being written by pid {rec['pid']} ({rec.get('command', '?')}, "
            f"since {rec.get('since', '?')})")


@contextmanager
def writer_lock(directory: str | Path, command: str = "", *, wait: bool = False) -> Iterator[None]:
    """Hold the directory's writer lock for the ``with`` body (creating the directory if needed);
    another holder: :class:`IndexBusyError` naming its pid, or with ``wait`` block until released."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(directory)
    with _HELD_LOCK:
        nested = key in _HELD and _HELD[key][0] == threading.get_ident()
        if nested:                             # re-entered by the thread holding it
            _HELD[key][1] += 1
    if nested:
        try:
            yield
        finally:
            with _HELD_LOCK:
                _HELD[key][1] -= 1
        return
    fd = os.open(lock_path(directory), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            busy = _describe(directory)
            if not wait:
                raise IndexBusyError(f"{busy}; try again when it has finished, or pass --wait") from None
            print(f"{busy}; waiting for it to finish (--wait)", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        record = {"pid": os.getpid(), "command": command or " ".join(sys.argv[:3]),
                  "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        with _HELD_LOCK:
            _HELD[key] = [threading.get_ident(), 1]
        try:
            yield
        finally:
            with _HELD_LOCK:
                _HELD.pop(key, None)
    finally:
        os.close(fd)                           # releases the flock (so does the process dying)
