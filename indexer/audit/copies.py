"""Which of a search's hits are the query's own picture (resized, re-encoded, cropped): the
audit's pixel check (:func:`.duplicates.verify_pairs`: ORB keypoints, one similarity by RANSAC,
the aligned images compared) run on each query and its hits. For new photos checked against a
gallery before they are added (``indexer search FOLDER --copies``): content hashes catch the same
bytes only."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .duplicates import verify_pairs

#: hits below this cosine are not checked (a copy scores far above: on cub-dev with the fp32
#: default, resized to 70% and re-encoded 0.95, cropped to 85% 0.93; the species' other photos 0.69-0.78)
COPY_LOWER = 0.5


def copies(query: Callable[[int], bytes], gallery: Callable[[int], bytes], hits: Sequence[Sequence[tuple[int, float]]],
           *, progress: str = "") -> list[list[bool]]:
    """For each query ``r`` (its bytes: ``query(r)``) and each of its hits (gallery id, cosine;
    bytes: ``gallery(id)``): whether the two are one picture. Hits under :data:`COPY_LOWER` are
    not checked (False); ``progress``: a tqdm bar of that name over the pairs."""
    pairs = [(r, j, int(i)) for r, row in enumerate(hits) for j, (i, s) in enumerate(row) if s >= COPY_LOWER]
    out = [[False] * len(row) for row in hits]
    if not pairs:
        return out
    # a query's row is -(r + 1): the ids of one shared read callable (gallery ids are >= 0)
    a = np.array([-(r + 1) for r, _, _ in pairs], dtype=np.int64)
    b = np.array([i for _, _, i in pairs], dtype=np.int64)

    def read(x: int) -> bytes | None:
        try:
            return query(-x - 1) if x < 0 else gallery(x)
        except OSError:         # a query file gone since its search: not compared (KeyError: the same)
            return None

    same = verify_pairs(a, b, read, progress=progress).same
    for (r, j, _), s in zip(pairs, same):
        out[r][j] = bool(s)
    return out


__all__ = ["COPY_LOWER", "copies"]
