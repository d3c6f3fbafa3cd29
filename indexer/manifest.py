"""The manifest: what an index directory holds and how it was made.

Written last and atomically, so a reader never sees a manifest that describes an index file
that is not there yet.
"""
from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from .errors import IndexerError

FORMAT = "das-index/1"
MANIFEST = "manifest.json"
INDEX_FILE = "index.faiss"
STORE_DIR = "store.lmdb"
REPORT = "report.jsonl"
MODEL_FILE = "model.onnx"


@contextmanager
def atomic_target(path: str | Path) -> Iterator[str]:
    """Yield a temporary path beside ``path``; on success fsync it and os.replace it onto
    ``path``, on any error remove it. Readers thus see the old file or the new one, never half
    of one, even if the writer is killed."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | Path, obj: Any) -> None:
    with atomic_target(path) as tmp, open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def write_manifest(directory: str | Path, manifest: dict) -> None:
    write_json_atomic(Path(directory) / MANIFEST, {"format": FORMAT, **manifest})


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise IndexerError(f"{directory}: no index here (missing {MANIFEST}); run `indexer build` first")
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise IndexerError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise IndexerError(f"{path}: not a {FORMAT} manifest")
    return m


def write_report(directory: str | Path, skipped: list[dict]) -> Path:
    """One JSON object per skipped file: {"path": ..., "reason": ...}."""
    path = Path(directory) / REPORT
    fd, tmp = tempfile.mkstemp(prefix=REPORT + ".", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        for s in skipped:
            f.write(json.dumps(s) + "\n")
    os.replace(tmp, path)
    return path
