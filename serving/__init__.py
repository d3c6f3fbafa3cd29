"""Search service over one or more indexes, test-time DFS/MTS probes, HTTP API and web app.

Public names: :class:`Searcher` and the :mod:`serving.probes` module. The web pieces
(``serving.server.create_app``, ``serving.ui.build_ui``, ``serving.api``) are imported on
demand so that library users of Searcher do not pay for Gradio.
"""
from __future__ import annotations

from . import probes
from .demo import ensure_demo_index
from .searcher import ProbeReport, Query, RequestError, Result, Searcher, SearchResult, Snapshot, UnknownIdError

__all__ = ["Searcher", "Snapshot", "probes", "Query", "Result", "SearchResult", "ProbeReport", "UnknownIdError",
           "RequestError", "ensure_demo_index",
           "server", "uploads", "tempdir"]   # modules, imported on demand (`from serving import server`)
