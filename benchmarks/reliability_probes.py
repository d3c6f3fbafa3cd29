"""The hostile-but-fair probes of issue 13, run against a real `python app.py`; one table row each.

    python benchmarks/reliability_probes.py [--no-write]

Builds a small index (4 Caltech-101 classes x 6 photos from ../shared/data, the offline
pretrained embedder) in a temporary folder, serves it on a free 127.0.0.1 port with --auth and
--max-upload-mb 1 (stopped by PID at the end), and records for each probe what was expected and
what was observed (status, seconds, bytes read). Then damages copies of the index and runs the
CLI and app.py startup on them. Writes benchmarks/RESULTS-reliability.md unless --no-write.
Decode memory has its own script (benchmarks/decode_memory.py).
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CALTECH = REPO.parent / "shared" / "data" / "caltech101-dev" / "images"
AUTH = ("probe", "probe-pass")
MB = 1024 * 1024
ENV = {**os.environ, "PYTHONPATH": str(REPO), "GRADIO_ANALYTICS_ENABLED": "False", "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gradio_search(url: str, path: str) -> tuple[str, str, float]:
    """A logged-in Gradio API call whose image input is a server path: (event, message, seconds)."""
    with httpx.Client(timeout=30) as c:
        c.post(f"{url}/login", data={"username": AUTH[0], "password": AUTH[1]})
        t0 = time.perf_counter()
        r = c.post(f"{url}/gradio_api/call/search",
                   json={"data": [{"path": path, "meta": {"_type": "gradio.FileData"}}, None, None, 3]})
        event = None
        with c.stream("GET", f"{url}/gradio_api/call/search/{r.json()['event_id']}") as s:
            for line in s.iter_lines():
                if line.startswith("event:"):
                    event = line.split(":", 1)[1].strip()
                elif line.startswith("data:") and event in ("complete", "error"):
                    data = json.loads(line[5:].strip() or "null")
                    msg = data.get("error") if isinstance(data, dict) else str(data)[:80]
                    return event, str(msg)[:90], time.perf_counter() - t0
    return "none", "", time.perf_counter() - t0


def chunked_post(url: str, total: int, headers: dict[str, str]) -> tuple[int, float, str]:
    """Chunked multipart POST /api/search of ``total`` bytes, stopping when answered:
    (status, MB sent before the answer, error message)."""
    u = urlparse(url)
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    head = ("POST /api/search HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            "Content-Type: multipart/form-data; boundary=b\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()
    part = b'--b\r\nContent-Disposition: form-data; name="image"; filename="big.jpg"\r\n\r\n'
    got, done = bytearray(), threading.Event()

    def read() -> None:
        try:
            while (d := sock.recv(65536)):
                got.extend(d)
                if b"\r\n\r\n" in got:
                    done.set()
        except OSError:
            pass
        done.set()

    threading.Thread(target=read, daemon=True).start()
    sent = 0
    try:
        sock.sendall(head)
        while sent < total and not done.is_set():
            body = (part if sent == 0 else b"") + b"\0" * (256 * 1024)
            sock.sendall(b"%x\r\n" % len(body) + body + b"\r\n")
            sent += len(body)
    except OSError:
        pass
    done.wait(30)
    time.sleep(0.2)
    sock.close()
    text = got.decode("latin-1")
    status = int(text.split()[1]) if text.startswith("HTTP/1.1") else 0
    body = text.split("\r\n\r\n", 1)[-1]
    msg = body[body.find("{"):body.rfind("}") + 1]
    return status, sent / MB, json.loads(msg).get("error", "") if msg else ""


def build_index(root: Path) -> Path:
    gal = root / "gallery"
    for c in sorted(os.listdir(CALTECH))[:4]:
        (gal / c).mkdir(parents=True)
        for f in sorted(os.listdir(CALTECH / c))[:6]:
            shutil.copy(CALTECH / c / f, gal / c / f)
    out = root / "idx"
    subprocess.run([sys.executable, "-m", "indexer", "build", str(gal), "--out", str(out), "--quiet"],
                   env=ENV, cwd=REPO, check=True, capture_output=True)
    return out


_QUERY: list[bytes] = []


def start_app(idx: Path, root: Path, extra: list[str] | None = None, seed_leftover: bool = False
              ) -> tuple[str, subprocess.Popen]:
    """app.py on ``idx`` (named probe) [+ ``extra`` args]; ``seed_leftover`` puts a 10 MB file in
    the app's own temp folder first (a killed server's upload), which start-up should remove."""
    port = _free_port()
    if seed_leftover:
        from serving.tempdir import app_temp_dir

        folder = app_temp_dir(port, root / "gradio-tmp")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tmpleftover").write_bytes(b"\0" * 10_485_760)
    log = open(root / "server.log", "a")
    proc = subprocess.Popen([sys.executable, str(REPO / "app.py"), "--index", str(idx), "--name", "probe",
                             *(extra or []),
                             "--port", str(port), "--auth", ":".join(AUTH), "--max-upload-mb", "1"],
                            env={**ENV, "GRADIO_TEMP_DIR": str(root / "gradio-tmp")}, cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/api/health", auth=AUTH, timeout=2).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("app.py did not start:\n" + (root / "server.log").read_text()[-2000:])


def health(url: str) -> int:
    try:
        return httpx.get(f"{url}/api/health", auth=AUTH, timeout=10).status_code
    except httpx.HTTPError:
        return 0


def server_probes(url: str, idx: Path, root: Path) -> list[tuple[str, str, str]]:
    rows = []
    photo = str(next((idx.parent / "gallery").rglob("*.jpg")))
    with httpx.Client(timeout=30) as c:             # the baseline: a real upload, then a search on it
        c.post(f"{url}/login", data={"username": AUTH[0], "password": AUTH[1]})
        up = c.post(f"{url}/gradio_api/upload", files=[("files", ("q.jpg", Path(photo).read_bytes()))]).json()[0]
    gradio_search(url, up)                          # warm-up (the queue's first event)
    event, _, s = gradio_search(url, up)
    rows.append(("baseline: Gradio API `search` on a real upload", "results", f"`{event}` in {s:.2f} s"))
    for name, path in (("/dev/zero", "/dev/zero"), ("/etc/passwd", "/etc/passwd"), ("a gallery photo", photo)):
        event, msg, s = gradio_search(url, path)
        copied = any((root / "gradio-tmp").rglob(Path(path).name))
        rows.append((f"Gradio API `search` with FileData path = {name}", "refused within 1 s; nothing copied; server keeps answering",
                     f"`{event}` in {s:.2f} s ({msg[:60]}...); copied: {'yes' if copied else 'no'}; health {health(url)}"))
    with httpx.Client(timeout=30) as c:
        c.post(f"{url}/login", data={"username": AUTH[0], "password": AUTH[1]})
        r = c.get(f"{url}/gradio_api/file=/etc/passwd")
        rows.append(("GET `/gradio_api/file=/etc/passwd` (logged in)", "403/404", f"{r.status_code}"))
        r = c.post(f"{url}/gradio_api/upload", files=[("files", ("big.jpg", b"\xff" * int(1.5 * MB)))])
        rows.append(("Gradio upload of 1.5 MB (`--max-upload-mb 1`)", "413", f"{r.status_code}"))
    cred = base64.b64encode(":".join(AUTH).encode()).decode()
    st, sent, msg = chunked_post(url, 60 * MB, {})
    rows.append(("chunked 60 MB POST /api/search, no credentials", "401 before the body is read",
                 f"{st} after {sent:.1f} MB sent"))
    st, sent, msg = chunked_post(url, 60 * MB, {"Authorization": f"Basic {cred}"})
    rows.append(("chunked 60 MB POST /api/search, with credentials", "413 once past the 1 MB cap",
                 f"{st} after {sent:.1f} MB sent: \"{msg}\""))
    with httpx.Client(auth=AUTH, timeout=60) as c:
        r = c.post(f"{url}/api/search", files={"image": ("edge.jpg", b"\xff" * (MB + 100))})
        rows.append(("upload of 1 MB + 100 B", "413 naming two different sizes", f"{r.status_code}: \"{r.json()['error']}\""))
        r1 = c.post(f"{url}/api/search", data={"id": str(2 ** 64)})
        r2 = c.get(f"{url}/api/thumb/probe/{2 ** 64}")
        rows.append(("`id` = 2^64 on /api/search and /api/thumb", "404", f"{r1.status_code}, {r2.status_code}"))
        for what, r in (("GET /api/search", c.get(f"{url}/api/search")), ("GET /api/nope", c.get(f"{url}/api/nope")),
                        ("broken multipart body", c.post(f"{url}/api/search", content=b"x",
                                                         headers={"content-type": "multipart/form-data; boundary=z"}))):
            rows.append((what, '4xx `{"error": ...}`', f"{r.status_code} `{r.text[:70]}`"))
    codes = [httpx.get(f"{url}{p}", timeout=30).status_code for p in ("/openapi.json", "/docs")]
    rows.append(("GET /openapi.json, /docs without credentials", "not served", f"{codes[0]}, {codes[1]}"))
    return rows


def live_add_probe(url: str, idx: Path, root: Path) -> list[tuple[str, str, str]]:
    more = root / "more"
    for c in sorted(os.listdir(CALTECH))[10:14]:
        (more / c).mkdir(parents=True)
        for f in sorted(os.listdir(CALTECH / c))[:10]:
            shutil.copy(CALTECH / c / f, more / c / f)
    before = httpx.get(f"{url}/api/indexes", auth=AUTH, timeout=30).json()[0]["size"]
    codes: list[int] = []
    stop = threading.Event()
    query = next((idx.parent / "gallery").rglob("*.jpg")).read_bytes()

    def hammer() -> None:
        with httpx.Client(auth=AUTH, timeout=60) as c:
            while not stop.is_set():
                for call in (lambda: c.post(f"{url}/api/search", files={"image": ("q.jpg", query)}),
                             lambda: c.get(f"{url}/api/indexes"), lambda: c.get(f"{url}/api/health")):
                    try:
                        codes.append(call().status_code)
                    except httpx.HTTPError:
                        codes.append(0)

    t = threading.Thread(target=hammer, daemon=True)
    t.start()
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "indexer", "add", str(more), "--index", str(idx), "--prefix", "more/",
                    "--quiet"], env=ENV, cwd=REPO, check=True, capture_output=True)
    t_add = time.perf_counter() - t0
    after = before
    while after == before and time.perf_counter() - t0 < t_add + 60:
        after = httpx.get(f"{url}/api/indexes", auth=AUTH, timeout=30).json()[0]["size"]
        time.sleep(0.2)
    t_seen = time.perf_counter() - t0 - t_add
    stop.set()
    t.join(60)
    bad = sum(1 for c in codes if c != 200)
    rows = [(f"`indexer add` of 40 photos while a client searches", "no 5xx; new images served after the add",
             f"{len(codes)} requests, {bad} not 200; size {before} -> {after}, picked up {t_seen:.1f} s after the add ended")]
    faiss_file, manifest = idx / "index.faiss", idx / "manifest.json"
    good, good_m = faiss_file.read_bytes(), manifest.read_text()
    faiss_file.write_bytes(bytes(b ^ 0xFF for b in good[:4096]) + good[4096:])
    (idx / "m.tmp").write_text(good_m)
    os.replace(idx / "m.tmp", manifest)
    h = None
    for _ in range(100):
        h = httpx.get(f"{url}/api/health", auth=AUTH, timeout=30)
        if h.status_code != 200:
            break
        time.sleep(0.2)
    s = httpx.post(f"{url}/api/search", auth=AUTH, files={"image": ("q.jpg", query)}, timeout=60).status_code
    rows.append(("index.faiss damaged on disk (manifest rewritten) under a running app",
                 "health 503 with the reason; searches go on on the previous state",
                 f"health {h.status_code}: \"{h.json().get('error', '')[:90]}...\"; search {s}"))
    faiss_file.write_bytes(good)
    (idx / "m.tmp").write_text(good_m)
    os.replace(idx / "m.tmp", manifest)
    return rows


def damage_probes(idx: Path, root: Path) -> list[tuple[str, str, str]]:
    rows = []
    query = str(next((idx.parent / "gallery").rglob("*.jpg")))
    cases = {"truncated store.lmdb/data.mdb": ("store.lmdb/data.mdb", lambda p: os.truncate(p, p.stat().st_size // 2)),
             "garbage store.lmdb/data.mdb": ("store.lmdb/data.mdb", lambda p: p.write_bytes(os.urandom(p.stat().st_size))),
             "truncated index.faiss": ("index.faiss", lambda p: os.truncate(p, p.stat().st_size // 2)),
             "missing model.onnx": ("model.onnx", lambda p: p.unlink())}
    for name, (rel, fn) in cases.items():
        d = root / "damaged"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(idx, d, ignore=shutil.ignore_patterns("lock.mdb"))
        fn(d / rel)
        obs = []
        for cmd in (["-m", "indexer", "info", "--index", str(d)], ["-m", "indexer", "search", query, "--index", str(d)],
                    [str(REPO / "app.py"), "--index", str(d), "--port", str(_free_port())]):
            label = "app.py" if cmd[0].endswith("app.py") else cmd[2]
            try:
                p = subprocess.run([sys.executable, *cmd], env=ENV, cwd=REPO, capture_output=True, text=True,
                                   timeout=120)
            except subprocess.TimeoutExpired:       # it started serving the damaged index
                obs.append(f"{label}: still running after 120 s")
                continue
            lines = p.stderr.strip().splitlines()
            named = bool(lines) and Path(rel).name in lines[0] and "indexer build" in lines[0]
            obs.append(f"{label}: exit {p.returncode}, {len(lines)} line{'s' if len(lines) != 1 else ''}"
                       + (", names file + repair" if named else ", does NOT name file + repair"))
        msg = lines[0].split(": ", 2)[-1] if lines else ""
        rows.append((name, "exit 1, one line naming the file and `indexer build`; never a signal",
                     "; ".join(obs) + f" (app.py: \"...{msg[-110:]}\")"))
    return rows


# ---------------------------------------------------------------- issue 19, part B
def _files(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if p.is_file()}


def _raw(url: str) -> socket.socket:
    u = urlparse(url)
    return socket.create_connection((u.hostname, u.port), timeout=30)


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
        sock = _raw(url)
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
    sock = _raw(url)                         # 401, then keep pushing the chunked body
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
        sock = _raw(url)
        sock.sendall(head)
        t0, got, closed = time.perf_counter(), b"", False
        while time.perf_counter() - t0 < 40:
            try:
                sock.sendall(b"a")
                sock.settimeout(1)
                d = sock.recv(4096)
                got += d
                if not d:
                    closed = True
                    break
            except socket.timeout:
                continue
            except OSError:
                closed = True
                break
        sock.close()
        rows.append((what, "dropped within ~10 s", (f"closed after {time.perf_counter() - t0:.0f} s"
                                                     + (f" ({got.split(b' ')[1].decode()})" if got else ""))
                     if closed else "still open after 40 s"))
    return rows


def api_limit_probes(url: str) -> list[tuple[str, str, str]]:
    rows = []
    with httpx.Client(timeout=120) as c:
        c.post(f"{url}/login", data={"username": AUTH[0], "password": AUTH[1]})
        ids = httpx.get(f"{url}/api/indexes", auth=AUTH).json()
        r0 = httpx.post(f"{url}/api/search", auth=AUTH, files={"image": ("q.jpg", _QUERY[0])}, data={"k": "1"})
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


def store_damage_probe(idx: Path, root: Path) -> list[tuple[str, str, str]]:
    """data.mdb truncated under a running app serving it and a second index; then rebuilt."""
    victim = root / "victim"
    shutil.rmtree(victim, ignore_errors=True)
    shutil.copytree(idx, victim, ignore=shutil.ignore_patterns("lock.mdb"))
    url, proc = start_app(idx, root, extra=["--index", str(victim), "--name", "victim"])
    try:
        q = {"image": ("q.jpg", _QUERY[0])}
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
            h2 = health(url)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        idx = build_index(root)
        _QUERY.append(next((idx.parent / "gallery").rglob("*.jpg")).read_bytes())
        url, proc = start_app(idx, root, seed_leftover=True)
        try:
            seeded = next((root / "gradio-tmp").rglob("das-retrieval-app-*")) / "tmpleftover"
            rows = (server_probes(url, idx, root) + upload_leftover_probes(url, root, seeded)
                    + login_page_probe(url, idx) + connection_probes(url) + api_limit_probes(url)
                    + live_add_probe(url, idx, root) + throttle_probe(url))
        finally:
            proc.terminate()            # by PID: the server this script started
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        rows += store_damage_probe(idx, root)
        rows += damage_probes(idx, root)
    load = os.getloadavg()[0]
    text = ("Command: `python benchmarks/reliability_probes.py`  \n"
            f"Server: `app.py --auth ... --max-upload-mb 1` on 127.0.0.1, 24-photo index (4 Caltech-101 classes), "
            f"pretrained embedder; load average {load:.1f} at the end (2 shared cores).\n\n"
            "| probe | expected | observed |\n| --- | --- | --- |\n"
            + "".join(f"| {a_} | {b} | {c.replace('|', '/')} |\n" for a_, b, c in rows))
    print(text)
    if not a.no_write:
        (REPO / "benchmarks" / "RESULTS-reliability.md").write_text("# Reliability probes (benchmarks/reliability_probes.py)\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
