"""A hostile-but-fair client against the real `python app.py` (--auth, --max-upload-mb 1):
server paths sent as Gradio file inputs, bodies too large or without credentials, absurd ids,
FastAPI's own error shapes, the OpenAPI listing. Raw HTTP, so nothing is smoothed over by a
client library; every request has a timeout, so a frozen server fails the test instead of
hanging it."""
from __future__ import annotations

import base64
import json
import socket
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

import httpx
import pytest

from serving_testlib import labelled_folder

MB = 1024 * 1024


@contextmanager
def _login(url: str, auth: tuple[str, str]) -> Iterator[httpx.Client]:
    """A client logged in to the Gradio app (its session cookie)."""
    with httpx.Client(timeout=10) as c:
        r = c.post(f"{url}/login", data={"username": auth[0], "password": auth[1]})
        assert r.status_code == 200, r.text
        yield c


def gradio_call(c: httpx.Client, url: str, api: str, data: list) -> tuple[str, object]:
    """POST /gradio_api/call/<api> and read its event stream: ("complete" | "error", data)."""
    r = c.post(f"{url}/gradio_api/call/{api}", json={"data": data})
    assert r.status_code == 200, r.text
    event = None
    with c.stream("GET", f"{url}/gradio_api/call/{api}/{r.json()['event_id']}") as s:
        for line in s.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and event in ("complete", "error"):
                return event, json.loads(line[5:].strip() or "null")
    raise AssertionError("the event stream ended without a result")


def _gallery_photo(demo_dirs) -> Path:
    return next(p for p in sorted(Path(demo_dirs[0]).rglob("*")) if p.suffix in (".jpg", ".png"))


def test_gradio_upload_obeys_max_upload_mb(server):
    url, auth = server
    with _login(url, auth) as c:
        r = c.post(f"{url}/gradio_api/upload", files=[("files", ("big.jpg", b"\xff" * int(1.5 * MB), "image/jpeg"))])
        assert r.status_code == 413, r.text[:300]
        ok = c.post(f"{url}/gradio_api/upload", files=[("files", ("small.jpg", b"\xff" * 1000, "image/jpeg"))])
        assert ok.status_code == 200 and len(ok.json()) == 1


def _chunked_post(url: str, path: str, total: int, headers: dict[str, str] | None = None,
                  chunk: int = 256 * 1024) -> tuple[int, str, int]:
    """POST a multipart body of ``total`` bytes with Transfer-Encoding: chunked, stopping as soon
    as the server answers. Returns (status, response text, bytes of body sent)."""
    u = urlparse(url)
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    boundary = "hostile-boundary"
    head = (f"POST {path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nTransfer-Encoding: chunked\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()) + "\r\n")
    part = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"big.jpg\"\r\n"
            f"Content-Type: image/jpeg\r\n\r\n").encode()
    got = bytearray()
    answered = threading.Event()

    def read() -> None:
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                got.extend(data)
                if b"\r\n\r\n" in got:
                    answered.set()
        except OSError:
            pass
        answered.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sent = 0
    try:
        sock.sendall(head.encode())
        first = True
        while sent < total and not answered.is_set():
            body = (part if first else b"") + b"\0" * chunk
            first = False
            sock.sendall(b"%x\r\n" % len(body) + body + b"\r\n")
            sent += len(body)
        if not answered.is_set():
            tail = f"\r\n--{boundary}--\r\n".encode()
            sock.sendall(b"%x\r\n" % len(tail) + tail + b"\r\n0\r\n\r\n")
    except OSError:
        pass                    # the server closed the connection after answering
    answered.wait(30)
    reader.join(5)
    sock.close()
    text = got.decode("latin-1")
    assert text.startswith("HTTP/1.1 "), f"no HTTP answer after sending {sent} bytes: {text[:200]!r}"
    status = int(text.split()[1])
    return status, text.split("\r\n\r\n", 1)[-1], sent


def test_credentials_are_checked_before_the_body_is_read(server):
    url, _ = server
    status, body, sent = _chunked_post(url, "/api/search", 60 * MB)
    assert status == 401 and "authentication" in body
    assert sent < 16 * MB, f"the server read {sent / MB:.0f} MB of an unauthenticated body before refusing"


def test_oversized_chunked_body_is_cut_off_at_the_limit(server):
    url, auth = server
    cred = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    status, body, sent = _chunked_post(url, "/api/search", 60 * MB, {"Authorization": f"Basic {cred}"})
    assert status == 413, body[:300]
    msg = json.loads(body[body.index("{"):body.rindex("}") + 1])["error"]
    assert "larger than the limit of 1.0 MB" in msg
    assert sent < 16 * MB, f"the server read {sent / MB:.0f} MB before answering 413"


