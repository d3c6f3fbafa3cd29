"""Plain HTTP JSON API for programs that do not use gradio_client.

    POST /api/search            multipart: image=<file> (or id=<gallery id>, or path=<gallery path>),
                                k=10, index=<name>, dba=true|false (default: as built), box=x0,y0,x1,y1;
                                label=<class>, repeatable: only images of these labels answer;
                                copies=true: each result says whether it is the query's own picture;
                                image repeated (up to 16): one result list for the images fused;
                                any other field (or one in the query string but dba) is a 400
    GET  /api/thumb/{index}/{id}  PNG thumbnail from the LMDB store
    GET  /api/audit/{index}     near-duplicates, likely mislabelled, outliers, confused pairs
    GET  /api/labels/{index}    each label (what ``label`` takes) and its number of images
    GET  /api/indexes           what each open index's manifest says
    GET  /api/health            liveness (503 naming what is not served, e.g. a lost Ray shard)

Results with labels add ``"suggested": {"label": ..., "confidence": ...}`` (their vote,
``indexer.suggest_label``); an index built with DBA ``"novelty": {"p": ..., "unlike_gallery":
bool}``, the query's p-value of having no close match in the gallery (``indexer.ann.new_photos.
novelty``). An index served over Ray whose shard did not answer in time answers from the others
with ``"partial": [shard ids]``. Errors are JSON ``{"error": message}`` (400, 401, 404, 405, 413,
415, 503), never with a stack trace or a server path (serving.redact); auth and the size cap are
enforced before the body is read (serving.limits); no client-sent path is ever read.
"""
from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from indexer import IndexerError

from .limits import RequestGuard
from .queries import check_count, parse_box
from .redact import Redactor
from .results import RequestError, UnknownIdError, check_k, parse_switch
from .searcher import Searcher
from .session import GradioSessions
from .throttle import LoginThrottle
from .uploads import DEFAULT_MAX_UPLOAD_BYTES, decode_upload, too_large

# Multipart overhead allowed on top of the image itself before the body is refused unread.
_FORM_OVERHEAD = 64 * 1024
#: the form fields POST /api/search reads (``dba`` also from the query string)
SEARCH_FIELDS = ("image", "k", "index", "id", "path", "dba", "box", "label", "copies")


async def known_fields(request: Request) -> None:
    """A misspelt field (``kk=5``) or one sent in the query string (``?k=5``) is a 400 naming
    it: left out, it would silently search with its default."""
    expected = f"not a field of /api/search (expected {', '.join(SEARCH_FIELDS)})"
    for name in (await request.form()).keys():       # parsed once: FastAPI reads the same form
        if name not in SEARCH_FIELDS:
            raise RequestError(f"{name[:60]}: {expected}")
    for name in request.query_params.keys():
        if name != "dba":
            raise RequestError(f"{name}: send it as a form field (-F {name}=...); the query string carries only dba"
                               if name in SEARCH_FIELDS else f"{name[:60]}: {expected}")


