"""The server's front door, one pure ASGI middleware (not BaseHTTPMiddleware, so Gradio's streaming
routes pass untouched): refuse what must be refused before a request body is read.

* ``/api/*`` with ``--auth``: basic credentials checked from the headers. Failed logins (basic or
  Gradio ``/login``) per client address past 10 a minute: 429 + Retry-After (serving.throttle).
* A Content-Length above the cap: 413 unread; a chunked body is cut at the cap; a body not in by
  its deadline: 408. An answer with the body unread carries ``Connection: close`` (else h11 drains
  GBs). Cut-off, deadline and mid-body disconnect reach the app as ``MultiPartException``, which
  Gradio's upload parser cleans up after: no refused upload leaves a file.
* Without a login, ``gradio_api_info`` is stripped from Gradio's pages (serving.session);
  ``/api/*``: an unexpected error becomes a JSON 500 without a trace.
* Gradio's long-lived streams: with ``--auth``, 401 without a login (3,000 open heartbeats cost
  3,019 file handles); at most ``MAX_STREAMS_PER_CLIENT`` per client address (429 past that).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import os
import secrets
import time
from typing import Any

from fastapi.responses import JSONResponse
from starlette.formparsers import MultiPartException

from .session import GradioSessions, UnsafePage, strip_api_info
from .throttle import LoginThrottle
from .uploads import too_large

log = logging.getLogger(__name__)

AUTH_HEADERS = {"WWW-Authenticate": 'Basic realm="das-retrieval"'}
AUTH_MESSAGE = "authentication required (HTTP basic auth, the --auth user and password)"
# Seconds a request body may take to arrive: without a login (the /login form, refused routes)
# a slow client is dropped soon; a logged-in upload of the 32 MB cap gets room for a slow link.
ANON_BODY_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 120.0
MAX_STREAMS_PER_CLIENT = 16
CLOSE = {"Connection": "close"}
_STREAM_PREFIXES = ("/gradio_api/heartbeat/", "/gradio_api/queue/data", "/gradio_api/stream/",
                    "/gradio_api/call/")


class BodyTooLarge(MultiPartException):
    """Raised into the app from ``receive`` once the body passes the cap."""


class BodyTimeout(MultiPartException):
    """Raised into the app from ``receive`` when the body is not in by its deadline."""


class BodyAborted(MultiPartException):
    """Raised into the app from ``receive`` when the client leaves before its body is in."""


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


UPLOAD_ROUTE = "/gradio_api/upload"
UPLOAD_CAP_ENV = "DAS_UPLOAD_DIR_MB"


def upload_folder_cap(limit: int) -> int:
    """What Gradio's upload folder may hold at once: ``$DAS_UPLOAD_DIR_MB``, else 64 uploads at
    the size cap, at least 256 MB; past it uploads get 429 until older ones expire."""
    raw = os.environ.get(UPLOAD_CAP_ENV, "").strip()
    if raw:
        try:
            return max(1, int(float(raw) * 2 ** 20))
        except ValueError:
            raise ValueError(f"{UPLOAD_CAP_ENV}={raw!r}: expected a number of megabytes") from None
    return max(64 * int(limit), 256 * 2 ** 20)


def folder_bytes(folder: str | os.PathLike) -> int:
    """Disk bytes held under ``folder`` (allocated blocks; symlinks not followed)."""
    total, stack = 0, [os.fspath(folder)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        else:
                            total += e.stat(follow_symlinks=False).st_blocks * 512
                    except OSError:
                        pass
        except OSError:
            pass
    return total


#: The one key all client addresses that are not IP addresses share (issue 39): a trusted proxy's
#: X-Forwarded-For garbage (a fresh random string per request) would otherwise be a new client each time.
NOT_AN_ADDRESS = "not-an-ip-address"


def client_key(scope: dict) -> str:
    """The client address the throttle and the stream cap count (else :data:`NOT_AN_ADDRESS`)."""
    import ipaddress

    host = str((scope.get("client") or ("",))[0] or "")
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return NOT_AN_ADDRESS


def _has_body(headers: dict[bytes, bytes]) -> bool:
    length = headers.get(b"content-length", b"0").strip()
    return b"transfer-encoding" in headers or (length.isdigit() and int(length) > 0)


class RequestGuard:
    """See the module docstring; ``limit``: the upload limit, ``max_bytes``: it plus multipart headers."""

    def __init__(self, app: Any, *, max_bytes: int, limit: int, auth: tuple[str, str] | None = None,
                 throttle: LoginThrottle | None = None, sessions: GradioSessions | None = None,
                 body_timeout: float = BODY_TIMEOUT_S, anon_body_timeout: float = ANON_BODY_TIMEOUT_S,
                 max_streams: int = MAX_STREAMS_PER_CLIENT, upload_dir: str | None = None,
                 upload_dir_cap: int | None = None):
        self.app, self.max_bytes, self.limit, self.auth = app, max_bytes, limit, auth
        # Gradio's upload folder (the app's own, serving.tempdir) and what it may hold at once
        self.upload_dir = upload_dir or os.environ.get("GRADIO_TEMP_DIR")
        self.upload_dir_cap = upload_dir_cap or upload_folder_cap(limit)
        self.max_streams = max_streams
        self._streams: dict[str, int] = {}      # client address -> streams open now
        self.throttle = throttle or LoginThrottle()
        self.sessions = sessions or GradioSessions()
        self.body_timeout, self.anon_body_timeout = body_timeout, anon_body_timeout

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_STREAM_PREFIXES):
            await self._stream(scope, receive, send)
            return
        await self._guard(scope, receive, send)

    async def _stream(self, scope: dict, receive: Any, send: Any) -> None:
        """A long-lived Gradio stream: a login first (with --auth), a bounded number per client."""
        client = client_key(scope)
        if self.auth is not None and not self.sessions.logged_in(dict(scope.get("headers") or [])):
            await _answer(scope, receive, send, 401, "log in first (this stream needs a session)", CLOSE)
            return
        if self._streams.get(client, 0) >= self.max_streams:
            await _answer(scope, receive, send, 429, f"too many open streams from this address (at most "
                          f"{self.max_streams}); close some first", {"Retry-After": "15"})
            return
        self._streams[client] = self._streams.get(client, 0) + 1
        try:
            await self._guard(scope, receive, send)
        finally:
            left = self._streams.pop(client) - 1          # the table holds open streams only
            if left:
                self._streams[client] = left

    async def _guard(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope.get("method", "GET")
        api = path.startswith("/api/") or path == "/api"
        headers = dict(scope.get("headers") or [])
        has_body = _has_body(headers)
        client = client_key(scope)
        login_form = method == "POST" and path.rstrip("/") == "/login" and self.auth is not None
        close = CLOSE if has_body else {}

        logged_in = self.auth is None
        attempt = api and self.auth is not None and b"authorization" in headers  # throttled, counted
        wait = self.throttle.retry_after(client) if attempt or login_form else 0
        if wait:
            await _answer(scope, receive, send, 429, f"too many failed logins from this address; "
                          f"retry in {wait} s", {"Retry-After": str(wait), **close})
            return
        if api and self.auth is not None:
            if not attempt or not basic_auth_ok(headers, self.auth):
                if attempt:
                    self.throttle.failed(client)
                await _answer(scope, receive, send, 401, AUTH_MESSAGE, {**AUTH_HEADERS, **close})
                return
            self.throttle.succeeded(client)
            logged_in = True
        if not logged_in:
            logged_in = self.sessions.logged_in(headers)
        length = headers.get(b"content-length", b"").decode("latin-1").strip()
        if method == "POST" and path.rstrip("/").endswith(UPLOAD_ROUTE) and self.upload_dir:
            held_now = folder_bytes(self.upload_dir)
            if held_now + self.limit > self.upload_dir_cap:     # room for one more at the cap
                await _answer(scope, receive, send, 429, (
                    f"the upload folder is full ({held_now / 2 ** 20:.0f} MB held, at most "
                    f"{self.upload_dir_cap / 2 ** 20:.0f} MB; {UPLOAD_CAP_ENV}); uploads expire after "
                    "--upload-max-age seconds: retry then"), {"Retry-After": "60", **close})
                return
        if length.isdigit() and int(length) > self.max_bytes:
            # the rest of the body is never read, so the connection cannot be reused
            await _answer(scope, receive, send, 413, too_large(int(length), self.limit), CLOSE)
            return
        sanitize = (not logged_in and not api and self.auth is not None and method in ("GET", "HEAD"))

        seen = 0
        body_done = not has_body
        failed: str | None = None           # "413" / "408" / "gone": the guard answers, not the app
        started = False
        held: list[dict] = []               # a page being sanitised: its messages, held back
        deadline = time.monotonic() + (self.body_timeout if logged_in else self.anon_body_timeout)

        async def _receive() -> dict:
            nonlocal seen, body_done, failed
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                failed = "408"
                raise BodyTimeout("the request body did not arrive in time") from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if not message.get("more_body", False):
                    body_done = True
                if seen > self.max_bytes:
                    failed = "413"
                    raise BodyTooLarge("upload is larger than the limit")
            elif message["type"] == "http.disconnect":
                body_done = True
                failed = "gone"             # nobody to answer; the app cleans up its files
                raise BodyAborted("the client left before sending its whole body")
            return message

        async def _send(message: dict) -> None:
            nonlocal started
            if failed:                      # the app's own answer to the cut body is replaced
                return
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                if login_form:
                    if status == 200:
                        self.throttle.succeeded(client)
                    elif status in (400, 401, 422):
                        self.throttle.failed(client)
                if not body_done:
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
                ctype = dict(message.get("headers", [])).get(b"content-type", b"")
                if sanitize and ctype.startswith(b"text/html"):
                    held.append(message)
                    return
            elif held:
                held.append(message)
                if not message.get("more_body", False):
                    await self._send_sanitized(held, send)
                return
            await send(message)

        try:
            await self.app(scope, _receive, _send)
        except MultiPartException:
            if not failed:
                raise
        except Exception:
            if not api:
                raise
            log.exception("unhandled error on %s", scope["path"])
            if not started:
                await _answer(scope, receive, send, 500, "internal server error")
            return
        if failed == "413" and not started:
            await _answer(scope, receive, send, 413, too_large(None, self.limit), CLOSE)
        elif failed == "408" and not started:
            await _answer(scope, receive, send, 408, "the request body did not arrive in time", CLOSE)

    async def _send_sanitized(self, held: list[dict], send: Any) -> None:
        start, body = held[0], b"".join(m.get("body", b"") for m in held[1:])
        try:
            body = strip_api_info(body)
        except UnsafePage:
            log.error("a page for a visitor without a login still embeds gradio_api_info; withheld")
            start = {**start, "status": 500, "headers": [(b"content-type", b"text/plain")]}
            body = b"page withheld: it would show the index before login"
        hdrs = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        hdrs.append((b"content-length", str(len(body)).encode()))
        await send({**start, "headers": hdrs})
        await send({"type": "http.response.body", "body": body, "more_body": False})


async def _answer(scope: dict, receive: Any, send: Any, status: int, error: str,
                  headers: dict[str, str] | None = None) -> None:
    """The guard's own JSON answer, ``{"error": ...}``."""
    await JSONResponse({"error": error}, status_code=status, headers=headers)(scope, receive, send)
