"""The one type of what an :class:`indexer.Index` searches, whatever its serving mode (in RAM:
``ann.served.SearchableIndex``, ``layouts.shards.PartsIndex``; codes only: ``ann.served.ReRanked``; over
Ray: ``ray.fanout.Router``; DBA sits on top, in ``Index``). Why: serving reads which shards an answer left
out from the answer itself (not per-thread state) and the rest from this protocol, never by
probing for attributes that only one mode has."""
from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np


class Answer(NamedTuple):
    """(scores, ids), each (n, k), id -1 padding; ``partial``: the shards left out (empty: whole)."""

    scores: np.ndarray
    ids: np.ndarray
    partial: tuple[int, ...] = ()


class Searchable(Protocol):
    """A read-only vector index for concurrent queries (normalised float32 rows, inner product)."""

    d: int
    ntotal: int

    def search(self, q: np.ndarray, k: int) -> Answer: ...

    def missing(self) -> list[int]:
        """The shards whose searcher does not answer now (none in one process)."""
        ...

    @property
    def summary(self) -> dict | None:
        """What a codes-only index holds in RAM (codec, re-rank factor, bytes); None: all of it."""
        ...


__all__ = ["Answer", "Searchable"]
