"""Issue 28, serving half: what a client may claim about itself (X-Forwarded-For, Host), and what
a stranger may hold open or leave on disk. Real HTTP against real `python app.py` servers: one
with the defaults (no proxy trusted, uploads kept 4 s for the test), one that names 127.0.0.1
as its proxy. Waits are bounded by generous deadlines, never asserted as speeds."""
from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from benchmarks.inputs.slow_clients import open_stream

AUTH = ("tester", "s3cret-pass")            # conftest's; conftest is not importable by name here
WRONG = ("tester", "guess")


@pytest.fixture(scope="module")
def plain(pretrained_index, tmp_path_factory, free_port, start_app) -> Iterator[tuple[str, Path]]:
    """Defaults but for a 4 s upload age; yields (url, the app's temp folder)."""
    from serving.tempdir import app_temp_dir

    root = tmp_path_factory.mktemp("plain")
    port = free_port()
    args = ["--index", pretrained_index, "--auth", f"{AUTH[0]}:{AUTH[1]}", "--upload-max-age", 4]
    with start_app(args, root, port, auth=AUTH) as (url, _):
        yield url, app_temp_dir(port, root / "gradio-tmp")


@pytest.fixture(scope="module")
def proxied(pretrained_index, tmp_path_factory, free_port, start_app) -> Iterator[str]:
    root = tmp_path_factory.mktemp("proxied")
    args = ["--index", pretrained_index, "--auth", f"{AUTH[0]}:{AUTH[1]}", "--forwarded-allow-ips", "127.0.0.1"]
    with start_app(args, root, free_port(), auth=AUTH) as (url, _):
        yield url


def _cookie(url: str) -> str:
    r = httpx.post(f"{url}/login", data={"username": AUTH[0], "password": AUTH[1]}, timeout=30)
    assert r.status_code == 200, r.text
    return "; ".join(f"{k}={v}" for k, v in r.cookies.items())


def test_heartbeat_needs_a_login(plain):
    """Gradio serves /gradio_api/heartbeat/<any> to anyone and never ends the answer: without a
    login it is now refused at once."""
    url, _ = plain
    for sid in ("abc", "x" * 40):
        r = httpx.get(f"{url}/gradio_api/heartbeat/{sid}", timeout=15)
        assert r.status_code == 401 and "log in" in r.json()["error"], r.text


def test_open_streams_per_client_are_capped(plain):
    """Logged in, 16 heartbeats may be open at once; the 17th is refused (429) until one closes."""
    url, _ = plain
    cookie = _cookie(url)
    held = []
    try:
        for i in range(16):
            s, status = open_stream(url, f"/gradio_api/heartbeat/held{i}", cookie)
            held.append(s)
            assert status == b"HTTP/1.1 200 OK", (i, status)
        s, status = open_stream(url, "/gradio_api/heartbeat/one-more", cookie)
        s.close()
        assert status == b"HTTP/1.1 429 Too Many Requests", status
        held.pop().close()
        deadline = time.monotonic() + 60          # the server sees the close at its next write
        while True:
            s, status = open_stream(url, "/gradio_api/heartbeat/after-close", cookie)
            held.append(s)
            if status == b"HTTP/1.1 200 OK" or time.monotonic() > deadline:
                break
            held.pop().close()
            time.sleep(1)
        assert status == b"HTTP/1.1 200 OK", status
    finally:
        for s in held:
            s.close()


def test_uploads_never_searched_expire(plain):
    """An upload that no search used is deleted --upload-max-age seconds after it arrived
    (4 s here; 900 by default), not an hour later."""
    url, temp = plain
    cookie = _cookie(url)
    png = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg==")
    r = httpx.post(f"{url}/gradio_api/upload", files={"files": ("dot.png", png, "image/png")},
                   headers={"Cookie": cookie}, timeout=30)
    assert r.status_code == 200, r.text
    path = Path(r.json()[0])
    assert path.is_file() and temp in path.parents, (path, temp)
    deadline = time.monotonic() + 90
    while path.exists() and time.monotonic() < deadline:
        time.sleep(1)
    assert not path.exists(), f"{path} was still there 90 s after a 4 s upload age"


def test_thumbnail_urls_ignore_the_host_header(server, demo_dirs):
    url, auth = server
    photo = next(p for p in sorted(Path(demo_dirs[0]).rglob("*")) if p.suffix in (".jpg", ".png"))
    r = httpx.post(f"{url}/api/search", auth=auth, headers={"Host": "evil.example"}, timeout=60,
                   files={"image": (photo.name, photo.read_bytes())}, data={"k": "3"})
    assert r.status_code == 200, r.text
    assert "evil.example" not in r.text
    thumbs = [x["thumbnail"] for x in r.json()["results"]]
    assert thumbs and all(t.startswith("/api/thumb/pretrained/") for t in thumbs), thumbs
    assert httpx.get(url + thumbs[0], auth=auth, timeout=30).status_code == 200


def _block(url: str, headers: dict[str, str], min_wait: int = 4, client: httpx.Client | None = None) -> int:
    """Fail logins from ``headers``' client until it is blocked for at least ``min_wait`` s (the
    back-off doubles per failure after a block ends: 1, 2, 4 s); returns the Retry-After."""
    get = (client or httpx).get
    for _ in range(10):
        get(f"{url}/api/health", auth=WRONG, headers=headers, timeout=10)
    while True:
        r = get(f"{url}/api/health", auth=WRONG, headers=headers, timeout=10)
        if r.status_code == 429:
            wait = int(r.headers["Retry-After"])
            if wait >= min_wait:
                return wait
            time.sleep(wait + 0.2)


def test_forwarded_for_does_not_escape_the_throttle(plain):
    """With no proxy named, X-Forwarded-For is ignored: a blocked peer stays blocked whatever
    address it claims, right password or not. The blocked peer is 127.0.0.2 (the server listens
    on 127.0.0.1; all of 127/8 is loopback), so the module's other tests, from 127.0.0.1, are not
    blocked whatever order they run in."""
    url, _ = plain
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")) as peer:
        _block(url, {}, client=peer)
        for i in range(5):
            fresh = {"X-Forwarded-For": f"203.0.113.{i + 1}"}
            right = peer.get(f"{url}/api/health", auth=AUTH, headers=fresh, timeout=10)
            assert right.status_code == 429, (fresh, right.status_code)
            wrong = peer.get(f"{url}/api/health", auth=WRONG, headers=fresh, timeout=10)
            assert wrong.status_code == 429, (fresh, wrong.status_code)
        form = peer.post(f"{url}/login", data={"username": AUTH[0], "password": AUTH[1]},
                         headers={"X-Forwarded-For": "198.51.100.7"}, timeout=10)
        assert form.status_code == 429
    assert httpx.get(f"{url}/api/health", auth=AUTH, timeout=10).status_code == 200     # 127.0.0.1: not blocked


def test_forwarded_for_is_believed_from_a_named_proxy(proxied):
    """With --forwarded-allow-ips 127.0.0.1 the client is the address the proxy forwards: one
    blocked client does not block the others behind the same proxy."""
    url = proxied
    blocked = {"X-Forwarded-For": "203.0.113.9"}
    _block(url, blocked)
    assert httpx.get(f"{url}/api/health", auth=AUTH, headers=blocked, timeout=10).status_code == 429
    other = {"X-Forwarded-For": "203.0.113.10"}
    assert httpx.get(f"{url}/api/health", auth=AUTH, headers=other, timeout=10).status_code == 200
    assert httpx.get(f"{url}/api/health", auth=AUTH, timeout=10).status_code == 200     # the proxy itself
