"""What a request is and what it returns: the index state it reads (a Snapshot), the query, its
results, a probe report (plain dataclasses), and the two ways a request can be wrong."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from PIL import Image

from indexer import NOVEL_P, Hit, Index, suggest_label

from . import probes

MAX_K = 1000


class UnknownIdError(KeyError):
    """An id or path that is not in the named index (the API answers 404)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class RequestError(ValueError):
    """A malformed request; ``status``: the HTTP code the API answers with (UploadError: 413, 415)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


def check_k(k: Any) -> int:
    """The one check of k (API form text, UI slider, library call): an integer in 1..MAX_K."""
    if isinstance(k, str):
        try:
            k = int(k)
        except ValueError:
            pass
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 1 <= int(k) <= MAX_K:
        raise RequestError(f"k: expected an integer between 1 and {MAX_K}, got {k!r}")
    return int(k)


_TRUE, _FALSE = {"1", "true", "on", "yes"}, {"0", "false", "off", "no"}


def parse_switch(v: Any, name: str = "dba") -> bool | None:
    """A request's switch (``dba``, ``copies``): absent or empty -> None (the default), else a boolean."""
    if v is None or isinstance(v, bool):
        return v
    t = str(v).strip().lower()
    if t == "":
        return None
    if t in _TRUE or t in _FALSE:
        return t in _TRUE
    raise RequestError(f"{name}: expected true or false (1/0, on/off), got {str(v)[:60]!r}")


@dataclass(frozen=True)
class Snapshot:
    """One named index as one request sees it: a reload meanwhile never reaches the request."""
    name: str
    index: Index


@dataclass
class Query:
    """An uploaded image, or a gallery image (its id in ``source``: that index uses the stored
    embedding, others embed the bytes), or fused ``parts`` (no pixels)."""
    image: Image.Image | None = None
    id: int | None = None
    source: str | None = None
    label: str | None = None
    path: str | None = None
    name: str = "query"
    embeddings: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # per index (Searcher.embed)
    origin: Snapshot | None = field(default=None, repr=False)   # the index state it was found in
    parts: tuple["Query", ...] = ()                              # a fused query's queries

    def on(self, name: str) -> "Snapshot | str":
        """The snapshot this gallery query was found in when it is index ``name``'s, else the name."""
        return self.origin if self.origin is not None and self.origin.name == name else name


@dataclass
class Result(Hit):
    """An index's Hit with the index that found it and, on request, its thumbnail."""
    index: str = ""
    thumbnail: Image.Image | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "score": self.score, "label": self.label, "path": self.path,
                "index": self.index}


@dataclass
class SearchResult:
    index: str
    query: Query
    results: list[Result]
    dba: bool | None = None     # whether DBA re-ranking made these results (the Searcher sets it)
    partial: list[int] = field(default_factory=list)   # shards left out (served over Ray, node lost)
    novelty: float | None = None    # p-value of no close match in the gallery (indexer.ann.new_photos)

    @cached_property
    def suggested(self) -> tuple[str, float] | None:
        """(label, share of the vote) the results vote for (indexer.suggest_label); None when none
        has a label or the query has no close match."""
        return suggest_label(self.labels, self.scores, self.novelty)

    @property
    def unlike_gallery(self) -> bool:
        """Whether the query has no close match in the gallery (p <= NOVEL_P)."""
        return self.novelty is not None and self.novelty <= NOVEL_P

    @property
    def ids(self) -> list[int]:
        return [r.id for r in self.results]

    @property
    def scores(self) -> list[float]:
        return [r.score for r in self.results]

    @property
    def labels(self) -> list[str | None]:
        return [r.label for r in self.results]


@dataclass
class ProbeReport:
    """Original top-k and one row per probe, with overlap@k and (label known) precision@k."""
    index: str
    query: Query
    k: int
    rows: list[probes.ProbeRow]
    results: dict[str, list[Result]]      # row name -> results (for thumbnails)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> list[dict[str, Any]]:
        return [{"index": self.index, "probe": r.name, "kind": r.kind, "overlap@k": r.overlap,
                 "precision@k": r.precision} for r in self.rows]
