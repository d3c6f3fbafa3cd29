"""``manifest.json``: the one schema of what an index directory records about itself. Every
writer makes a :class:`Manifest` and every reader goes through :meth:`Manifest.read`, so an
unknown key cannot be written and a wrongly shaped manifest is refused in one line (each nested
:class:`Record`'s annotations are the check). Unrecorded fields (None) stay out of the JSON; newer
keys and explicit nulls are kept (``extra``), so a manifest reads and writes back unchanged.
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from types import UnionType
from typing import Any, get_args, get_origin, get_type_hints

from embedder.files import atomic_target

from ..errors import IndexerError

FORMAT = "das-index/1"
DEFAULT_TARGET_RECALL = 0.95    # recall@10 vs exact search that the search parameter is tuned to


@dataclass(kw_only=True)
class Record:
    """A JSON object with typed keys: unknown keys and explicit nulls are kept in ``extra``."""

    extra: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, d: Any, key: str = "") -> "Record":
        """``d`` (a JSON object) checked against the annotations and converted, nested records too."""
        hints = _hints(cls)
        need = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        if not isinstance(d, dict) or any(d.get(k) is None for k in need):
            raise IndexerError(f"key {_q(key)}: {_short(d)} is not an object with "
                         + (", ".join(f"{key}.{k}" for k in need) or "fields"))
        known = {k: _load(hints[k], v, f"{key}.{k}".lstrip(".")) for k, v in d.items() if k in hints and v is not None}
        return cls(**known, extra={k: v for k, v in d.items() if k not in known})

    def to_dict(self) -> dict:
        """The JSON object, without the fields not recorded."""
        out = {f.name: _dump(getattr(self, f.name)) for f in fields(self)
               if f.name != "extra" and getattr(self, f.name) is not None}
        return {**self.extra, **out}


@dataclass(kw_only=True)
class ModelRecord(Record):               # model_info(): the embedder the index was built with
    hash: str
    file: str | None = None                 # its copy in the directory
    source: str | None = None
    dim: int | None = None
    normalized: bool | None = None
    backbone: str | None = None
    metadata: dict | None = None            # the ONNX file's metadata (the embedder's own keys)


@dataclass(kw_only=True)
class FileRecord(Record):                # a file's size and sha256, compared on open; {} before checksums
    bytes: int | None = None
    sha256: str | None = None

    def __bool__(self) -> bool:
        return self.bytes is not None or self.sha256 is not None


@dataclass(kw_only=True)
class ShardRecord(Record):               # indexer build --shard i/n
    i: int
    n: int


@dataclass(kw_only=True)
class ShardedRecord(Record):             # a sharded index: its shard folders, trained/held files, file records
    shards: list[str]
    trained: str
    held: str
    files: dict[str, FileRecord] | None = None


@dataclass(kw_only=True)
class NeighboursRecord(FileRecord):      # DBA re-ranking (indexer.ann.neighbours), neighbours.npz's record
    method: str
    k: int
    alpha: float
    depth: int
    file: str | None = None


@dataclass(kw_only=True)
class DbaCheckRecord(Record):            # what the build's DBA check measured (indexer.cli.defaults)
    selected_for: str                       # on the index chosen for this (Manifest.selected_for)
    labels: str                             # with these labels (indexer.layouts.evaluate.labels_digest)
    k: int                                  # and these DBA parameters
    alpha: float
    depth: int
    queries: int
    dba: float                              # leave-one-out R@1 with DBA, and without
    plain: float
    z: float
    at: str


@dataclass(kw_only=True)
class IngestRecord(Record):              # IngestStats, skipped as a count (a merged index: only that)
    skipped: int
    found: int | None = None
    new: int | None = None
    unchanged: int | None = None
    duplicates: int | None = None
    embedded: int | None = None
    absent: int | None = None            # stored paths the build's walk did not find, kept
    moved: int | None = None             # ... whose image it found under another path, dropped
    pruned: int | None = None            # ... dropped (build --prune)


@dataclass(kw_only=True)
class Candidate(Record):                 # a row of the selection's table (indexer.ann.selection.select)
    index_type: str
    factory: str
    sample_factory: str | None = None
    search_params: str | None = None
    recall_at_10: float | None = None
    qps: float | None = None
    rank_qps: float | None = None
    memory_bytes: int | None = None
    build_seconds: float | None = None
    meets_target: bool | None = None
    fits_memory: bool | None = None
    chosen: bool | None = None


@dataclass(kw_only=True)
class Manifest(Record, Mapping):
    """The keys of ``manifest.json`` (None: not recorded), read as attributes; the read-only
    mapping view (``m["count"]``) is for benchmarks and tests; :meth:`to_dict` is the JSON."""

    model: ModelRecord
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
    candidates: list[Candidate] | None = None
    selection_seconds: float | None = None
    warning: str | None = None
    index_file: FileRecord | None = None    # index.faiss, compared on open
    gallery: str | None = None
    ingest: IngestRecord | None = None
    report: str | None = None               # report.jsonl: the skipped files and why
    shard: ShardRecord | None = None        # a shard, merged before it is searched
    merged_from: list | None = None
    shards: list[list[int]] | None = None   # [[i, n], ...]: the shards it was built from
    sharded: ShardedRecord | None = None
    stage_seconds: dict[str, float] | None = None
    neighbours: NeighboursRecord | None = None
    #: a rebuild that keeps the index and the labels keeps the check's verdict (z < -2: no DBA pass)
    dba_check: DbaCheckRecord | None = None
    build_seconds: float | None = None
    #: sha256 of what the index type was chosen for (model, build options, sorted ids): a rebuild
    #: that would choose for the same keeps index.faiss (indexer.build.single.kept_index)
    selected_for: str | None = None
    selected_at: str | None = None          # when it was chosen (a kept index: before built_at)
    built_at: str | None = None
    updated_at: str | None = None
    format: str = FORMAT

    def __post_init__(self) -> None:
        """A dict given for a record (a writer's) is converted; every value checked on the way."""
        for name, hint in _hints(type(self)).items():
            v = getattr(self, name)
            if name != "extra" and v is not None:
                object.__setattr__(self, name, _load(hint, v, name))
        for name in ("dim", "count"):
            if getattr(self, name) < 0:
                raise IndexerError(f"key {name!r}: {getattr(self, name)} is not a count")
        if self.search_params and not all("=" in p for p in self.search_params.split(",")):
            raise IndexerError(f"key 'search_params': {self.search_params[:40]!r} is not name=value[,name=value]")

    # -- dict <-> Manifest -----------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, *, where: str | Path = "manifest", strict: bool = True) -> "Manifest":
        """Check ``d`` against the schema. ``strict`` (a writer): a key that is no field is a bug
        here and is refused; otherwise (a reader) it is kept in ``extra``."""
        if not isinstance(d, dict):
            raise IndexerError(f"{where}: not a {FORMAT} manifest (a JSON object was expected)")
        unknown = sorted(k for k in d if k not in _hints(cls) or k == "extra")
        if strict and unknown:
            raise IndexerError(f"{where}: manifest key(s) {unknown} are not fields of "
                               "indexer.directory.manifest.Manifest")
        try:
            if d.get("format") != FORMAT:
                raise IndexerError(f"format {d.get('format')!r}")
            if any(d.get(k) is None for k in ("model", "dim", "count")):
                raise IndexerError(f"missing {', '.join(k for k in ('model', 'dim', 'count') if d.get(k) is None)}")
            return cls.of(d)        # type: ignore[return-value]
        except IndexerError as e:   # the key named; the file added here
            raise IndexerError(f"{where}: not a {FORMAT} manifest ({e})") from None

    def to_dict(self) -> dict:
        """The JSON object, without the fields not recorded (``index_type`` always written)."""
        return {**super().to_dict(), "index_type": self.index_type}

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
        return self.model.hash

    def replace(self, **changes: Any) -> "Manifest":
        """A copy with ``changes`` (field names; a name that is no field is a TypeError)."""
        return replace(self, **changes)

    def recall_text(self) -> str:
        """``indexer info``'s recall line: on what queries the recall was measured (after
        ``add``/``remove``, the retuning's self-queries: no held-out set remains)."""
        if self.heldout_queries:
            on = (f"{self.heldout_queries} held-out queries (tuned on {self.tuning_queries}: "
                  f"{self.tuning_recall_at_10})")
        else:
            on = f"{self.tuning_queries or 0} self-queries (retuned after add/remove)"
        return f"@10 vs exact {self.recall_at_10} on {on}, target {self.target_recall}"

    # -- the read-only mapping view (the JSON object's keys and values) ----------------------
    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

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


@cache
def _hints(cls: type) -> dict[str, Any]:
    return {k: v for k, v in get_type_hints(cls).items() if k != "extra"}


def _load(hint: Any, v: Any, key: str) -> Any:
    """``v`` checked against the annotation ``hint`` (``key``: its name in the messages) and
    converted (a record's object into the record): the types themselves are the schema."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is UnionType:                          # every union here is X | None
        return None if v is None else _load(next(a for a in args if a is not type(None)), v, key)
    if isinstance(hint, type) and issubclass(hint, Record):
        return v if isinstance(v, hint) else hint.of(v, key)
    want = origin or hint
    if not isinstance(v, (int, float) if want is float else want) or (isinstance(v, bool) and want is not bool):
        name = getattr(want, "__name__", str(want))
        raise IndexerError(f"key {_q(key)}: {_short(v)} is not {'an' if name[0] in 'aeiou' else 'a'} {name}")
    if origin is list:
        return [_load(args[0], x, f"{key}[{i}]") for i, x in enumerate(v)]
    if origin is dict:
        return {k: _load(args[1], x, f"{key}.{k}") for k, x in v.items()}
    return v


def _dump(v: Any) -> Any:
    if isinstance(v, Record):
        return v.to_dict()
    if isinstance(v, list):
        return [_dump(x) for x in v]
    return {k: _dump(x) for k, x in v.items()} if isinstance(v, dict) else v


def _q(key: str) -> str:
    """``index_file.bytes`` as ``'index_file'.bytes``: the manifest's key quoted."""
    head, dot, rest = key.partition(".")
    return repr(head) + dot + rest


def _short(v: object) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."
