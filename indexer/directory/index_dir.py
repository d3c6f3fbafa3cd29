"""An index directory: the one owner of its file names, its manifest and its open-or-refuse checks.
It holds ``store.lmdb/``, ``index.faiss``, ``manifest.json``, ``report.jsonl`` and ``model.onnx``
(self-contained), each written through :func:`embedder.files.atomic_target`, the manifest last;
the checks live in :mod:`indexer.directory.validate`, this module decides which apply.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import time
from itertools import islice
from pathlib import Path
from typing import Any

from embedder.files import atomic_target
from embedder.hashing import file_sha256

from ..errors import IndexerError
from .manifest import FORMAT, FileRecord, Manifest
from .validate import check_faiss_file, check_lmdb, check_model_file, rebuild_hint

# every file name of both layouts (indexer.layouts.layout), here and nowhere else
MANIFEST = "manifest.json"
INDEX_FILE = "index.faiss"          # a single index's faiss index
STORE_DIR = "store.lmdb"            # a gallery store: a single index's, a shard's
REPORT = "report.jsonl"
MODEL_FILE = "model.onnx"
PART_FILE = "part.faiss"            # in a shard folder: its part of a sharded index
OWNER_FILE = "part.owner"           # in a shard folder: the sharded index whose part.faiss it is
TRAINED_FILE = "trained.faiss"      # a sharded index: the trained empty index its parts share
HELD_FILE = "held.faiss"            # a sharded index: the held-out tuning/check vectors
SHARDS_DIR = "shards"               # ``build --ray``: the shard folders under --out
PLAN_FILE = "plan.json"             # ``build --ray``: shard count, gallery and model of SHARDS_DIR
FILE_LIST = "files.jsonl"           # ``build --ray``: a shard's share of the driver's one walk
RUN_FILE = "ray.json"               # ``build --ray``: OUT/shards/ray.json, the last build's facts (nodes, attempts)


def manifest_stamp(directory: str | Path) -> tuple[int, int, int] | None:
    """(inode, mtime_ns, size) of manifest.json: it changes whenever the manifest is rewritten
    (always atomically, by os.replace: a new inode), which is what a server watches for."""
    try:
        st = os.stat(Path(directory) / MANIFEST)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class IndexDir:
    """The files of one index directory (nothing is opened or created by constructing one)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.manifest_file = self.path / MANIFEST
        self.index_file = self.path / INDEX_FILE
        self.store_dir = self.path / STORE_DIR
        self.report_file = self.path / REPORT
        self.model_file = self.path / MODEL_FILE

    def __repr__(self) -> str:
        return f"IndexDir({str(self.path)!r})"

    def exists(self) -> bool:
        """Whether a manifest is there (the cheap "is this an index directory" test)."""
        return self.manifest_file.is_file()

    def require(self) -> "IndexDir":
        """The one refusal of a path that is no index directory (the indexer's commands, the
        searcher and app.py all say it in these words). Returns ``self``."""
        if not self.exists():
            if self.store_dir.is_dir():       # a first build stopped before its manifest
                raise IndexerError(f"{self.path}: a first build stopped before it finished (images stored, no "
                                   f"{MANIFEST} yet): run the same `python -m indexer build GALLERY --out "
                                   f"{self.path}` again; it resumes")
            if self._holds_images():          # a gallery given where its index belongs
                out = shlex.quote(f"indexes/{self.path.name or 'photos'}")
                raise IndexerError(f"{self.path}: a folder of images, not an index directory: index it first "
                                   f"with `python -m indexer build {shlex.quote(str(self.path))} --out {out}`, "
                                   f"and give {out} as the index")
            raise IndexerError(f"{self.path}: not an index directory (no index here: missing "
                               f"{MANIFEST}); build one with `python -m indexer build`")
        return self

    def _holds_images(self, look: int = 200) -> bool:
        """Whether the first ``look`` entries of this folder and of its sub-folders name an image."""
        from embedder.images import is_listed

        try:
            seen = 0
            for top in self.path.iterdir():
                for p in ([top] if not top.is_dir() else islice(top.iterdir(), look)):
                    if is_listed(p.name) and p.is_file():
                        return True
                seen += 1
                if seen >= look:
                    break
        except OSError:
            return False
        return False

    # -- the manifest (its schema: indexer.directory.manifest.Manifest) --------------------------------
    def read_manifest(self) -> Manifest:
        return Manifest.read(self.require().manifest_file)

    def write_manifest(self, manifest: Manifest | dict) -> Manifest:
        """Write (last, atomically) and return the manifest as a reader will see it. A dict is
        checked against the schema first: a key that is not a ``Manifest`` field is refused."""
        if isinstance(manifest, dict):
            manifest = Manifest.from_dict({**manifest, "format": FORMAT}, where=self.manifest_file)
        manifest.write(self.manifest_file)
        return Manifest.from_dict(json.loads(json.dumps(manifest.to_dict())), where=self.manifest_file,
                                  strict=False)         # as a reader sees it, without reading it back

    # -- the other files ------------------------------------------------------------------
    def write_report(self, skipped: list[dict]) -> Path:
        """One JSON object per skipped file: {"path": ..., "reason": ...}."""
        with atomic_target(self.report_file) as tmp, open(tmp, "w") as f:
            for s in skipped:
                f.write(json.dumps(s) + "\n")
        return self.report_file

    def read_report(self) -> list[dict]:
        if not self.report_file.exists():
            return []
        return [json.loads(line) for line in self.report_file.read_text().splitlines() if line.strip()]

    def copy_model(self, src: str | Path, model_hash: str) -> None:
        """Copy the embedder in as ``model.onnx``, unless the one there already has ``model_hash``."""
        if self.model_file.exists() and file_sha256(self.model_file) == model_hash:
            return
        with atomic_target(self.model_file) as tmp:
            shutil.copyfile(src, tmp)

    def index_record(self) -> FileRecord:
        """The manifest's record of ``index.faiss`` (size and sha256), taken right after writing it
        (``faiss_index.write_atomic``) and compared on every open."""
        return FileRecord(bytes=self.index_file.stat().st_size, sha256=file_sha256(self.index_file))

    # -- open or refuse -------------------------------------------------------------------
    def check(self, manifest: Manifest, *, model: bool = False, verify_hash: bool = True) -> None:
        """All file checks (:mod:`indexer.directory.validate`) before anything maps or parses a file."""
        check_lmdb(self.store_dir)
        if not manifest.is_shard:
            check_faiss_file(self.index_file, manifest.index_file or FileRecord(), verify_hash=verify_hash,
                             fix=rebuild_hint(manifest.gallery, self.path))
        if model:
            check_model_file(self.model_file, manifest.model.hash)

    def refuse_shard(self, manifest: Manifest) -> None:
        """A shard holds a store but no index: it is merged, never searched or updated."""
        if manifest.is_shard:
            s = manifest.shard
            raise IndexerError(f"{self.path}: is shard {s.i}/{s.n}, not an index; "
                               "run `indexer merge` first")

    def check_index_dim(self, d: int, manifest: Manifest) -> None:
        if d != manifest.dim:
            raise IndexerError(f"{self.index_file}: dimension mismatch: index holds {d}-d vectors, "
                               f"manifest says {manifest.dim}-d")

    def check_embedder(self, emb: Any, manifest: Manifest, path: str | Path | None = None) -> None:
        """``emb`` is the model the index was built with and gives its dimension."""
        path = path or self.model_file
        want = manifest.model_hash
        if emb.model_hash != want:
            raise IndexerError(f"{path}: model {emb.model_hash[:12]} differs from the model this index "
                               f"was built with ({want[:12]}, {manifest.model.source}); "
                               "use that model or rebuild with `indexer build`")
        if emb.dim != manifest.dim:
            raise IndexerError(f"{path}: dimension mismatch: model gives {emb.dim}-d embeddings, "
                               f"index holds {manifest.dim}-d")
