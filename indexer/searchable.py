"""The one type of what an :class:`indexer.Index` searches, whatever its serving mode (in RAM,
codes only, parts as one, over Ray; DBA sits on top, in ``Index``): an answer says which shards
it left out, and nothing is probed for attributes only one mode has."""
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

    def search(self, q: np.ndarray, k: int, widen: float = 1.0) -> Answer:
        """Top-``k`` of each row of ``q``; ``widen`` > 1: an IVF index probes that many times its
        lists (at most all; a search within labels, whose images are a fraction of each list)."""
        ...

    # what a codes-only index holds in RAM (codec, re-rank factor, bytes); None: all of it
    summary: dict | None = None

    def missing(self) -> list[int]:
        """The shards whose searcher does not answer now (none in one process: the default)."""
        return []


__all__ = ["Answer", "Searchable"]