def add_api_routes(app: FastAPI, searcher: Searcher, *, auth: tuple[str, str] | None = None,
                   max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
                   sessions: GradioSessions | None = None, login_block: float = 1.0) -> FastAPI:
    """Register /api/* on ``app`` (before Gradio is mounted at "/") and the guard before the whole app."""
    redact = Redactor(searcher.directories)

    @app.exception_handler(IndexerError)            # a store truncated/replaced under us, ...
    async def _unavailable(request: Request, exc: IndexerError) -> JSONResponse:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return JSONResponse({"error": redact.text(msg)}, status_code=503)

    @app.exception_handler(RequestError)            # UploadError too: 400, 413, 415
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse({"error": exc.message}, status_code=exc.status)

    @app.exception_handler(UnknownIdError)
    async def _unknown(request: Request, exc: UnknownIdError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=404)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return JSONResponse({"error": detail}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'request'}: {e.get('msg')}"
                             for e in exc.errors())
        return JSONResponse({"error": problems or "invalid request"}, status_code=400)

    app.add_middleware(RequestGuard, max_bytes=max_upload_bytes + _FORM_OVERHEAD, limit=max_upload_bytes,
                       auth=auth, throttle=LoginThrottle(first_block=login_block), sessions=sessions)

    @app.get("/api/health")
    def health() -> JSONResponse:
        problems = {n: redact.text(p) for n, p in searcher.health().items()}
        if problems:
            return JSONResponse({"status": "unhealthy", "error": "; ".join(problems.values()),
                                 "indexes": searcher.names, "problems": problems}, status_code=503)
        return JSONResponse({"status": "ok", "indexes": searcher.names})

    @app.get("/api/indexes")
    def indexes() -> list[dict[str, Any]]:
        return [redact.description(searcher.describe(n)) for n in searcher.names]

    @app.post("/api/search", dependencies=[Depends(known_fields)])
    def search(request: Request, image: list[UploadFile] | None = File(None), k: str = Form("10"),
               index: str | None = Form(None), id: str | None = Form(None),
               path: str | None = Form(None), dba: str | None = Form(None),
               box: str | None = Form(None), label: list[str] | None = Form(None),
               copies: str | None = Form(None)) -> dict[str, Any]:
        # One index state for the whole request (a reload meanwhile never mixes two): the index,
        # k, dba, box, labels and the number of images are checked once, before any decoding.
        snap = searcher.snapshot(index)
        kk, only = check_k(k), searcher.check_labels(label, snap)
        use_dba = searcher.check_dba(parse_switch(dba if dba is not None else request.query_params.get("dba")), snap)
        images = image or []
        check_count(len(images))
        region = parse_box(box)
        if region is not None and len(images) > 1:
            raise RequestError(f"box: a region of one query image; got {len(images)} images")
        check_copies = bool(parse_switch(copies, "copies"))
        if check_copies and (region is not None or len(images) > 1):
            raise RequestError("copies: checked for one whole query image (no box, one image)")
        parts, sent = [], []
        for upload in images:
            fname = upload.filename or "image"
            data = upload.file.read(max_upload_bytes + 1)
            if len(data) > max_upload_bytes:
                raise RequestError(f"{fname}: {too_large(upload.size, max_upload_bytes)}", 413)
            img = decode_upload(data, fname, max_bytes=max_upload_bytes, min_side=searcher.decode_side, box=region)
            sent.append(data if check_copies else b"")
            name = upload.filename or "upload"
            parts.append(searcher.query(img, name=name) if region is None else searcher.region_query(img, region, name))
        # else id or path: a gallery image, looked up in LMDB, never opened
        query = searcher.fused(parts) if parts else searcher.query(None, id=id, path=path, index=snap, box=region)
        res = searcher.search(query, kk, index=snap, dba=use_dba, labels=only)
        marks = searcher.copies(query, sent[0] if sent else None, res.results, snap) if check_copies else \
            [{} for _ in res.results]
        # relative to the server, never built from the Host header (a client-chosen name)
        base = request.scope.get("root_path", "").rstrip("/")
        out = {"index": snap.name, "k": kk, "dba": res.dba,
               "query": {"name": query.name, "id": query.id, "label": query.label},
               "results": [{**r.to_dict(), **m, "thumbnail": f"{base}/api/thumb/{snap.name}/{r.id}"}
                           for r, m in zip(res.results, marks)]}
        if res.suggested is not None:   # the label the results vote for, and its share of the vote
            out["suggested"] = dict(zip(("label", "confidence"), res.suggested))
        if res.novelty is not None:     # small: nothing in the gallery is close (another domain, a new class)
            out["novelty"] = {"p": res.novelty, "unlike_gallery": res.unlike_gallery}
        if only:
            out["labels"] = list(only)
        if res.partial:     # served over Ray and a shard did not answer in time: named, not hidden
            out["partial"] = res.partial
        return out

    @app.get("/api/audit/{index}")
    def audit(index: str) -> dict[str, Any]:
        """The index's audit lists (indexer.audit; computed once per index version)."""
        return {"index": index, **searcher.audit(index)}

    @app.get("/api/labels/{index}")
    def labels(index: str) -> dict[str, Any]:
        return {"index": index, "labels": searcher.label_counts(index)}

    @app.get("/api/thumb/{index}/{id}")
    def thumb(index: str, id: str) -> Response:
        try:
            png = searcher.thumbnail_png(index, int(id))
        except ValueError:
            raise UnknownIdError(f"id {id!r} is not a gallery id (expected an integer)") from None
        return Response(png, media_type="image/png", headers={"Cache-Control": "max-age=3600"})

    known = {"/api/health": "GET", "/api/indexes": "GET", "/api/search": "POST", "/api/thumb": "GET",
             "/api/audit": "GET", "/api/labels": "GET"}

    @app.api_route("/api/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
                   include_in_schema=False)
    def unknown(request: Request, rest: str) -> JSONResponse:
        # Registered last: without it, an unknown /api/ path would fall through to Gradio's
        # mount and answer in Gradio's {"detail": ...} shape.
        path = "/api/" + rest
        base = next((k for k in known if path == k or (k in ("/api/thumb", "/api/audit", "/api/labels")
                                                      and path.startswith(k + "/"))), None)
        if base is not None and request.method != known[base]:
            return JSONResponse({"error": f"{request.method} is not allowed on {base}; use {known[base]}"},
                                status_code=405, headers={"Allow": known[base]})
        return JSONResponse({"error": f"no such endpoint {path}; the API has {', '.join(known)}"},
                            status_code=404)

    return app
