"""What a search returns: the query, its results, and a probe report (plain dataclasses)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from . import probes as P


class UnknownIdError(KeyError):
    """An id or path that is not in the named index (the API answers 404)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


@dataclass
class Query:
    """What is being searched for: an uploaded image, or an image already in a gallery.

    A gallery query carries its id in ``source`` (the index it came from), so that index can
    use the stored embedding and leave the query itself out of its results; other indexes embed
    the same bytes with their own embedder.
    """
    image: Image.Image | None = None
    id: int | None = None
    source: str | None = None
    label: str | None = None
    path: str | None = None
    name: str = "query"
    _emb: dict[str, np.ndarray] = field(default_factory=dict, repr=False)


@dataclass
class Result:
    id: int
    score: float
    label: str | None
    path: str
    index: str
    thumbnail: Image.Image | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "score": self.score, "label": self.label, "path": self.path,
                "index": self.index}


@dataclass
class SearchResult:
    index: str
    query: Query
    results: list[Result]

    @property
    def ids(self) -> list[int]:
        return [r.id for r in self.results]

    @property
    def scores(self) -> list[float]:
        return [r.score for r in self.results]

    @property
    def labels(self) -> list[str | None]:
        return [r.label for r in self.results]

    @property
    def paths(self) -> list[str]:
        return [r.path for r in self.results]

    @property
    def thumbnails(self) -> list[Image.Image | None]:
        return [r.thumbnail for r in self.results]


@dataclass
class ProbeReport:
    """Original top-k and one row per probe, with overlap@k and (label known) precision@k."""
    index: str
    query: Query
    k: int
    rows: list[P.ProbeRow]
    results: dict[str, list[Result]]      # row name -> results (for thumbnails)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> list[dict[str, Any]]:
        return [{"index": self.index, "probe": r.name, "kind": r.kind, "overlap@k": r.overlap,
                 "precision@k": r.precision} for r in self.rows]
