"""``BuildOptions``: how an index is chosen and tuned, one frozen value checked once.

Why one value: build, ``--shard``, ``--ray``, merge and the sharded build all take the same six
choices and hand them on (build_index -> selection.build; merge_shards; build_sharded ->
stream.plan; build_with_ray -> either). Loose, they were re-checked at five sites; here they are
checked when the value is made, in one line naming the option, before any work.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from embedder.cli import memory_size

from .errors import IndexerError
from .faiss_index import DEFAULT_FLAT_THRESHOLD, INDEX_TYPES
from .manifest import DEFAULT_TARGET_RECALL


@dataclass(frozen=True)
class BuildOptions:
    """``index_memory``: the BUILD's budget in bytes (``indexer build --index-memory``): index
    types whose codes alone exceed it are not built. Not the serving budget (``--max-memory``,
    :mod:`indexer.rerank`). A size text ("4G") is accepted and stored as bytes."""

    index_type: str = "auto"
    flat_threshold: int = DEFAULT_FLAT_THRESHOLD
    nlist: int | None = None
    target_recall: float = DEFAULT_TARGET_RECALL
    seed: int = 0
    index_memory: int | None = None

    def __post_init__(self) -> None:
        if self.index_type not in INDEX_TYPES:
            raise IndexerError(f"index type {self.index_type!r}: expected one of {', '.join(INDEX_TYPES)}")
        if not 0 < self.target_recall <= 1:
            raise IndexerError(f"target recall {self.target_recall}: expected 0 < target <= 1")
        for name in ("flat_threshold", "nlist"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise IndexerError(f"{name.replace('_', '-')} {v}: expected a positive integer")
        try:
            object.__setattr__(self, "index_memory", memory_size(self.index_memory))
        except ValueError as e:
            raise IndexerError(str(e)) from None

    @classmethod
    def of(cls, options: "BuildOptions | None" = None, **kw: Any) -> "BuildOptions":
        """``options`` with the keyword spellings of the build functions applied (``max_memory``
        is the old name of ``index_memory``); checked once, here."""
        if "max_memory" in kw:
            kw["index_memory"] = kw.pop("max_memory")
        unknown = set(kw) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown build option(s): {', '.join(sorted(unknown))}")
        if options is None:
            return cls(**kw)
        return replace(options, **kw) if kw else options     # already checked: passed on as is
