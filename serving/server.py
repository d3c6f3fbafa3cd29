"""One ASGI app: the JSON API at /api/* (registered first: a mount at "/" takes every path left)
and the Gradio UI at "/"; --auth protects both. Gradio checks that a client's FileData
``{"path": ...}`` is its own upload only once the Blocks "has launched", which
``gr.mount_gradio_app`` does not set (any server path was copied): we set it after mounting.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

# Gradio phones home for analytics unless told not to; servers here have no internet.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
from embedder.decode_budget import pin_mmap_threshold  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from starlette.routing import Mount  # noqa: E402

from .api import add_api_routes  # noqa: E402
from .searcher import Searcher  # noqa: E402
from .session import GradioSessions  # noqa: E402
from .ui import build_ui  # noqa: E402
from .uploads import DEFAULT_MAX_UPLOAD_BYTES  # noqa: E402


def create_app(searcher: Searcher, *, auth: tuple[str, str] | None = None,
               max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
               query_sets: Mapping[str, Path] | None = None, upload_max_age: int = 900,
               login_block: float = 1.0) -> FastAPI:
    """``upload_max_age``: seconds after which Gradio deletes an upload or a cached result."""
    pin_mmap_threshold()            # a long-running process: large decodes give their memory back
    app = FastAPI(title="das-retrieval", docs_url=None, redoc_url=None, openapi_url=None)
    sessions = GradioSessions()
    add_api_routes(app, searcher, auth=auth, max_upload_bytes=max_upload_bytes, sessions=sessions,
                   login_block=login_block)
    blocks = build_ui(searcher, query_sets=query_sets, max_upload_bytes=max_upload_bytes)
    blocks.queue(default_concurrency_limit=4)
    # read by mount_gradio_app: replaces build_ui's default (an hour), so an upload lives minutes
    blocks.delete_cache = (max(1, min(60, upload_max_age // 2)), upload_max_age)
    app = gr.mount_gradio_app(app, blocks, path="/", auth=auth, max_file_size=max_upload_bytes,
                              show_error=True, footer_links=["api"],
                              app_kwargs={"openapi_url": None, "docs_url": None, "redoc_url": None})
    blocks.has_launched = True      # Gradio's upload-folder check on file inputs (see above)
    # the guard asks Gradio's app who is logged in (to strip the login page of the api info)
    sessions.app = next(r.app for r in app.routes if isinstance(r, Mount) and hasattr(r.app, "tokens"))
    return app
