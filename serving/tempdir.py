"""The app's own temp folder: Gradio's uploads and cached results go there, and it is emptied
at start-up, so files a killed server left behind do not pile up across restarts.

Gradio writes to ``$GRADIO_TEMP_DIR`` (default ``/tmp/gradio``, shared by every Gradio app of
the machine). We give each app a folder of its own below it, named for the port (one server per
port), and hold an ``flock`` on it while the server runs: start-up empties only a folder nobody
holds, so neither another app's files nor a still-running server's on the same port are
touched. Folders of earlier runs on other ports (``das-retrieval-app-*`` beside ours) are removed
too when nobody holds them and they have not changed for ``STALE_S`` (a server starting at this
moment has not locked its folder yet). Must run before ``gradio`` is imported (it reads the
variable at import).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path

LOCK_NAME = ".das-retrieval.lock"
PREFIX = "das-retrieval-app-"
STALE_S = 120.0
_HELD: list[int] = []              # lock descriptors kept open for the life of the process


def app_temp_dir(port: int, base: str | Path | None = None) -> Path:
    base = Path(base or os.environ.get("GRADIO_TEMP_DIR")
                or Path(tempfile.gettempdir()) / f"das-retrieval-{os.getuid()}")
    return base / f"{PREFIX}{port}"


def claim_temp_dir(port: int, base: str | Path | None = None) -> tuple[Path, int | None]:
    """Create, lock and empty this app's temp folder and point Gradio at it.
    Returns (folder, entries removed), or (folder, None) when another live process holds it."""
    folder = app_temp_dir(port, base)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        os.environ["GRADIO_TEMP_DIR"] = str(folder)
        return folder, None
    _HELD.append(fd)
    removed = 0
    for entry in folder.iterdir():
        if entry.name == LOCK_NAME:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed += 1
    for other in folder.parent.glob(f"{PREFIX}*"):
        if other != folder and _stale(other):
            shutil.rmtree(other, ignore_errors=True)
            removed += 1
    os.environ["GRADIO_TEMP_DIR"] = str(folder)
    return folder, removed


def _stale(folder: Path) -> bool:
    """An earlier run's folder: unchanged for STALE_S and its lock free (its server is gone)."""
    try:
        if not folder.is_dir() or folder.is_symlink() or time.time() - folder.stat().st_mtime < STALE_S:
            return False
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False                # no lock file: not a folder this module made
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)                # closing drops the probe lock; rmtree follows at once
