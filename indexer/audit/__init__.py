"""Gallery audit from an index's own kNN graph (issue 42): near-duplicate groups, likely
mislabelled images with the label their neighbourhood suggests, outliers, confused class pairs.

``run_audit(dir)`` -> :class:`Audit`; ``write_audit(audit, out)`` writes JSONL/CSV, PNG contact
sheets and summary.json; ``python -m indexer audit --help``. What it reads of ``indexer``
goes through one seam, :mod:`indexer.audit.source`.
"""
from __future__ import annotations

from .run import DEFAULT_K, KINDS, Audit, lists, print_summary, run_audit, summary, write_audit
from .served import served_audit
from .source import Gallery, open_gallery

__all__ = ["Audit", "run_audit", "write_audit", "lists", "summary", "print_summary", "Gallery",
           "open_gallery", "DEFAULT_K", "KINDS", "served_audit"]
