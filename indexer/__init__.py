"""The indexer: an LMDB gallery store plus a faiss index tuned to a recall target.

``python -m indexer --help`` for the command line; ``Index.open(dir).search(images, k)`` from
Python (what serving uses).
"""
from __future__ import annotations

from .build import build_index, merge_shards
from .consistency import CountCheck, check_counts
from .errors import IndexerError
from .index import Hit, Index
from .index_dir import IndexDir
from .layouts import Layout, Sharded, Single, layout_of
from .lock import IndexBusyError, holder, is_locked, writer_lock
from .manifest import Manifest
from .options import BuildOptions
from .shard_build import build_sharded
from .store import GalleryStore, NewItem
from .update import Change, add_images, info, remove_items, repair_index

__all__ = ["Index", "Hit", "IndexDir", "GalleryStore", "build_index", "add_images", "remove_items",
           "merge_shards", "build_sharded", "repair_index", "info", "Change", "Manifest", "BuildOptions",
           "layout_of", "Layout", "Single", "Sharded", "IndexerError", "check_counts", "CountCheck", "NewItem",
           "writer_lock", "IndexBusyError", "holder", "is_locked",
           # modules of plain functions (faiss.contrib style), public as a whole
           "faiss_index", "selection", "tuning", "stream", "sources", "ondisk", "walk",
           "ray_build", "fanout", "rerank", "neighbours", "layouts", "update"]
