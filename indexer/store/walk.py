"""Finding gallery images and deciding which shard owns each one: a deterministic (sorted) walk
that reports entries which look like images but cannot be files instead of ignoring them."""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterator

from embedder.images import is_listed



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


def walk_gallery(root: str | Path, prefix: str = "") -> Iterator[GalleryFile]:
    """Yield every image-named entry under ``root`` in sorted order, symlinks followed (as ``find -L``,
    each directory once: a link to an ancestor is yielded with ``problem`` set). Also with ``problem``:
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
        subdirs = []
        for e in entries:
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


def parse_shard(spec: str) -> tuple[int, int]:
    """``"i/n"`` -> (i, n) with 0 <= i < n."""
    try:
        i_s, n_s = spec.split("/")
        i, n = int(i_s), int(n_s)
    except ValueError:
        raise ValueError(f"--shard {spec!r}: expected i/n, e.g. 0/2") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--shard {spec!r}: expected 0 <= i < n")
    return i, n


def shard_of(relpath: str, n: int) -> int:
    """Stable shard number of a relative path (same on every machine and Python run)."""
    h = hashlib.blake2b(relpath.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "big") % n


# ---------------------------------------------------------------------------- one walk, many lists


def split_walk(root: str | Path, lists: list[Path], progress: bool = False) -> list[int]:
    """Walk ``root`` once, writing each entry (``[relpath, problem]`` JSON lines) to the list of the
    shard that owns it (a walk per task would put S times the metadata traffic on the shared
    filesystem); lists renamed into place. Returns the entries per list."""
    from contextlib import ExitStack

    import json

    from tqdm.auto import tqdm

    from embedder.files import atomic_target

    n = len(lists)
    counts = [0] * n
    with ExitStack() as stack:
        outs = [stack.enter_context(open(stack.enter_context(atomic_target(p)), "w", buffering=1 << 20))
                for p in lists]
        for f in tqdm(walk_gallery(root), desc="listing the gallery", unit="file", disable=not progress):
            i = shard_of(f.relpath, n)
            outs[i].write(json.dumps([f.relpath, f.problem], ensure_ascii=False) + "\n")
            counts[i] += 1
        for o in outs:
            o.flush()
    return counts


def read_file_list(root: str | Path, path: str | Path) -> Iterator[GalleryFile]:
    """The entries of a list written by ``split_walk``, in walk order (a shard task, or its
    retry, reads only its own list: no walk of the gallery)."""
    import json

    root = Path(root)
    with open(path, encoding="utf-8") as f:
        for line in f:
            rel, problem = json.loads(line)
            yield GalleryFile(root / rel, rel, label_of(rel) if rel != "." else None, problem)
