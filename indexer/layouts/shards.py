"""A sharded index (``build --ray --sharded``, ``merge --sharded``): the shards stay where they
were built, one manifest lists them, and they are searched as one::

    OUT/manifest.json   the index's manifest, plus "sharded": {"shards": [...], "trained", "held"}
    OUT/trained.faiss   the trained empty index: the coarse quantizer all parts share
    OUT/held.faiss      the held-out tuning/check vectors (a small part of their own)
    SHARD/store.lmdb    each shard's gallery store; SHARD/part.faiss, its vectors (``stream.fill``)

Shard paths are stored relative to OUT (they move together), absolute only when they share
nothing but the root (``serving.redact`` cuts those). Opened as one :class:`PartsIndex` (one
quantizer: results equal one merged index's) and a :class:`ShardedStore` (each id from its shard).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import faiss
import numpy as np

from ..ann import faiss_index as fx
from ..ann import stream
from ..directory.index_dir import PART_FILE, STORE_DIR
from ..directory.manifest import Manifest
from ..directory.shard_files import shard_paths
from ..directory.validate import damaged, faiss_reason
from ..searchable import Answer, Searchable
from ..store.gallery import GalleryStore


# ---------------------------------------------------------------------------- reading
class ShardedStore:
    """The read side of ``GalleryStore`` over several shard stores: an id is read from the first
    shard that holds it (content in two shards is indexed once, by the first: ``stream.union``)."""

    def __init__(self, dirs: Sequence[Path]) -> None:
        self.stores = [GalleryStore(d / STORE_DIR) for d in dirs]
        self.path = dirs[0] / STORE_DIR if dirs else None

    def _owner(self, id: int) -> GalleryStore:
        for s in self.stores:
            if id in s:
                return s
        raise KeyError(f"id {id} is not in any shard store ({len(self.stores)} shards)")

    def __len__(self) -> int:
        return sum(len(s) for s in self.stores)

    def __contains__(self, id: object) -> bool:
        return any(id in s for s in self.stores)

    def ids(self) -> np.ndarray:
        """All ids, ascending (one held by two shards once)."""
        return np.unique(np.concatenate([s.ids() for s in self.stores] + [np.zeros(0, np.int64)]))

    def get_meta(self, id: int) -> dict:
        return self._owner(int(id)).get_meta(int(id))

    def get_metas(self, ids: Sequence[int]) -> dict[int, dict]:
        out: dict[int, dict] = {}
        for s in self.stores:                   # the first shard holding an id, as `_owner`
            left = [int(i) for i in ids if int(i) not in out]
            if not left:
                break
            out.update(s.get_metas(left))
        return out

    def get_bytes(self, id: int) -> bytes:
        return self._owner(int(id)).get_bytes(int(id))

    def get_embeddings(self, model_hash: str, ids: Sequence[int]) -> np.ndarray:
        rows = [self._owner(int(i)).get_embeddings(model_hash, [int(i)])[0] for i in ids]
        return np.stack(rows) if rows else np.zeros((0, 0), dtype=np.float32)

    def id_for_path(self, rel_path: str) -> int | None:
        for s in self.stores:
            i = s.id_for_path(rel_path)
            if i is not None:
                return i
        return None

    def labels(self) -> list[str]:
        return sorted({lab for s in self.stores for lab in s.labels()})

    def ids_for_label(self, label: str) -> list[int]:
        seen: dict[int, None] = {}
        for s in self.stores:
            seen.update(dict.fromkeys(s.ids_for_label(label)))
        return list(seen)

    def models(self) -> list[str]:
        return sorted({m for s in self.stores for m in s.models()})

    def iter_embeddings(self, model_hash: str, size: int = 65_536, *, vectors: bool = True
                        ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``GalleryStore.iter_embeddings`` of each shard store in turn (ascending within a
        shard); an id two shards hold comes once, from the first (as ``_owner`` reads it)."""
        seen: set[int] = set()
        for s in self.stores:
            for ids, x in s.iter_embeddings(model_hash, size, vectors=vectors):
                new = np.fromiter((i not in seen for i in ids.tolist()), dtype=bool, count=len(ids))
                seen.update(ids.tolist())
                if new.any():
                    yield ids[new], x[new]

    def probe(self) -> None:
        for s in self.stores:
            s.probe()

    def close(self) -> None:
        for s in self.stores:
            s.close()


class PartsIndex(Searchable):
    """The parts searched as one in this process (memory-mapped, the whole index)."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        sh = manifest.sharded
        try:
            self.trained = faiss.read_index(str(directory / sh.trained))
            files = [p / PART_FILE for p in shard_paths(directory, manifest)] + [directory / sh.held]
            self.cpu_index = stream.open_parts(files, self.trained)
        except RuntimeError as e:
            raise damaged(directory, f"faiss cannot read a part ({faiss_reason(e)})") from None
        fx.set_search_params(self.cpu_index, manifest.search_params or "")
        self.d, self.ntotal = self.cpu_index.d, int(self.cpu_index.ntotal)

    def search(self, q: np.ndarray, k: int, widen: float = 1.0) -> Answer:
        q = np.ascontiguousarray(q, dtype=np.float32)
        return Answer(*fx.search_wider(self.cpu_index, q, max(1, min(int(k), max(1, self.ntotal))), widen))
