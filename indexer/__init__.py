"""The indexer: an LMDB gallery store plus a faiss index tuned to a recall target.

``python -m indexer --help`` for the command line; ``Index.open(dir).search(images, k)`` from
Python (what serving uses).
"""
from __future__ import annotations

from .build import add_images, build_index, merge_shards, remove_items
from .errors import IndexerError
from .index import Hit, Index
from .index_dir import IndexDir
from .store import GalleryStore

__all__ = ["Index", "Hit", "IndexDir", "GalleryStore", "build_index", "add_images", "remove_items",
           "merge_shards", "IndexerError"]
