"""Plain HTTP JSON API for programs that do not use gradio_client.

    POST /api/search            multipart: image=<file> (or id=<gallery id>, or path=<gallery-relative
                                path>, looked up in LMDB), k=10, index=<name>
    GET  /api/thumb/{index}/{id}  PNG thumbnail rendered from LMDB bytes
    GET  /api/indexes           what each open index's manifest says
    GET  /api/health            liveness

Errors are JSON ``{"error": message}`` with 400 (bad value), 401 (auth), 404 (unknown index or
id), 413 (upload too large) or 415 (not an image); no response ever carries a stack trace.
Nothing here reads a path the client sends: thumbnails come from the LMDB store by id.
"""
from __future__ import annotations

import logging
import secrets
from typing import Any

from fastapi import Depends, FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBasic, HTTPBasicCredentials

from .searcher import Searcher, UnknownIdError
from .uploads import DEFAULT_MAX_UPLOAD_BYTES, UploadError, decode_upload, human_bytes

log = logging.getLogger(__name__)

# Multipart overhead allowed on top of the image itself before the body is refused unread.
_FORM_OVERHEAD = 64 * 1024


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class _ApiGuard:
    """Pure ASGI middleware for /api/*: refuses an oversized body from its Content-Length before
    reading it (413), and turns any unexpected error into a JSON 500 without a trace. Pure ASGI
    rather than BaseHTTPMiddleware so Gradio's streaming routes pass through untouched."""

    def __init__(self, app: Any, max_bytes: int, limit: int):
        self.app = app
        self.max_bytes = max_bytes
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/api/"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length", b"").decode("latin-1")
        if scope["method"] == "POST" and length.isdigit() and int(length) > self.max_bytes:
            resp = JSONResponse({"error": f"upload is {human_bytes(int(length))}, larger than the "
                                          f"limit of {human_bytes(self.limit)}"}, status_code=413)
            await resp(scope, receive, send)
            return
        started = False

        async def _send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, _send)
        except Exception:
            log.exception("unhandled error on %s", scope["path"])
            if not started:
                await JSONResponse({"error": "internal server error"}, status_code=500)(scope, receive, send)


def _basic_auth(auth: tuple[str, str] | None):
    """A dependency enforcing HTTP basic auth when the server was started with --auth."""
    security = HTTPBasic(auto_error=False)

    def check(creds: HTTPBasicCredentials | None = Depends(security)) -> None:
        if auth is None:
            return
        ok = creds is not None and secrets.compare_digest(creds.username.encode(), auth[0].encode()) \
            and secrets.compare_digest(creds.password.encode(), auth[1].encode())
        if not ok:
            raise ApiError(401, "authentication required (HTTP basic auth, the --auth user and password)")

    return check


def _parse_k(k: str) -> int:
    try:
        v = int(k)
    except (TypeError, ValueError):
        raise ApiError(400, f"k: expected an integer between 1 and 1000, got {k!r}") from None
    if not 1 <= v <= 1000:
        raise ApiError(400, f"k: expected an integer between 1 and 1000, got {v}")
    return v


def add_api_routes(app: FastAPI, searcher: Searcher, *, auth: tuple[str, str] | None = None,
                   max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES) -> FastAPI:
    """Register /api/* on ``app`` (call before mounting Gradio at "/", which catches the rest)."""
    guard = [Depends(_basic_auth(auth))]

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": 'Basic realm="das-retrieval"'} if exc.status == 401 else None
        return JSONResponse({"error": exc.message}, status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'request'}: {e.get('msg')}"
                             for e in exc.errors())
        return JSONResponse({"error": problems or "invalid request"}, status_code=400)

    app.add_middleware(_ApiGuard, max_bytes=max_upload_bytes + _FORM_OVERHEAD, limit=max_upload_bytes)

    @app.get("/api/health", dependencies=guard)
    def health() -> dict[str, Any]:
        return {"status": "ok", "indexes": searcher.names}

    @app.get("/api/indexes", dependencies=guard)
    def indexes() -> list[dict[str, Any]]:
        return [searcher.describe(n) for n in searcher.names]

    @app.post("/api/search", dependencies=guard)
    def search(request: Request, image: UploadFile | None = File(None), k: str = Form("10"),
               index: str | None = Form(None), id: str | None = Form(None),
               path: str | None = Form(None)) -> dict[str, Any]:
        kk = _parse_k(k)
        name = index or searcher.default
        if name not in searcher.indexes:
            raise ApiError(404, f"unknown index {name!r}; open indexes: {', '.join(searcher.names)}")
        try:
            if image is not None:
                data = image.file.read(max_upload_bytes + 1)
                query = searcher.query_from_image(
                    decode_upload(data, image.filename or "image", max_bytes=max_upload_bytes),
                    name=image.filename or "upload")
            elif id is not None:
                try:
                    gid = int(id)
                except ValueError:
                    raise ApiError(400, f"id: expected an integer gallery id, got {id!r}") from None
                query = searcher.query_from_id(gid, name)
            elif path is not None:      # a gallery-relative path, looked up in LMDB, never opened
                query = searcher.query_from_path(path, name)
            else:
                raise ApiError(400, "expected a multipart file field 'image' (or a form field 'id' or 'path' "
                                    "naming a gallery image)")
            res = searcher.search(query, kk, index=name)
        except UploadError as e:
            raise ApiError(e.status, e.message) from None
        except UnknownIdError as e:
            raise ApiError(404, str(e)) from None
        base = str(request.base_url).rstrip("/")
        return {"index": name, "k": kk, "query": {"name": query.name, "id": query.id, "label": query.label},
                "results": [{**r.to_dict(), "thumbnail": f"{base}/api/thumb/{name}/{r.id}"}
                            for r in res.results]}

    @app.get("/api/thumb/{index}/{id}", dependencies=guard)
    def thumb(index: str, id: str) -> Response:
        if index not in searcher.indexes:
            raise ApiError(404, f"unknown index {index!r}; open indexes: {', '.join(searcher.names)}")
        try:
            gid = int(id)
            png = searcher.thumbnail_png(index, gid)
        except ValueError:
            raise ApiError(404, f"id {id!r} is not a gallery id (expected an integer)") from None
        except UnknownIdError as e:
            raise ApiError(404, str(e)) from None
        return Response(png, media_type="image/png", headers={"Cache-Control": "max-age=3600"})

    return app


def create_api(searcher: Searcher, **kw: Any) -> FastAPI:
    app = FastAPI(title="das-retrieval search API", docs_url=None, redoc_url=None, openapi_url=None)
    return add_api_routes(app, searcher, **kw)
