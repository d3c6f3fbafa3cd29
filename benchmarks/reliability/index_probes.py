"""Issue 28's indexer probes (rows of `python -m benchmarks.reliability.probes`): a sharded
index held to the single index's promises, and the hostile files and machines of its notes.

Each row is (probe, expected, observed); ``observed`` starts with "UNEXPECTED:" when the check
written beside it fails, so a rerun's table shows a regression without reading every row.
Everything runs on copies in the probe script's temporary folder; servers bind 127.0.0.1 and
are stopped by PID; the full-disk probe mounts a small tmpfs in a private mount namespace
(root only) and the Ray probe runs in a private network namespace whose loopback is down.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import httpx

from benchmarks.inputs.lmdb_damage import garbage_inside

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "GRADIO_ANALYTICS_ENABLED": "False", "OMP_NUM_THREADS": "1"}
Row = tuple[str, str, str]


def _cli(*args: object, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "indexer", *map(str, args)], env=env or ENV, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _row(probe: str, expected: str, ok: bool, observed: str) -> Row:
    return probe, expected, ("" if ok else "UNEXPECTED: ") + observed


def _one_line(p: subprocess.CompletedProcess, *needles: str) -> tuple[bool, str]:
    lines = p.stderr.strip().splitlines()
    first = lines[0] if lines else ""
    ok = p.returncode == 1 and len(lines) == 1 and all(n in first for n in needles)
    return ok, f"exit {p.returncode}, {len(lines)} line{'s' if len(lines) != 1 else ''}"


def _outside() -> Path:
    """A folder sharing only "/" with the temp folder: shards there get absolute manifest keys."""
    tmp = Path(tempfile.gettempdir()).resolve().parts[1]
    for top in ("/dev/shm", "/var/tmp"):
        if os.access(top, os.W_OK) and Path(top).resolve().parts[1] != tmp:
            return Path(tempfile.mkdtemp(prefix="das-probe-", dir=top))
    return Path(tempfile.mkdtemp(prefix="das-probe-"))


# ---------------------------------------------------------------------------- the rows
def sharded_rows(idx: Path, root: Path, start_app: Callable, auth: tuple[str, str]) -> list[Row]:
    """A sharded (Flat) index of the probe gallery whose shards lie outside --out: redaction of
    its manifest keys, and --max-memory through the CLI and app.py."""
    gal = idx.parent / "gallery"
    out = _outside()
    rows = []
    try:
        for i in range(2):
            _cli("build", gal, "--shard", f"{i}/2", "--out", out / f"s{i}", "--quiet").check_returncode()
        sharded = root / "sharded"
        _cli("merge", "--sharded", out / "s0", out / "s1", "--out", sharded, "--quiet").check_returncode()
        keys = list(json.loads((sharded / "manifest.json").read_text())["sharded"]["files"])
        url, proc = start_app(idx, root, extra=["--index", str(sharded), "--name", "sharded",
                                                 "--max-memory", "60K"])
        try:
            text = httpx.get(f"{url}/api/indexes", auth=auth, timeout=60).text
            text += httpx.get(f"{url}/api/health", auth=auth, timeout=60).text
            listed = {i["name"]: i for i in httpx.get(f"{url}/api/indexes", auth=auth, timeout=60).json()}
            q = next(gal.rglob("*.jpg")).read_bytes()
            s = httpx.post(f"{url}/api/search", auth=auth, files={"image": ("q.jpg", q)},
                           data={"index": "sharded", "k": "3"}, timeout=60)
        finally:
            proc.terminate()
            proc.wait(30)
        leaks = re.findall(r'"(/[^"]*|\.\./[^"]*)"', text)
        rows.append(_row("sharded index (`merge --sharded` of shards outside --out) in GET /api/indexes",
                         "no server path, in keys or values", not leaks,
                         f"{len(leaks)} paths in the answers (the manifest keys {sum(k.startswith('/') for k in keys)} "
                         "files by absolute path)"))
        mem = (listed.get("sharded") or {}).get("memory") or {}
        p = _cli("search", next(gal.rglob("*.jpg")), "--index", sharded, "--max-memory", "60K", "-k", "3")
        ok = p.returncode == 0 and s.status_code == 200 and bool(mem)
        rows.append(_row("`--max-memory 60K` on a sharded Flat index: `indexer search`, app.py",
                         "answers from codes re-ranked from the stores; no traceback", ok,
                         f"search exit {p.returncode} ({len(p.stderr.strip().splitlines())} stderr lines); app.py "
                         f"search {s.status_code}, holds {mem.get('codes')} codes, {mem.get('memory_bytes')} bytes"))
        rows += ownership_rows(out, root, sharded)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return rows


def ownership_rows(out: Path, root: Path, sharded: Path) -> list[Row]:
    """A second `merge --sharded` over the same shard folders; health when a part was rewritten."""
    from indexer import check_counts

    before = (out / "s0" / "part.faiss").read_bytes()
    p = _cli("merge", "--sharded", out / "s0", out / "s1", "--out", root / "sharded2", "--quiet")
    ok, what = _one_line(p, "belongs to the sharded index")
    same = (out / "s0" / "part.faiss").read_bytes() == before
    rows = [_row("second `merge --sharded` over the shard folders of a served sharded index",
                 "exit 1, one line naming the index that owns the parts; parts untouched",
                 ok and same, f"{what}; parts untouched: {same}: \"...{p.stderr.strip()[-90:]}\"")]
    for i in range(2):                      # the refusal bypassed by hand: what health then says
        (out / f"s{i}" / "part.owner").unlink()
    _cli("merge", "--sharded", out / "s0", out / "s1", "--out", root / "sharded2", "--quiet",
         "--index-type", "flat").check_returncode()
    (out / "s0" / "part.faiss").write_bytes((out / "s0" / "part.faiss").read_bytes() + b"\0" * 64)
    try:
        check_counts(sharded)
        msg = "counts compared, no error"
    except Exception as e:      # noqa: BLE001 - what it says is the observation
        msg = str(e)
    ok = "overwritten since the sharded index" in msg and "counts differ" not in msg
    rows.append(_row("a served sharded index's part rewritten by another merge (refusal bypassed)",
                     "health names the rewritten part and how to rebuild, not a count mismatch", ok,
                     f"\"{msg.replace(str(out), 'SHARDS').replace(str(root), 'ROOT')[:150]}...\""))
    return rows


def store_garbage_rows(idx: Path, root: Path, start_app: Callable, auth: tuple[str, str]) -> list[Row]:
    """Garbage written inside a served data.mdb (size and meta pages intact)."""
    from indexer import Index

    d = root / "garbage-inside"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(idx, d, ignore=shutil.ignore_patterns("lock.mdb"))
    ix = Index.open(d)
    some = int(ix.store.all_embeddings(ix.model_hash)[0][0])
    ix.store.close()
    url, proc = start_app(idx, root, extra=["--index", str(d), "--name", "garbage"])
    try:
        def search() -> httpx.Response:
            return httpx.post(f"{url}/api/search", auth=auth, data={"index": "garbage", "id": str(some)}, timeout=60)

        before = search().status_code
        pages = garbage_inside(d / "store.lmdb" / "data.mdb")
        s, h = search(), httpx.get(f"{url}/api/health", auth=auth, timeout=60)
        alive = proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(30)
    deep = _cli("info", "--index", d, "--deep")
    ok_deep, what = _one_line(deep, "data.mdb: damaged")
    err = s.json().get("error", "") if s.headers.get("content-type", "").startswith("application/json") else s.text
    ok = before == 200 and s.status_code == 503 and "data.mdb: damaged" in err and h.status_code == 503 and alive
    return [_row(f"garbage inside a served data.mdb ({pages} pages, size and meta pages intact)",
                 "search and health 503 naming data.mdb; process alive; `info --deep` exit 1, one line",
                 ok and ok_deep, f"search before {before}, after {s.status_code}: \"{err[:80]}...\"; health "
                 f"{h.status_code}; alive: {alive}; info --deep {what}")]


def manifest_rows(idx: Path, root: Path) -> list[Row]:
    """A manifest field of the wrong type; a 100k-deep JSON manifest."""
    rows = []
    q = next((idx.parent / "gallery").rglob("*.jpg"))
    for name, edit in (("`\"nprobe\": \"abc\"` in manifest.json", lambda m: {**m, "nprobe": "abc"}),
                       ("a 100k-deep JSON as manifest.json", None)):
        d = root / "bad-manifest"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(idx, d, ignore=shutil.ignore_patterns("lock.mdb"))
        f = d / "manifest.json"
        f.write_text(json.dumps(edit(json.loads(f.read_text()))) if edit else "[" * 100_000 + "]" * 100_000)
        need = ("manifest.json", "'nprobe'") if edit else ("manifest.json", "nested too deep")
        obs, good = [], True
        for label, p in (("info", _cli("info", "--index", d)), ("search", _cli("search", q, "--index", d)),
                         ("app.py", subprocess.run([sys.executable, str(REPO / "app.py"), "--index", str(d), "--port",
                                                    str(_free_port())], env=ENV, cwd=REPO, capture_output=True,
                                                   text=True, timeout=300))):
            ok, what = _one_line(p, *need)
            good &= ok
            obs.append(f"{label}: {what}")
        last = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
        rows.append(_row(name, "info, search, app.py: exit 1, one line naming the file"
                         + (" and the key" if edit else ""), good,
                         "; ".join(obs) + f" (\"...{last[-80:]}\")"))
    return rows


FULL_DISK = r"""
mount -t tmpfs -o size="$SIZE" tmpfs "$MNT" || exit 77
"$PY" -m indexer build "$SMALL" --out "$MNT/idx" --quiet >/dev/null 2>&1 || exit 78
avail=$(df -k --output=avail "$MNT" | tail -1)
dd if=/dev/zero of="$MNT/fill" bs=1k count=$((avail - 200)) 2>/dev/null
stat -c %s "$MNT/idx/store.lmdb/data.mdb" > "$OUT/before"
"$PY" -m indexer add --index "$MNT/idx" "$BIG" --quiet 2> "$OUT/add.err"; echo $? > "$OUT/add.rc"
stat -c %s "$MNT/idx/store.lmdb/data.mdb" > "$OUT/after"
rm "$MNT/fill"
"$PY" -m indexer add --index "$MNT/idx" "$BIG" --quiet >/dev/null 2>&1; echo $? > "$OUT/resume.rc"
exit 0
"""


def full_disk_row(idx: Path, root: Path) -> list[Row]:
    """`indexer add` onto a disk with 200 KB free (a small tmpfs, private mount namespace)."""
    gal = idx.parent / "gallery"
    small, big, mnt, out = root / "fd-small", root / "fd-big", root / "fd-mnt", root / "fd-out"
    for d in (small, big, mnt, out):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    classes = sorted(p for p in gal.iterdir() if p.is_dir())
    shutil.copytree(classes[0], small / classes[0].name)
    for c in classes[1:]:
        shutil.copytree(c, big / c.name)
    if os.geteuid() != 0:
        return [("full disk during `indexer add`", "one line naming data.mdb and the space needed; the failed "
                 "write given back", "not run: mounting a small tmpfs needs root here")]
    size_kb = (idx / "model.onnx").stat().st_size // 1024 + 3072       # the index's model copy + 3 MB
    env = {**ENV, "MNT": str(mnt), "OUT": str(out), "PY": sys.executable, "SMALL": str(small), "BIG": str(big),
           "SIZE": f"{size_kb}k"}
    p = subprocess.run(["unshare", "-m", "sh", "-c", FULL_DISK], env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        return [_row("full disk during `indexer add`", "...", False, f"could not set up: exit {p.returncode}")]
    err = (out / "add.err").read_text().strip().splitlines()
    first = err[0] if err else ""
    given = (out / "after").read_text() == (out / "before").read_text()
    ok = ((out / "add.rc").read_text().strip() == "1" and len(err) == 1 and "no space left on device:" in first
          and "needs about" in first and given and (out / "resume.rc").read_text().strip() == "0")
    return [_row(f"full disk during `indexer add` ({size_kb // 1024} MB tmpfs, 200 KB free)",
                 "exit 1, one line: no space left on device, data.mdb, MB needed; data.mdb back to its size; "
                 "the same add resumes once space is freed", ok,
                 f"{len(err)} line: \"{first.replace(str(mnt), 'MNT')[20:170]}...\"; data.mdb back to its size: "
                 f"{given}; resume exit {(out / 'resume.rc').read_text().strip()}")]


def ray_row(idx: Path, root: Path) -> list[Row]:
    """`indexer build --ray local` where Ray could not reach its GCS (no loopback)."""
    if shutil.which("unshare") is None:
        return [("`build --ray local` without loopback", "one line, bounded time", "not run: no unshare(1)")]
    t0 = time.perf_counter()
    p = subprocess.run(["unshare", "-n", sys.executable, "-m", "indexer", "build", str(idx.parent / "gallery"),
                        "--out", str(root / "ray-idx"), "--ray", "local", "--quiet"], env=ENV, cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    dt = time.perf_counter() - t0
    ok, what = _one_line(p, "loopback", "GCS")
    return [_row("`indexer build --ray local` in a network namespace whose loopback is down",
                 "exit 1 within seconds, one line (was: \"Failed to connect to GCS\" every 30 s, forever)", ok,
                 f"{what} in {dt:.1f} s: \"{p.stderr.strip()[:110]}...\"")]


def symlink_row(idx: Path, root: Path) -> list[Row]:
    """A gallery whose class folders are symlinks to directories (and one link back up)."""
    gal, g = idx.parent / "gallery", root / "linked-gallery"
    shutil.rmtree(g, ignore_errors=True)
    g.mkdir()
    classes = sorted(p for p in gal.iterdir() if p.is_dir())
    for c in classes:
        (g / c.name).symlink_to(c, target_is_directory=True)
    (g / "zz-loop").symlink_to(g, target_is_directory=True)
    out = root / "linked-idx"
    shutil.rmtree(out, ignore_errors=True)
    p = _cli("build", g, "--out", out, "--quiet")
    n = sum(1 for c in classes for _ in c.glob("*.jpg"))
    m = json.loads((out / "manifest.json").read_text()) if p.returncode == 0 else {}
    report = [json.loads(x) for x in (out / "report.jsonl").read_text().splitlines()] if p.returncode == 0 else []
    loops = [r["path"] for r in report if "not followed" in r["reason"]]
    ok = m.get("count") == n and loops == ["zz-loop"]
    return [_row("`indexer build` of a gallery whose class folders are symlinks (+ a link back up)",
                 "linked folders indexed (as `find -L`); the loop named in the report, not walked", ok,
                 f"exit {p.returncode}; {m.get('count')} of {n} images indexed; report: {loops}")]


def round3_rows(idx: Path, root: Path, start_app: Callable, auth: tuple[str, str]) -> list[Row]:
    """Every row above, in order (called by probes.main after its own)."""
    return (sharded_rows(idx, root, start_app, auth) + store_garbage_rows(idx, root, start_app, auth)
            + manifest_rows(idx, root) + full_disk_row(idx, root) + ray_row(idx, root) + symlink_row(idx, root))
