"""``manifest.json``: the one schema of what an index directory records about itself.

Every writer (build, add/remove/repair, merge, the sharded and the Ray builds) makes a
:class:`Manifest` and every reader goes through :meth:`Manifest.read`, so a key that is not a
field here cannot be written, and a manifest whose fields have the wrong shape is refused in
one line before anything trusts it. Fields a writer left out stay out of the JSON (``ABSENT``,
not ``null``): manifests written before a field existed read back unchanged, and keys written by
a newer version are kept (``extra``) and written back as they were.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from embedder.files import atomic_target

from .errors import IndexerError

FORMAT = "das-index/1"
DEFAULT_TARGET_RECALL = 0.95    # recall@10 vs exact search that the search parameter is tuned to


class _Absent:
    """A field the manifest does not hold (distinct from a recorded ``null``)."""

    def __repr__(self) -> str:
        return "ABSENT"

    def __bool__(self) -> bool:
        return False


ABSENT: Any = _Absent()


@dataclass
class Manifest:
    """The keys of ``manifest.json``; see ``indexer info`` for how each is shown."""

    model: dict                     # model_info(): hash, file, source, dim, normalized, backbone, ...
    dim: int
    count: int                      # vectors in the index (a shard: images in its store)
    index_type: Any = ABSENT        # None for a shard (a store, no index)
    factory: Any = ABSENT           # the faiss.index_factory string (IndexSpec)
    nlist: Any = ABSENT
    pq_m: Any = ABSENT
    k_factor: Any = ABSENT
    metric: Any = ABSENT
    nprobe: Any = ABSENT
    search_params: Any = ABSENT     # faiss.ParameterSpace string tuned to the target
    recall_at_10: Any = ABSENT      # measured on held-out gallery vectors
    tuning_recall_at_10: Any = ABSENT
    tuning_queries: Any = ABSENT
    heldout_queries: Any = ABSENT
    target_recall: Any = ABSENT
    train_points: Any = ABSENT
    train_seconds: Any = ABSENT
    max_memory: Any = ABSENT        # bytes, when the build had a budget
    candidates: Any = ABSENT        # the selection's table (selection.select)
    selection_seconds: Any = ABSENT
    warning: Any = ABSENT
    index_file: Any = ABSENT        # {"bytes", "sha256"} of index.faiss, compared on open
    gallery: Any = ABSENT
    ingest: Any = ABSENT            # IngestStats, "skipped" as a count
    report: Any = ABSENT            # report.jsonl: the skipped files and why
    shard: Any = ABSENT             # {"i", "n"}: a shard directory, merged before searching
    merged_from: Any = ABSENT
    shards: Any = ABSENT            # [[i, n], ...] of the shards an index was built from
    sharded: Any = ABSENT           # a sharded index: {"shards", "trained", "held", "files"}
    stage_seconds: Any = ABSENT
    build_seconds: Any = ABSENT
    built_at: Any = ABSENT
    updated_at: Any = ABSENT
    format: str = FORMAT
    extra: dict = field(default_factory=dict, repr=False)   # keys of a newer version, kept as read

    # -- dict <-> Manifest -----------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, *, where: str | Path = "manifest", strict: bool = True) -> "Manifest":
        """Check ``d`` against the schema. ``strict`` (a writer): a key that is no field is a bug
        here and is refused; otherwise (a reader) it is kept in ``extra``."""
        if not isinstance(d, dict):
            raise IndexerError(f"{where}: not a {FORMAT} manifest (a JSON object was expected)")
        known = {f.name for f in fields(cls)} - {"extra"}
        unknown = {k: v for k, v in d.items() if k not in known}
        if strict and unknown:
            raise IndexerError(f"{where}: manifest key(s) {sorted(unknown)} are not fields of "
                               "indexer.manifest.Manifest")
        m = cls(**{k: v for k, v in d.items() if k in known}, extra=unknown) \
            if {"model", "dim", "count"} <= d.keys() else None
        problem = _problem(d, m)
        if problem:
            raise IndexerError(f"{where}: not a {FORMAT} manifest ({problem})")
        return m  # type: ignore[return-value]

    def to_dict(self) -> dict:
        """The JSON object, without the absent fields."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name != "extra" and getattr(self, f.name) is not ABSENT}
        return {**self.extra, **out}

    # -- the file ---------------------------------------------------------------------------
    @classmethod
    def read(cls, path: str | Path) -> "Manifest":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise IndexerError(f"{path}: unreadable manifest ({e})") from None
        return cls.from_dict(d, where=path, strict=False)

    def write(self, path: str | Path) -> None:
        """Atomically (embedder.files.atomic_target): a reader sees the old manifest or this one."""
        with atomic_target(path) as tmp, open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")


def _problem(d: dict, m: Manifest | None) -> str:
    """What is wrong with the shape of ``d`` (as read back into ``m``), or ""."""
    if d.get("format") != FORMAT:
        return f"format {d.get('format')!r}"
    if m is None:
        return f"missing {', '.join(k for k in ('model', 'dim', 'count') if k not in d)}"
    if not isinstance(m.model, dict) or not isinstance(m.model.get("hash"), str):
        return "model.hash is not a string"
    for name in ("dim", "count"):
        v = getattr(m, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            return f"{name} {v!r} is not a count"
    for name, keys in (("index_file", ()), ("shard", ("i", "n")), ("sharded", ("shards", "trained", "held"))):
        v = getattr(m, name)
        if v not in (ABSENT, None) and not (isinstance(v, dict) and all(k in v for k in keys)):
            return f"{name} is not an object with {'/'.join(keys) or 'fields'}"
    return ""
