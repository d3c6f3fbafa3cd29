"""The indexer: an LMDB gallery store plus a faiss index tuned to a recall target.

``python -m indexer --help`` for the command line; ``Index.open(dir).search(images, k)`` from
Python (what serving uses).
"""
from __future__ import annotations

from .ann.new_photos import NOVEL_P, no_close_match, suggest_label
from .ann.options import BuildOptions
from .build.ray_build import build_with_ray
from .build.sharded import build_sharded
from .build.single import build_index, merge_shards
from .build.update import Change, add_images, info, remove_items, repair_index
from .directory.index_dir import IndexDir
from .directory.lock import IndexBusyError, holder, is_locked, writer_lock
from .directory.manifest import Manifest
from .errors import IndexerError
from .layouts.counts import CountCheck, check_counts
from .layouts.index import Hit, Index
from .layouts.layout import Layout, Sharded, Single, layout_of
from .ray.fanout import RayServing
from .store.gallery import GalleryStore, NewItem

__all__ = ["Index", "Hit", "IndexDir", "GalleryStore", "build_index", "add_images", "remove_items",
           "merge_shards", "build_sharded", "build_with_ray", "repair_index", "info", "Change", "Manifest",
           "BuildOptions", "layout_of", "Layout", "Single", "Sharded", "RayServing", "IndexerError",
           "check_counts", "CountCheck", "NewItem", "writer_lock", "IndexBusyError", "holder", "is_locked",
           "NOVEL_P", "no_close_match", "suggest_label"]
