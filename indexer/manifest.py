"""``manifest.json``: the one schema of what an index directory records about itself.

Every writer (build, add/remove/repair, merge, the sharded and the Ray builds) makes a
:class:`Manifest` and every reader goes through :meth:`Manifest.read`, so a key that is not a
field here cannot be written, and a manifest whose fields have the wrong shape is refused in
one line before anything trusts it. Fields not recorded (None) stay out of the JSON: manifests
written before a field existed read back unchanged, and keys written by a newer version are
kept (``extra``) and written back as they were.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from embedder.files import atomic_target

from .errors import IndexerError

FORMAT = "das-index/1"
DEFAULT_TARGET_RECALL = 0.95    # recall@10 vs exact search that the search parameter is tuned to


@dataclass
class Manifest:
    """The keys of ``manifest.json``; ``indexer info`` shows them. None: not recorded."""

    model: dict                             # model_info(): hash, file, source, dim, backbone, ...
    dim: int
    count: int                              # vectors in the index (a shard: images in its store)
    index_type: str | None = None           # always written; None: a shard (a store, no index)
    factory: str | None = None              # faiss.index_factory string (IndexSpec)
    nlist: int | None = None
    pq_m: int | None = None
    k_factor: int | None = None
    metric: str | None = None
    nprobe: int | None = None
    search_params: str | None = None        # faiss.ParameterSpace string tuned to the target
    recall_at_10: float | None = None       # measured on held-out gallery vectors
    tuning_recall_at_10: float | None = None
    tuning_queries: int | None = None
    heldout_queries: int | None = None
    target_recall: float | None = None
    train_points: int | None = None
    train_seconds: float | None = None
    max_memory: int | None = None           # bytes, when the build had a budget
    candidates: list | None = None          # the selection's table (selection.select)
    selection_seconds: float | None = None
    warning: str | None = None
    index_file: dict | None = None          # {"bytes", "sha256"} of index.faiss, compared on open
    gallery: str | None = None
    ingest: dict | None = None              # IngestStats, "skipped" as a count
    report: str | None = None               # report.jsonl: the skipped files and why
    shard: dict | None = None               # {"i", "n"}: a shard, merged before it is searched
    merged_from: list | None = None
    shards: list | None = None              # [[i, n], ...]: the shards it was built from
    sharded: dict | None = None             # a sharded index: {"shards", "trained", "held", "files"}
    stage_seconds: dict | None = None
    neighbours: dict | None = None          # DBA re-ranking (indexer.neighbours): method, k, alpha,
                                            # depth, file, bytes, sha256 of neighbours.npz
    build_seconds: float | None = None
    built_at: str | None = None
    updated_at: str | None = None
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
        """The JSON object, without the fields not recorded."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"
               and (getattr(self, f.name) is not None or f.name == "index_type")}
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
    for name, keys in (("index_file", ()), ("shard", ("i", "n")), ("sharded", ("shards", "trained", "held")),
                       ("neighbours", ("method", "k", "alpha", "depth", "sha256"))):
        v = getattr(m, name)
        if v is not None and not (isinstance(v, dict) and all(k in v for k in keys)):
            return f"{name} is not an object with {'/'.join(keys) or 'fields'}"
    return ""


def recall_text(m: dict) -> str:
    """``indexer info``'s recall line, for single and sharded indexes alike: on what queries the
    recall was measured. After ``add``/``remove`` there is no held-out set any more (the index
    holds every vector) and the figure is the retuning's, on self-queries."""
    if m.get("heldout_queries"):
        on = (f"{m['heldout_queries']} held-out queries (tuned on {m.get('tuning_queries')}: "
              f"{m.get('tuning_recall_at_10')})")
    else:
        on = f"{m.get('tuning_queries') or 0} self-queries (retuned after add/remove)"
    return f"@10 vs exact {m['recall_at_10']} on {on}, target {m['target_recall']}"
