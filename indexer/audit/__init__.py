"""Gallery audit from an index's own kNN graph (issue 42): near-duplicate groups, likely
mislabelled images (with the suggested label), outliers, confused class pairs.
``python -m indexer audit --help``; all it reads of ``indexer`` goes through :mod:`.source`.
"""
from __future__ import annotations

from .run import DEFAULT_K, KINDS, Audit, lists, print_summary, run_audit, summary, write_audit
from .served import served_audit
from .source import Gallery, open_gallery

__all__ = ["Audit", "run_audit", "write_audit", "lists", "summary", "print_summary", "Gallery",
           "open_gallery", "DEFAULT_K", "KINDS", "served_audit"]
