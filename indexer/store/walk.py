"""Which shard owns each gallery file, and the walk split into one file list per shard (the walk
itself, and the labels: ``embedder.folders``)."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator

from embedder.folders import GalleryFile, label_of, walk_gallery


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
