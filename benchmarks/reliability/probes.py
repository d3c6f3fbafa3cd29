"""The hostile-but-fair probes of issue 13, run against a real `python app.py`; one table row each.

    python -m benchmarks.reliability.probes [--out PATH]

Builds a small index (4 Caltech-101 classes x 6 photos from ../shared/data, the offline
pretrained embedder) in a temporary folder, serves it on a free 127.0.0.1 port with --auth and
--max-upload-mb 1 (stopped by PID at the end), and records for each probe what was expected and
what was observed (status, seconds, bytes read). Then damages copies of the index and runs the
CLI and app.py startup on them. Prints the table; writes it to a file only with --out (e.g.
bench_out/reliability.md, git-ignored). The kept figures are in RELIABILITY.md ("Probes").
Decode memory has its own script (benchmarks/embedder/decode_memory.py).
"""
from __future__ import annotations

import argparse
import base64
import json
import os
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

from embedder.cli import run_main

REPO = Path(__file__).resolve().parents[2]
PROG = "python -m benchmarks.reliability.probes"
from benchmarks.reliability import guard_probes   # issue 19's server-guard probes
from benchmarks.reliability import index_probes   # issue 28: sharded index, hostile files
from benchmarks.reliability import client_probes  # issue 28: XFF, Host, streams, icons
from benchmarks.reliability import round4_probes  # issue 39: names, DBA, weights, ...
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

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help="also write the table to this Markdown file (default: print only; the kept "
                        "figures are in RELIABILITY.md)")
    p.add_argument("--no-write", action="store_true", help=argparse.SUPPRESS)  # the default now; old commands
    return run_main(PROG, p, argv, handler=run)


def run(args: argparse.Namespace) -> int | None:
    a = args
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        idx = build_index(root)
        _QUERY.append(next((idx.parent / "gallery").rglob("*.jpg")).read_bytes())
        url, proc = start_app(idx, root, seed_leftover=True)
        try:
            seeded = next((root / "gradio-tmp").rglob("das-retrieval-app-*")) / "tmpleftover"
            rows = (server_probes(url, idx, root) + guard_probes.upload_leftover_probes(url, root, seeded)
                    + guard_probes.login_page_probe(url, idx) + guard_probes.connection_probes(url)
                    + guard_probes.api_limit_probes(url, _QUERY[0])
                    + live_add_probe(url, idx, root) + decode_probes(url, proc, root)
                    + client_probes.container_upload_probes(url, proc, root)
                    + client_probes.webp_burst_probe(url, proc, root)
                    + client_probes.stream_probes(url) + client_probes.host_header_probe(url, _QUERY[0])
                    + guard_probes.throttle_probe(url)       # last: it locks this client's address out
                    + client_probes.forwarded_for_probe(url))   # (and this one needs it locked out)
        finally:
            proc.terminate()            # by PID: the server this script started
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        rows += client_probes.proxy_server_probes(idx, root, start_app)
        rows += guard_probes.store_damage_probe(idx, root, start_app, _QUERY[0])
        rows += damage_probes(idx, root)
        rows += writer_probes(idx, root)
        rows += index_probes.round3_rows(idx, root, start_app, AUTH)
        rows += round4_probes.all_rows(root / "round4")   # issue 39: its own files and small model
    load = os.getloadavg()[0]
    text = ("Command: `python -m benchmarks.reliability.probes`  \n"
            f"Server: `app.py --auth ... --max-upload-mb 1` on 127.0.0.1, 24-photo index (4 Caltech-101 classes), "
            f"pretrained embedder; load average {load:.1f} at the end (2 shared cores).\n\n"
            "| probe | expected | observed |\n| --- | --- | --- |\n"
            + "".join(f"| {a_} | {b} | {c.replace('|', '/')} |\n" for a_, b, c in rows))
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text("# Reliability probes (benchmarks/reliability/probes.py)\n\n" + text)
    return 0


