"""Which files of a folder are images, and their labels: the one walk that `indexer build` / `add`
/ `search` / `eval`, training's folder dataset and int8 calibration share, so a folder trains,
calibrates and indexes as the same images with the same classes. Deterministic (sorted); entries
that look like images but cannot be read are yielded with ``problem`` set, to be reported, not
dropped; hidden entries (names starting with ".": macOS ``._`` files, ``.ipynb_checkpoints``,
``.thumbnails``) are not walked, as file browsers and shell globs do not show them, nor is an index,
an audit's output or a training run kept inside the folder (``OUTPUT_FILES``: their PNGs are not photos)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterable, Iterator

from .images import is_listed

#: a folder holding one of these is an index that `indexer build` wrote (a store, a shard's part, a
#: sharded index's trained file: ``indexer.directory.index_dir``'s names), not photos: not walked
INDEX_FILES = frozenset({"store.lmdb", "index.faiss", "part.faiss", "trained.faiss"})
#: nor is a folder holding all of one of these sets: what `indexer audit --out` writes (its contact
#: sheets are PNGs) and a training run (curves.png, frm.png), wherever the user put them
OUTPUT_FILES = (*(frozenset({n}) for n in INDEX_FILES), frozenset({"summary.json", "outliers.jsonl"}),
                frozenset({"config.json", "metrics.json"}))


@dataclass(frozen=True)
class GalleryFile:
    """One candidate image: where it is and what the index will call it."""

    abspath: Path
    relpath: str          # POSIX-style, relative to the gallery root (plus an optional prefix)
    label: str | None     # parent folder relative to the root; None for files at the root
    problem: str | None = None   # set when the entry is not a readable regular file


def printable_name(name: str) -> str:
    """``name`` with the bytes of a name that is not valid UTF-8 written as ``\\xe9``: Python's
    surrogate escapes raise on every UTF-8 encode (LMDB keys, JSON, the terminal)."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def utf8_problem(name: str, what: str = "file") -> str | None:
    """Why a file or folder named ``name`` is skipped when its name is not valid UTF-8, else None:
    paths are UTF-8 text everywhere, and guessing another encoding would be lossy, so such a name
    is skipped and named in ``report.jsonl`` instead of aborting the build."""
    try:
        name.encode("utf-8")
        return None
    except UnicodeEncodeError:
        raw = os.fsencode(name)
        return (f"skipped: the {what} name {raw!r} is not valid UTF-8; rename it to UTF-8 "
                "(e.g. `convmv -f latin1 -t utf8 -r --notest DIR`) and run `indexer add` again")


def label_of(relpath: str) -> str | None:
    parent = str(PurePosixPath(relpath).parent)
    return None if parent in ("", ".") else parent


def one_file(path: Path, prefix: str = "") -> GalleryFile:
    """One image file as the walk names a file of a folder's top: ``PREFIX/<name>`` (labelled by
    the prefix): ``indexer add photo.jpg`` without a folder made for it."""
    prefix, name = prefix.strip("/"), printable_name(path.name)
    relpath = f"{prefix}/{name}" if prefix else name
    return GalleryFile(path, relpath, label_of(relpath), utf8_problem(path.name))


def written_here(names: Iterable[str]) -> bool:
    """Whether a folder holding the files ``names`` is one this project's tools wrote."""
    names = set(names)
    return any(mark <= names for mark in OUTPUT_FILES)


def walk_gallery(root: str | Path, prefix: str = "") -> Iterator[GalleryFile]:
    """Yield every image-named entry under ``root`` (hidden ones and tool outputs left out) in
    sorted order, symlinks followed (as ``find -L``, each directory once: a link to an ancestor is
    yielded with ``problem`` set). Also with ``problem``:
    image-named non-regular files, names not UTF-8 (``relpath`` printable) and ENAMETOOLONG. Image
    names are ``embedder.images.is_listed``'s: HEIC or raw photos too, reported when they fail to decode."""
    root = Path(root)
    if not root.is_dir():
        raise NotADirectoryError(f"{root}: not a directory")
    prefix = prefix.strip("/")

    def rel(p: Path) -> str:
        r = printable_name(p.relative_to(root).as_posix())
        return f"{prefix}/{r}" if prefix else r

    def entry(p: Path, problem: str | None = None) -> GalleryFile:
        r = rel(p)
        return GalleryFile(p, r, label_of(r), problem)

    def refused(p: Path, e: OSError, what: str) -> GalleryFile:
        return entry(p, f"unreadable {what}: {e.strerror or e} (path of {len(os.fsencode(p)):,} bytes)")

    st = root.stat()
    visited = {(st.st_dev, st.st_ino)}
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as e:
            yield GalleryFile(d, rel(d) if d != root else ".", None,
                              f"unreadable directory: {e.strerror or e}")
            continue
        if d != root and written_here(e.name for e in entries):
            continue                        # an index, an audit or a training run inside the gallery
        subdirs = []
        for e in entries:
            if e.name.startswith("."):
                continue
            p = Path(e.path)
            image_name = is_listed(e.name)
            try:
                is_dir = e.is_dir(follow_symlinks=True)
            except OSError as err:          # e.g. ENAMETOOLONG on a symlink's stat
                yield refused(p, err, "entry")
                continue
            if is_dir:
                if image_name:
                    yield entry(p, "unreadable: is a directory, not an image file")
                    continue
                bad = utf8_problem(e.name, "folder")
                if bad:                     # everything under it would be named in that encoding
                    yield entry(p, bad + " (nothing under it was indexed)")
                    continue
                try:
                    t = e.stat(follow_symlinks=True)
                except OSError as err:      # a path the OS refuses (ENAMETOOLONG past PATH_MAX)
                    yield refused(p, err, "directory")
                    continue
                if (t.st_dev, t.st_ino) in visited:        # a link back up, or to a folder walked
                    yield entry(p, "not followed: a symlink to a directory already walked "
                                   f"({os.path.realpath(p)}): a loop or a second link")
                    continue
                visited.add((t.st_dev, t.st_ino))
                subdirs.append(p)
                continue
            if not image_name:
                continue
            bad = utf8_problem(e.name)
            if bad:
                yield entry(p, bad)
            elif e.is_symlink() and not p.exists():
                yield entry(p, "unreadable: dangling symlink")
            elif not e.is_file(follow_symlinks=True):
                yield entry(p, "unreadable: not a regular file")
            else:
                yield entry(p)
        stack.extend(reversed(subdirs))
