"""Search service over one or more indexes, test-time DFS/MTS probes, HTTP API and web app.
Public: :class:`Searcher` and :mod:`serving.probes`; the web pieces are imported on demand, so
library users of Searcher do not pay for Gradio.
"""
from __future__ import annotations

from . import probes
from .demo import ensure_demo_index
from .searcher import ProbeReport, Query, RequestError, Result, Searcher, SearchResult, Snapshot, UnknownIdError

__all__ = ["Searcher", "Snapshot", "probes", "Query", "Result", "SearchResult", "ProbeReport", "UnknownIdError",
           "RequestError", "ensure_demo_index",
           "server", "uploads", "tempdir"]   # modules, imported on demand (`from serving import server`)
