"""The indexer: an LMDB gallery store plus a faiss index tuned to a recall target.

``python -m indexer --help`` for the command line; ``Index.open(dir).search(images, k)`` from
Python (what serving uses).
"""
from __future__ import annotations

from .build import add_images, build_index, merge_shards, remove_items, repair_index
from .consistency import CountCheck, check_counts
from .errors import IndexerError
from .index import Hit, Index
from .index_dir import IndexDir
from .lock import IndexBusyError, holder, is_locked, writer_lock
from .store import GalleryStore, NewItem

__all__ = ["Index", "Hit", "IndexDir", "GalleryStore", "build_index", "add_images", "remove_items",
           "merge_shards", "repair_index", "IndexerError", "check_counts", "CountCheck", "NewItem",
           "writer_lock", "IndexBusyError", "holder", "is_locked",
           # modules of plain functions (faiss.contrib style), public as a whole
           "faiss_index", "selection", "tuning", "stream", "sources", "walk", "ray_build",
           "rerank", "neighbours"]