def test_413_message_never_says_a_size_is_larger_than_itself(server, demo_dirs):
    url, auth = server
    # just above the 1 MB limit: inside the multipart allowance, so the route itself answers
    r = httpx.post(f"{url}/api/search", auth=auth, timeout=30,
                   files={"image": ("edge.jpg", b"\xff" * (MB + 100), "image/jpeg")})
    assert r.status_code == 413
    msg = r.json()["error"]
    size, _, limit = msg.partition("larger than the limit of")
    assert "edge.jpg" in msg and limit and size.split("upload is")[-1].strip(" ,") not in limit, msg


def test_absurd_ids_get_404_not_500(server):
    url, auth = server
    with httpx.Client(auth=auth, timeout=30) as c:
        for bad in (str(2 ** 64), str(10 ** 30), "-1"):
            r = c.post(f"{url}/api/search", data={"id": bad, "k": "3"})
            assert r.status_code == 404 and "error" in r.json(), (bad, r.status_code, r.text)
            r = c.get(f"{url}/api/thumb/pretrained/{bad}")
            assert r.status_code == 404 and "error" in r.json(), (bad, r.status_code, r.text)


def test_every_api_error_is_error_json(server):
    url, auth = server
    with httpx.Client(auth=auth, timeout=30) as c:
        cases = [c.get(f"{url}/api/search"),                                   # wrong method
                 c.get(f"{url}/api/nope"),                                     # unknown endpoint
                 c.post(f"{url}/api/search", content=b"garbage",               # broken multipart
                        headers={"content-type": "multipart/form-data; boundary=zz"}),
                 c.post(f"{url}/api/search", json={"k": 3})]                   # not a form at all
        for r in cases:
            assert 400 <= r.status_code < 500, (r.request.url, r.status_code, r.text)
            body = r.json()
            assert set(body) == {"error"} and isinstance(body["error"], str), body
        assert cases[0].status_code == 405 and cases[1].status_code == 404


def test_no_route_listing_without_credentials(server):
    url, auth = server
    for path in ("/openapi.json", "/docs", "/redoc", "/api/openapi.json"):
        for creds in (None, auth):
            r = httpx.get(f"{url}{path}", auth=creds, timeout=30)
            assert r.status_code in (401, 404), (path, creds, r.status_code)
            assert '"paths"' not in r.text and "swagger" not in r.text.lower()
            if creds is None:
                assert "/api/search" not in r.text


def test_gradio_search_with_a_real_upload_still_works(server, demo_dirs):
    """The refusals above must not refuse real uploads: upload, then search by the cache path."""
    url, auth = server
    path, label = labelled_folder(demo_dirs[1])[0]
    with _login(url, auth) as c:
        up = c.post(f"{url}/gradio_api/upload", files=[("files", (path.name, path.read_bytes(), "image/jpeg"))])
        assert up.status_code == 200, up.text
        event, data = gradio_call(c, url, "search", [{"path": up.json()[0], "meta": {"_type": "gradio.FileData"}},
                                                     None, label, 3])
        assert event == "complete", data
        assert label in data[0] and len(data[1]) == 3


# Last in the module, /dev/zero last: on a server without the fix it freezes the whole process.
@pytest.mark.parametrize("target", ["/etc/passwd", "gallery photo", "/dev/zero"])
def test_gradio_file_input_refuses_server_paths(server, server_dir, demo_dirs, target):
    url, auth = server
    path = str(_gallery_photo(demo_dirs)) if target == "gallery photo" else target
    with _login(url, auth) as c:
        event, data = gradio_call(c, url, "search", [{"path": path, "meta": {"_type": "gradio.FileData"}},
                                                     None, None, 3])
        message = data.get("error") if isinstance(data, dict) else str(data)
        assert event == "error", f"{path} was accepted as a query: {str(data)[:300]}"
        assert "not a readable image" not in str(message), "the server opened the file"
        copied = [f for f in (server_dir / "gradio-tmp").rglob(Path(path).name)]
        assert not copied, f"{path} was copied into Gradio's folder: {copied}"
        r = c.get(f"{url}/gradio_api/file={path}")
        assert r.status_code in (403, 404) and "root:" not in r.text
        assert httpx.get(f"{url}/api/health", auth=auth, timeout=10).status_code == 200
