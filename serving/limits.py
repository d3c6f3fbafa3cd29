"""The server's front door: refuse what must be refused before a request body is read.

One pure ASGI middleware (not BaseHTTPMiddleware, so Gradio's streaming routes pass untouched):

* ``/api/*`` with ``--auth``: HTTP basic credentials are checked from the headers, before the
  route (and FastAPI's form parsing) sees the request, so a stranger's 60 MB body is never read.
* Every request: a Content-Length above the cap is answered 413 unread; a body without one
  (chunked) is counted while the app reads it and answered 413 the moment it passes the cap, so
  nothing is spooled to disk beyond the cap. Gradio's own upload route applies the same limit
  (its ``max_file_size``); this cap also bounds its JSON routes.
* ``/api/*``: an unexpected error becomes a JSON 500 without a trace.
"""
from __future__ import annotations

import base64
import binascii
import logging
import secrets
from typing import Any

from fastapi.responses import JSONResponse

from .uploads import too_large

log = logging.getLogger(__name__)

AUTH_HEADERS = {"WWW-Authenticate": 'Basic realm="das-retrieval"'}
AUTH_MESSAGE = "authentication required (HTTP basic auth, the --auth user and password)"


class BodyTooLarge(Exception):
    """Raised into the app from ``receive`` once the body passes the cap."""


def basic_auth_ok(headers: dict[bytes, bytes], auth: tuple[str, str]) -> bool:
    value = headers.get(b"authorization", b"")
    scheme, _, token = value.partition(b" ")
    if scheme.lower() != b"basic":
        return False
    try:
        user, sep, pw = base64.b64decode(token.strip(), validate=True).partition(b":")
    except (binascii.Error, ValueError):
        return False
    # compare both parts always (no early exit on the user name)
    ok_user = secrets.compare_digest(user, auth[0].encode())
    ok_pw = secrets.compare_digest(pw, auth[1].encode())
    return bool(sep) and ok_user and ok_pw


class RequestGuard:
    """See the module docstring. ``max_bytes``: the body cap; ``limit``: the upload limit the
    413 message names (the cap adds room for multipart headers)."""

    def __init__(self, app: Any, *, max_bytes: int, limit: int, auth: tuple[str, str] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.limit = limit
        self.auth = auth

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        api = scope["path"].startswith("/api/") or scope["path"] == "/api"
        headers = dict(scope.get("headers") or [])
        if api and self.auth is not None and not basic_auth_ok(headers, self.auth):
            await JSONResponse({"error": AUTH_MESSAGE}, status_code=401, headers=AUTH_HEADERS)(scope, receive, send)
            return
        length = headers.get(b"content-length", b"").decode("latin-1").strip()
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send, int(length))
            return

        seen = 0
        exceeded = False
        started = False

        async def _receive() -> dict:
            nonlocal seen, exceeded
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    exceeded = True
                    raise BodyTooLarge()
            return message

        async def _send(message: dict) -> None:
            nonlocal started
            if exceeded:            # the app's own answer to the cut body is replaced by the 413
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, _receive, _send)
        except BodyTooLarge:
            pass
        except Exception:
            if not api:
                raise
            log.exception("unhandled error on %s", scope["path"])
            if not started:
                await JSONResponse({"error": "internal server error"}, status_code=500)(scope, receive, send)
            return
        if exceeded and not started:
            await self._refuse(scope, receive, send, None)

    async def _refuse(self, scope: dict, receive: Any, send: Any, size: int | None) -> None:
        # "Connection: close": the rest of the body is never read, so the connection cannot be reused
        resp = JSONResponse({"error": too_large(size, self.limit)}, status_code=413,
                            headers={"Connection": "close"})
        await resp(scope, receive, send)
