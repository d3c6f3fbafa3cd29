"""The audit a server shows (issue 42 item 2): computed once per index version, never per
request. The version is the manifest's sha256 (``indexer add/remove/repair`` rewrite it), and
the lists are kept in ``DIR/audit.json`` beside the index, so a restarted server does not
recompute them either; a read-only index directory keeps them in the server's memory only.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from .run import lists, run_audit, summary
from .source import manifest_file, open_gallery

CACHE_FILE = "audit.json"
SERVED_TOP = 60            # rows per list a page shows (the CLI writes DEFAULT_TOP)
_LOCKS: dict[Path, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()
_MEMO: dict[Path, dict[str, Any]] = {}     # the audit this process last served, per directory


#: the lists' format: a cache written by an older audit (2: byte-identical files) is computed again
FORMAT = 2


def version(directory: str | Path) -> str:
    """The index's version: the sha256 of its manifest (what every change rewrites last), and the
    audit's format."""
    return f"{FORMAT}:" + hashlib.sha256(manifest_file(directory).read_bytes()).hexdigest()


def served_audit(directory: str | Path, *, top: int = SERVED_TOP) -> dict[str, Any]:
    """{"version", "summary", "duplicates", "outliers", and with labels "mislabelled",
    "confused"} for the index in ``directory``: the one this process last served when it is of
    the index's current version, else DIR/audit.json when it is, else computed (once:
    concurrent callers wait for the first) and stored there. No server path in it (the
    summary's "index" is left out). A request costs one read of the manifest."""
    d = Path(directory).resolve()
    with _LOCKS_GUARD:
        lock = _LOCKS.setdefault(d, threading.Lock())
    with lock:
        key = version(d)
        memo = _MEMO.get(d)
        if memo is None or memo["version"] != key:
            memo = _MEMO[d] = _stored(d, key) or _computed(d, key, top)
        return memo


def _stored(d: Path, key: str) -> dict[str, Any] | None:
    try:
        cached = json.loads((d / CACHE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return cached if cached.get("version") == key else None


def _computed(d: Path, key: str, top: int) -> dict[str, Any]:
    g = open_gallery(d)
    try:
        a = run_audit(g)            # k: the default, or on a tiny gallery all its other images
        rows = lists(a, top)
        info = {k: v for k, v in summary(a, rows).items() if k != "index"}
    finally:
        g.close()               # its own store reference: one per audited version otherwise
    out = {"version": key, "summary": info, **rows}
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{CACHE_FILE}.", dir=d)
    except OSError:              # a read-only index directory: kept in this process only
        return out
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(out, fh)
        os.replace(tmp, d / CACHE_FILE)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
    return out
