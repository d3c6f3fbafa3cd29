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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from embedder.files import atomic_target

from ..errors import IndexerError

FORMAT = "das-index/1"
DEFAULT_TARGET_RECALL = 0.95    # recall@10 vs exact search that the search parameter is tuned to


@dataclass
class Manifest(Mapping):
    """The keys of ``manifest.json``; ``indexer info`` shows them. None: not recorded.

    Read its fields as attributes. The read-only mapping view (``m["count"]``, ``m.get(...)``)
    is kept for code that still reads a manifest as the JSON object (serving, evaluate,
    benchmarks, tests); :meth:`to_dict` is the JSON boundary."""

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
    kmeans: str | None = None               # which k-means found the IVF lists: exact, approx, gpu
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
    neighbours: dict | None = None          # DBA re-ranking (indexer.ann.neighbours): method, k, alpha,
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
                               "indexer.directory.manifest.Manifest")
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

    # -- what callers ask of it ------------------------------------------------------------
    @property
    def is_shard(self) -> bool:
        """A shard (``indexer build --shard``): a store, no index; merged before it is searched."""
        return bool(self.shard)

    @property
    def is_sharded(self) -> bool:
        """A sharded index: its parts stay in the shard folders it lists (:mod:`indexer.layouts.shards`)."""
        return bool(self.sharded)

    @property
    def model_hash(self) -> str:
        return self.model["hash"]

    def replace(self, **changes: Any) -> "Manifest":
        """A copy with ``changes`` (field names; a name that is no field is a TypeError)."""
        return replace(self, **changes)

    def recall_text(self) -> str:
        """``indexer info``'s recall line, for single and sharded indexes alike: on what queries
        the recall was measured. After ``add``/``remove`` there is no held-out set any more (the
        index holds every vector) and the figure is the retuning's, on self-queries."""
        if self.heldout_queries:
            on = (f"{self.heldout_queries} held-out queries (tuned on {self.tuning_queries}: "
                  f"{self.tuning_recall_at_10})")
        else:
            on = f"{self.tuning_queries or 0} self-queries (retuned after add/remove)"
        return f"@10 vs exact {self.recall_at_10} on {on}, target {self.target_recall}"

    # -- the read-only mapping view (the JSON object's keys) ---------------------------------
    def __getitem__(self, key: str) -> Any:
        if key in _FIELDS and (getattr(self, key) is not None or key == "index_type"):
            return getattr(self, key)
        return self.extra[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())

    def __eq__(self, other: object) -> bool:       # equal to its JSON object, too
        if not isinstance(other, Mapping):
            return NotImplemented
        return self.to_dict() == (other.to_dict() if isinstance(other, Manifest) else dict(other))

    __hash__ = None     # type: ignore[assignment]  (mutable, like the dict it stands for)

    # -- the file ---------------------------------------------------------------------------
    @classmethod
    def read(cls, path: str | Path) -> "Manifest":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise IndexerError(f"{path}: unreadable manifest ({e})") from None
        except RecursionError:       # a hostile file: nested deeper than the parser's stack
            raise IndexerError(f"{path}: unreadable manifest (JSON nested too deep)") from None
        return cls.from_dict(d, where=path, strict=False)

    def write(self, path: str | Path) -> None:
        """Atomically (embedder.files.atomic_target): a reader sees the old manifest or this one."""
        with atomic_target(path) as tmp, open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")


_FIELDS = frozenset(f.name for f in fields(Manifest)) - {"extra"}


def _problem(d: dict, m: Manifest | None) -> str:
    """What is wrong with the shape of ``d`` (as read back into ``m``), or ""."""
    if d.get("format") != FORMAT:
        return f"format {d.get('format')!r}"
    if m is None:
        return f"missing {', '.join(k for k in ('model', 'dim', 'count') if k not in d)}"
    if not isinstance(m.model, dict) or not isinstance(m.model.get("hash"), str):
        return "key 'model.hash' is not a string"
    for name in ("dim", "count"):
        v = getattr(m, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            return f"key {name!r}: {_short(v)} is not a count"
    for name, keys in (("index_file", ()), ("shard", ("i", "n")), ("sharded", ("shards", "trained", "held")),
                       ("neighbours", ("method", "k", "alpha", "depth", "sha256"))):
        v = getattr(m, name)
        if v is not None and not (isinstance(v, dict) and all(k in v for k in keys)):
            return f"key {name!r} is not an object with {'/'.join(keys) or 'fields'}"
    return _wrong_type(m) or _wrong_nested(m)


_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "dict": (dict,), "list": (list,)}


def _wrong_type(m: Manifest) -> str:
    """The first field whose value is not of its annotated type (``"nprobe": "abc"`` would
    otherwise reach ``int()`` in a searcher and fail there, naming neither file nor key)."""
    for f in fields(m):
        if f.name == "extra":
            continue
        v = getattr(m, f.name)
        kinds = [k.strip() for k in str(f.type).split("|")]
        if v is None and "None" in kinds:
            continue
        ok = tuple(t for k in kinds for t in _TYPES.get(k, ()))
        if ok and (not isinstance(v, ok) or isinstance(v, bool)):
            want = " or ".join(k for k in kinds if k != "None")
            return f"key {f.name!r}: {_short(v)} is not {'an' if want[0] in 'aeiou' else 'a'} {want}"
    return ""


def _wrong_nested(m: Manifest) -> str:
    """The nested records readers index into: the shard folders and faiss file records."""
    if m.index_file is not None and not _is_record(m.index_file):
        return f"key 'index_file': {_short(m.index_file)} is not a {{bytes, sha256}} record"
    if m.shard is not None and not all(_is_int(m.shard.get(k)) for k in ("i", "n")):
        return f"key 'shard': {_short(m.shard)} is not {{i, n}} counts"
    if m.sharded is not None:
        sh = m.sharded
        if not (isinstance(sh["shards"], list) and all(isinstance(p, str) for p in sh["shards"])):
            return f"key 'sharded.shards': {_short(sh['shards'])} is not a list of folders"
        for k in ("trained", "held"):
            if not isinstance(sh[k], str):
                return f"key 'sharded.{k}': {_short(sh[k])} is not a file name"
        files = sh.get("files", {})
        if not isinstance(files, dict) or not all(isinstance(k, str) and _is_record(v) for k, v in files.items()):
            return f"key 'sharded.files': {_short(files)} is not file -> {{bytes, sha256}} records"
    if m.search_params and not all("=" in p for p in m.search_params.split(",")):
        return f"key 'search_params': {m.search_params[:40]!r} is not name=value[,name=value]"
    return ""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_record(v: object) -> bool:
    return isinstance(v, dict) and (not v or (_is_int(v.get("bytes")) and isinstance(v.get("sha256"), str)))


def _short(v: object) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."
