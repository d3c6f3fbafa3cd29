"""Issue 19's probes of the server's front door, one table row each, run by
benchmarks/reliability/probes.py against its server (see there): upload leftovers and start-up
cleaning, the login page, unread bodies and slow clients, list caps, server paths, the login
throttle, and a data.mdb truncated under a running app."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.inputs.slow_clients import raw_socket, trickle

REPO = Path(__file__).resolve().parents[2]
AUTH = ("probe", "probe-pass")          # probes.py's server login
MB = 1024 * 1024
ENV = {**os.environ, "PYTHONPATH": str(REPO), "GRADIO_ANALYTICS_ENABLED": "False", "OMP_NUM_THREADS": "1"}


def _files(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if p.is_file()}


def upload_leftover_probes(url: str, root: Path, seeded: Path) -> list[tuple[str, str, str]]:
    """Oversized and aborted chunked uploads to Gradio's upload route, logged in; the leftover
    seeded into the app's temp folder before it started."""
    tmp = root / "gradio-tmp"
    before = _files(tmp)
    with httpx.Client(timeout=30) as c:
        c.post(f"{url}/login", data={"username": AUTH[0], "password": AUTH[1]})
        cookie = "; ".join(f"{k}={v}" for k, v in c.cookies.items())
    part = b'--b\r\nContent-Disposition: form-data; name="files"; filename="big.jpg"\r\n\r\n'
    codes = []
    for total, abort in ((3 * MB, False), (3 * MB, False), (3 * MB, False), (MB // 2, True)):
        sock = raw_socket(url)
        sock.sendall(("POST /gradio_api/upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                      f"Cookie: {cookie}\r\nContent-Type: multipart/form-data; boundary=b\r\n\r\n").encode())
        sent = 0
        try:
            while sent < total:
                body = (part if sent == 0 else b"") + b"\0" * (64 * 1024)
                sock.sendall(b"%x\r\n" % len(body) + body + b"\r\n")
                sent += len(body)
            if not abort:
                sock.sendall(b"d\r\n\r\n--b--\r\n\r\n0\r\n\r\n")
                codes.append(sock.recv(100).split(b" ")[1].decode())
        except OSError:
            codes.append("closed")
        sock.close()
    time.sleep(1)
    new = _files(tmp) - before
    return [("3 chunked 3 MB uploads to `/gradio_api/upload` (logged in, 1 MB cap) + 1 aborted at 0.5 MB",
             "413 each; no new file in the app's temp folder",
             f"{', '.join(codes)}; new files: {len(new)}" + (f" ({sorted(p.name for p in new)[:3]})" if new else "")),
            ("a 10 MB `tmp*` leftover in the app's temp folder when app.py starts", "removed at start-up",
             "removed" if not seeded.exists() else "still there")]


def login_page_probe(url: str, idx: Path) -> list[tuple[str, str, str]]:
    """GET every GET/HEAD route of the running app's router without credentials."""
    from starlette.routing import Mount

    from indexer import GalleryStore
    from serving import Searcher
    from serving.server import create_app

    secrets = {str(idx.resolve()), str(idx.parent.resolve())}
    with GalleryStore(idx / "store.lmdb") as store:
        for i in store.ids():
            secrets.update({str(int(i)), store.get_meta(int(i))["path"]})
        secrets.update(store.labels())
    app = create_app(Searcher.open([idx], names=["probe"]), auth=AUTH)
    routes: list[tuple[str, str]] = []

    def walk(rs, prefix: str) -> None:
        for r in rs:
            if isinstance(r, Mount):
                walk(getattr(r.app, "routes", []), prefix + r.path)
            elif hasattr(r, "original_router"):
                walk(r.original_router.routes, prefix + getattr(r.include_context, "prefix", ""))
            elif hasattr(r, "path"):
                routes.extend((m, re.sub(r"\{[^}]+\}", "x", prefix + r.path))
                              for m in sorted(getattr(r, "methods", None) or []) if m in ("GET", "HEAD"))
    walk(app.routes, "")
    leaks, total = [], 0
    for method, path in routes:
        try:
            with httpx.stream(method, f"{url}{path}", timeout=5) as r:
                body = b"".join(r.iter_bytes()).decode("utf-8", "replace")
        except httpx.ReadTimeout:
            continue
        total += len(body)
        found = sorted(s for s in secrets if s in body)
        if found or "gradio_api_info = {" in body:
            leaks.append(f"{path} ({', '.join(found[:2]) or 'api info'})")
    return [(f"GET/HEAD of all {len(routes)} page/asset routes of the app's router, no login",
             "no label, id, path or api info of the index",
             f"{len(leaks)} leak{'s' if len(leaks) != 1 else ''}" + (f": {'; '.join(leaks[:3])}" if leaks else
                                                                     f" ({total / 1024:.0f} KB read)"))]


def connection_probes(url: str) -> list[tuple[str, str, str]]:
    rows = []
    sock = raw_socket(url)                   # 401, then keep pushing the chunked body
    sock.sendall(b"POST /api/search HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    sent, answer, t0 = 0, b"", time.perf_counter()
    try:
        while sent < 1024 * MB and time.perf_counter() - t0 < 8:
            sock.sendall(b"10000\r\n" + b"\0" * 65536 + b"\r\n")
            sent += 65536
    except OSError:
        pass
    sock.settimeout(2)
    try:
        answer = sock.recv(200)
    except OSError:
        pass
    sock.close()
    rows.append(("chunked POST /api/search without credentials, client keeps sending after the 401",
                 "401, connection closed (the rest never read)",
                 f"{answer.split(b' ')[1].decode() if answer else 'no answer'}; closed after "
                 f"{sent / MB:.1f} MB sent" + (" (NOT closed in 8 s)" if sent >= 1024 * MB or time.perf_counter() - t0 >= 8 else "")))
    for what, head in (("slow request head (1 byte/s), no login", b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: "),
                       ("slow `/login` body (1 byte/s of 1,000)", b"POST /login HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/x-www-form-urlencoded\r\nContent-Length: 1000\r\n\r\nusername=")):
        closed, got, secs = trickle(url, head, 40)
        rows.append((what, "dropped within ~10 s", (f"closed after {secs:.0f} s"
                                                     + (f" ({got.split(b' ')[1].decode()})" if got else ""))
                     if closed else "still open after 40 s"))
    return rows


def api_limit_probes(url: str, query: bytes) -> list[tuple[str, str, str]]:
    rows = []
    with httpx.Client(timeout=120) as c:
        c.post(f"{url}/login", data={"username": AUTH[0], "password": AUTH[1]})
        ids = httpx.get(f"{url}/api/indexes", auth=AUTH).json()
        r0 = httpx.post(f"{url}/api/search", auth=AUTH, files={"image": ("q.jpg", query)}, data={"k": "1"})
        pick = str(r0.json()["results"][0]["id"])
        t0 = time.perf_counter()
        r = c.post(f"{url}/gradio_api/call/probes", json={"data": [None, pick, None, 6, 4, ", ".join(["1.5"] * 400),
                                                                     0, 0.5, "0.5", None, 0]})
        msg = ""
        with c.stream("GET", f"{url}/gradio_api/call/probes/{r.json()['event_id']}") as s:
            for line in s.iter_lines():
                if line.startswith("data:") and line[5:].strip().startswith("["):
                    msg = json.loads(line[5:].strip())[0]
                    break
        rows.append(("Probes tab with 400 scale values", "refused with a clear message",
                     f"\"{msg.strip('*⚠ ')[:60]}\" in {time.perf_counter() - t0:.2f} s"))
    text = json.dumps(ids)
    absolute = re.findall(r'"(/[^"]*)"', text)
    rows.append(("absolute server paths in `GET /api/indexes`", "none",
                 f"{len(absolute)}" + (f": {absolute[:2]}" if absolute else "")))
    return rows


def throttle_probe(url: str) -> list[tuple[str, str, str]]:
    """Last on the server: wrong basic-auth guesses for 10 s, then the /login form while blocked."""
    codes: list[int] = []
    retry = ""
    t0 = time.perf_counter()
    with httpx.Client(timeout=10) as c:
        while time.perf_counter() - t0 < 10:
            r = c.get(f"{url}/api/health", auth=("probe", f"guess{len(codes)}"))
            codes.append(r.status_code)
            retry = r.headers.get("retry-after", retry)
        form = c.post(f"{url}/login", data={"username": AUTH[0], "password": AUTH[1]})
    first429 = codes.index(429) + 1 if 429 in codes else None
    return [("wrong basic-auth guesses for 10 s from one address", "429 + Retry-After after 10 failures a minute, "
             "exponential back-off", f"{codes.count(401)} guesses checked (401), {codes.count(429)} answered 429 "
             f"(first at request {first429}); last Retry-After {retry} s"),
            ("`/login` form with the right password while the address is blocked", "429",
             f"{form.status_code}, Retry-After {form.headers.get('retry-after')}")]


def store_damage_probe(idx: Path, root: Path, start_app, query: bytes) -> list[tuple[str, str, str]]:
    """data.mdb truncated under a running app serving it and a second index; then rebuilt."""
    victim = root / "victim"
    shutil.rmtree(victim, ignore_errors=True)
    shutil.copytree(idx, victim, ignore=shutil.ignore_patterns("lock.mdb"))
    url, proc = start_app(idx, root, extra=["--index", str(victim), "--name", "victim"])
    try:
        q = {"image": ("q.jpg", query)}
        before = httpx.post(f"{url}/api/search", auth=AUTH, files=q, data={"index": "victim"}, timeout=60).status_code
        data = victim / "store.lmdb" / "data.mdb"
        os.truncate(data, data.stat().st_size // 2)
        h = httpx.get(f"{url}/api/health", auth=AUTH, timeout=30)
        s = httpx.post(f"{url}/api/search", auth=AUTH, files=q, data={"index": "victim"}, timeout=60)
        o = httpx.post(f"{url}/api/search", auth=AUTH, files=q, data={"index": "probe"}, timeout=60).status_code
        alive = proc.poll() is None
        shutil.rmtree(victim)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "indexer", "build", str(idx.parent / "gallery"), "--out", str(victim),
                        "--quiet"], env=ENV, cwd=REPO, check=True, capture_output=True)
        t_build = time.perf_counter() - t0
        h2 = 0
        while time.perf_counter() - t0 < t_build + 60:
            try:
                h2 = httpx.get(f"{url}/api/health", auth=AUTH, timeout=10).status_code
            except httpx.HTTPError:
                h2 = 0
            if h2 == 200:
                break
            time.sleep(0.3)
        s2 = httpx.post(f"{url}/api/search", auth=AUTH, files=q, data={"index": "victim"}, timeout=60).status_code
        after = time.perf_counter() - t0 - t_build
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    return [("data.mdb truncated under the running app (2 indexes served), then rebuilt",
             "health/search 503 naming the file; process alive; other index 200; 200 again after the rebuild",
             f"search before {before}; health {h.status_code}, search {s.status_code}: \"{s.json().get('error', '')[:70]}...\"; "
             f"alive: {'yes' if alive else 'NO'}; other index {o}; after rebuild: health {h2}, search {s2} "
             f"({after:.1f} s after the build ended)")]
