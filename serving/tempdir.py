"""The app's own temp folder for Gradio's uploads and cached results, emptied at start-up, so what
a killed server left behind does not pile up. One folder per port below ``$GRADIO_TEMP_DIR``,
``flock``-held while it runs (start-up empties only folders nobody holds); set before ``gradio``
is imported. Safety: the parent must be a real 0700 directory of this user (another user could
pre-create it), and everything below is opened and removed through directory descriptors
without following symlinks (``O_NOFOLLOW``, ``dir_fd``).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

LOCK_NAME = ".das-retrieval.lock"
PREFIX = "das-retrieval-app-"
STALE_S = 120.0
_HELD: list[int] = []              # lock descriptors kept open for the life of the process
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class UnsafeTempDirError(OSError):
    """The temp folder (or its parent) could be changed by someone else: refused in one line."""


def app_temp_dir(port: int, base: str | Path | None = None) -> Path:
    return _base(base) / f"{PREFIX}{port}"


def _base(base: str | Path | None) -> Path:
    return Path(base or os.environ.get("GRADIO_TEMP_DIR")
                or Path(tempfile.gettempdir()) / f"das-retrieval-{os.getuid()}")


def _open_private(name: str | Path, dir_fd: int | None = None, shown: Path | None = None) -> int:
    """Create ``name`` (0700) or open it, refusing what another user could change (a symlink, not
    a directory, another owner, group/other write): an ``O_DIRECTORY`` fd of the checked folder."""
    shown = shown or Path(name)
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        pass
    fix = "; remove it (or set GRADIO_TEMP_DIR to a folder of your own) and start again"
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            what = ("is a symlink" if stat.S_ISLNK(st.st_mode) else
                    "is not a directory" if not stat.S_ISDIR(st.st_mode) else e.strerror)
        except OSError:
            what = e.strerror
        raise UnsafeTempDirError(f"temp folder {shown}: refused, it {what}" + fix) from None
    st = os.fstat(fd)
    problem = (f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
               if st.st_uid != os.getuid() else
               f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
               if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) else None)
    if problem:
        os.close(fd)
        raise UnsafeTempDirError(f"temp folder {shown}: refused, it {problem}" + fix)
    return fd


def claim_temp_dir(port: int, base: str | Path | None = None) -> tuple[Path, int | None]:
    """Create, lock and empty this app's temp folder and point Gradio at it: (folder, entries
    removed), or (folder, None) when a live process holds it; UnsafeTempDirError if not private."""
    parent = _base(base)
    parent.parent.mkdir(parents=True, exist_ok=True)
    base_fd = _open_private(parent)
    folder = parent / f"{PREFIX}{port}"
    try:
        fd_dir = _open_private(folder.name, base_fd, folder)
        try:
            fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                         0o600, dir_fd=fd_dir)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                os.environ["GRADIO_TEMP_DIR"] = str(folder)
                return folder, None
            _HELD.append(fd)
            removed = _empty(fd_dir)
        finally:
            os.close(fd_dir)
        for entry in os.scandir(base_fd):
            if entry.name.startswith(PREFIX) and entry.name != folder.name and _stale(base_fd, entry.name):
                shutil.rmtree(entry.name, dir_fd=base_fd, ignore_errors=True)
                removed += 1
    finally:
        os.close(base_fd)
    os.environ["GRADIO_TEMP_DIR"] = str(folder)
    return folder, removed


def _empty(dir_fd: int) -> int:
    """Remove every entry of the folder ``dir_fd`` but the lock file, symlinks as links and
    directories through descriptors (never following a link); returns the count."""
    removed = 0
    for entry in os.scandir(dir_fd):
        if entry.name == LOCK_NAME:
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.name, dir_fd=dir_fd, ignore_errors=True)
            else:
                os.unlink(entry.name, dir_fd=dir_fd)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def _stale(base_fd: int, name: str) -> bool:
    """An earlier run's folder: a real directory of ours (a symlink is left alone), unchanged
    for STALE_S and its lock free (its server is gone)."""
    try:
        st = os.stat(name, dir_fd=base_fd, follow_symlinks=False)
        if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid()
                or time.time() - st.st_mtime < STALE_S):
            return False
        sub = os.open(name, _DIR_FLAGS, dir_fd=base_fd)
        try:
            fd = os.open(LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=sub)
        finally:
            os.close(sub)
    except OSError:
        return False                # no lock file: not a folder this module made
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)                # closing drops the probe lock; rmtree follows at once
