"""Who is logged in to the Gradio UI, and the login page stripped of everything about the index:
Gradio's pages embed ``window.gradio_api_info`` (labels, ids, paths) even for a visitor without a
login, so the guard (serving.limits) rewrites it to ``null``; a form it does not recognise (a
Gradio upgrade) is refused (fail closed).
"""
from __future__ import annotations

import re
from http.cookies import CookieError, SimpleCookie
from typing import Any

_API_INFO = re.compile(rb"(<script>window\.gradio_api_info = )(.*?)(;</script>)", re.S)


class GradioSessions:
    """Gradio's login cookie against the mounted app's live tokens (``app`` is set after the mount)."""

    def __init__(self) -> None:
        self.app: Any = None

    def logged_in(self, headers: dict[bytes, bytes]) -> bool:
        app = self.app
        if app is None or (getattr(app, "auth", None) is None and getattr(app, "auth_dependency", None) is None):
            return app is not None                          # no --auth: everyone is "logged in"
        try:
            jar = SimpleCookie(headers.get(b"cookie", b"").decode("latin-1"))
        except CookieError:
            return False
        return any(name in jar and jar[name].value in app.tokens
                   for name in (f"access-token-{app.cookie_id}", f"access-token-unsecure-{app.cookie_id}"))


class UnsafePage(Exception):
    """A page for a visitor without a login that still mentions gradio_api_info."""


def strip_api_info(body: bytes) -> bytes:
    """The page with its ``window.gradio_api_info`` literal replaced by ``null``."""
    out, n = _API_INFO.subn(rb"\1null\3", body)
    if b"gradio_api_info = {" in out or (n == 0 and b"window.gradio_api_info" in body
                                          and b"window.gradio_api_info = null" not in body):
        raise UnsafePage("the page still embeds gradio_api_info")
    return out