# ---- issue 19, part A: decoding bounded for every format; one writer per index directory ----
def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def decode_probes(url: str, proc: subprocess.Popen, root: Path) -> list[tuple[str, str, str]]:
    """The issue's upload: a small 6300 x 6300 RGBA PNG (under the pixel cap), 4 at once; the
    server's peak RSS above its level before (its high-water mark reset through clear_refs) and
    RSS 10 s later. Then a 6300 x 6300 WebP, which costs more than the decode budget."""
    import numpy as np
    from PIL import Image

    n = 6300
    ramp = (np.add.outer(np.arange(n), np.arange(n)) // 50 % 256).astype(np.uint8)
    png, webp = root / "big-rgba.png", root / "big.webp"
    Image.fromarray(np.dstack([ramp, ramp[::-1], ramp.T, 255 - ramp]), "RGBA").save(png, optimize=True)
    Image.fromarray(np.dstack([ramp, ramp[::-1], ramp.T]), "RGB").save(webp, quality=50)
    del ramp
    pid = proc.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")        # reset VmHWM to the current RSS
    before = _status_kb(pid, "VmRSS")
    codes: list[int] = []

    def one() -> None:
        with httpx.Client(auth=AUTH, timeout=300) as c:
            codes.append(c.post(f"{url}/api/search", files={"image": ("big.png", png.read_bytes())}).status_code)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    peak = _status_kb(pid, "VmHWM")
    time.sleep(10)
    after = _status_kb(pid, "VmRSS")
    rows = [(f"4 x {n}x{n} RGBA PNG ({png.stat().st_size / 1e3:.0f} KB) at once, /api/search",
             "all 200; server peak < +200 MB, < +50 MB 10 s later",
             f"{sorted(codes)}; peak +{(peak - before) / 1024:.0f} MB, +{(after - before) / 1024:.0f} MB 10 s later")]
    with httpx.Client(auth=AUTH, timeout=300) as c:
        r = c.post(f"{url}/api/search", files={"image": ("big.webp", webp.read_bytes())})
    rows.append((f"{n}x{n} WebP ({webp.stat().st_size / 1e3:.0f} KB), /api/search",
                 "413/415, one line naming the file, its size and the cap; decoded nothing",
                 f"{r.status_code}: \"{r.json().get('error', '')}\"; health {health(url)}"))
    return rows


def _copy_classes(dst: Path, first: int, n: int, per: int) -> Path:
    for c in sorted(os.listdir(CALTECH))[first:first + n]:
        (dst / c).mkdir(parents=True)
        for f in sorted(os.listdir(CALTECH / c))[:per]:
            shutil.copy(CALTECH / c / f, dst / c / f)
    return dst


def _cli(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "indexer", *map(str, args)], env=ENV, cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def _writer_copy(idx: Path, d: Path) -> Path:
    """A copy of the probe index for one writer probe (its LMDB lock file left behind)."""
    shutil.copytree(idx, d, ignore=shutil.ignore_patterns("lock.mdb"))
    return d


def _info(d: Path) -> str:
    """What `indexer info` and the count check say of ``d`` after a writer probe."""
    from indexer import check_counts

    return f"info exit {_cli('info', '--index', d).returncode}: {check_counts(d).message}"


def writer_probes(idx: Path, root: Path) -> list[tuple[str, str, str]]:
    """Two `indexer add` at once; kill -9 of the lock holder; an index whose counts disagree."""
    from indexer import holder, is_locked

    rows = []
    a = _copy_classes(root / "w-a", 20, 4, 10)
    b = _copy_classes(root / "w-b", 24, 4, 10)
    d = _writer_copy(idx, root / "w1")
    procs = [subprocess.Popen([sys.executable, "-m", "indexer", "add", str(f), "--index", str(d), "--quiet"],
                              env=ENV, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for f in (a, b)]
    outs = [p.communicate(timeout=600) for p in procs]
    codes = [p.returncode for p in procs]
    refusal = next((o[1].strip() for p, o in zip(procs, outs) if p.returncode == 1), "")
    rows.append(("two `indexer add` at once into one index",
                 "one exits 1 with one line naming the other's pid; the other's images all indexed; info exit 0",
                 f"exit codes {codes}; \"{refusal.replace(str(d), 'DIR')}\" ({len(refusal.splitlines())} line); "
                 + _info(d)))
    d = _writer_copy(idx, root / "w2")
    p = subprocess.Popen([sys.executable, "-m", "indexer", "add", str(a), "--index", str(d), "--quiet"],
                         env=ENV, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (is_locked(d) and (holder(d) or {}).get("pid") == p.pid) and p.poll() is None:
        time.sleep(0.02)
    p.kill()                                        # SIGKILL, by PID: the add this script started
    p.wait()
    nxt = _cli("add", b, "--index", d, "--quiet")
    rows.append(("kill -9 of an `indexer add` holding the lock",
                 "the lock goes with it; the next writer proceeds; counts agree after it",
                 f"killed: exit {p.returncode}; next add exit {nxt.returncode}; " + _info(d)))
    d = _writer_copy(idx, root / "w3")
    damage = ("import hashlib, sys\nfrom indexer import GalleryStore\nfrom indexer.store.gallery import NewItem\n"
              "with GalleryStore(sys.argv[1], readonly=False) as st:\n    m = st.models()[0]; i = int(st.ids()[0])\n"
              "    data = st.get_bytes(i) + b'x'\n    st.put_items([NewItem('x/x.jpg', 'x', data, "
              "hashlib.sha256(data).hexdigest(), 1, 1)], st.get_embeddings(m, [i]), m)\n")
    subprocess.run([sys.executable, "-c", damage, str(d / "store.lmdb")], env=ENV, cwd=REPO, check=True)
    info = _cli("info", "--index", d)
    lines = info.stderr.strip().splitlines()
    fixed = _cli("repair", "--index", d, "--quiet")
    rows.append(("store holds an image index.faiss lacks (a writer died between the two)",
                 "`indexer info` exit 1, one line naming the counts and `indexer repair`; repair fixes it",
                 f"info exit {info.returncode}, {len(lines)} line: \"{(lines or [''])[0].replace(str(d), 'DIR')}\"; "
                 f"repair exit {fixed.returncode}, then info exit {_cli('info', '--index', d).returncode}"))
    return rows


if __name__ == "__main__":
    sys.exit(main())
