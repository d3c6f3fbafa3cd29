"""Bounded load on the HTTP search endpoint, next to bare Searcher.search calls in the same run.

    python -m benchmarks.serving.serve_load [--index DIR] [--clients 8] [--duration 30] [--rounds 3] [-k 10]

Starts `python app.py` on a free 127.0.0.1 port (stopped by PID at the end), then measures:
  * bare      Searcher.search in this process, 1 thread and --clients threads (the baseline);
  * http      POST /api/search with 1 client and --clients concurrent clients for --duration s.
Queries are real gallery images (bytes from the index's LMDB store), uploaded round robin.
Reports errors, p50/p99 latency and queries/s, and p50 ratios http/bare at equal concurrency
(the goal: within 1.5x). Prints the table; writes it only with --out PATH (e.g.
bench_out/serving.md, git-ignored). Kept figures: docs/benchmarks/serving.md.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from embedder.cli import UsageError, run_main

REPO = Path(__file__).resolve().parents[2]
PROG = "python -m benchmarks.serving.serve_load"


def _show(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        return str(p)


def start_app(index_dir: Path, root: Path = REPO) -> tuple[subprocess.Popen, str]:
    """``root``'s app.py serving ``index_dir`` on a free 127.0.0.1 port: (process, url). The
    caller stops it by PID (:func:`stop_app`); :func:`wait_healthy` waits for it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(root / "app.py"), "--index", str(index_dir), "--port", str(port)],
                            cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(root), "GRADIO_ANALYTICS_ENABLED": "False"})
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, url: str, seconds: float = 180) -> str | None:
    """None once GET /api/health answers 200, else why not (the app exited, or the time ran out)."""
    import httpx

    deadline = time.monotonic() + seconds
    while proc.poll() is None:
        try:
            if httpx.get(f"{url}/api/health", timeout=2).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            return f"app.py did not start in {seconds:.0f} s"
        time.sleep(0.5)
    return f"app.py exited with {proc.returncode}"


def stop_app(proc: subprocess.Popen) -> None:
    proc.terminate()                # by PID: the server this script started
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_load(fn, images: list, clients: int, duration: float) -> dict:
    """``clients`` threads call fn(image) back to back for ``duration`` s, ``images`` round robin;
    returns stats (a false answer or an exception counts as an error, not as a latency)."""
    lat: list[list[float]] = [[] for _ in range(clients)]
    errors = [0] * clients
    stop = time.perf_counter() + duration

    def worker(i: int) -> None:
        j = i
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            try:
                ok = fn(images[j % len(images)])
            except Exception:
                ok = False
            dt = time.perf_counter() - t0
            if ok:
                lat[i].append(dt)
            else:
                errors[i] += 1
            j += clients

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"clients": clients, "lat_ms": [1000 * x for row in lat for x in row],
            "errors": sum(errors), "seconds": wall}


def merge(runs: list[dict]) -> dict:
    """Pool the latencies of several runs; queries/s = all queries / all wall time."""
    lat = np.array([x for r in runs for x in r["lat_ms"]])
    n, wall = len(lat), sum(r["seconds"] for r in runs)
    return {"clients": runs[0]["clients"], "n": n, "errors": sum(r["errors"] for r in runs), "seconds": wall,
            "p50": float(np.percentile(lat, 50)) if n else float("nan"),
            "p99": float(np.percentile(lat, 99)) if n else float("nan"), "qps": n / wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", type=Path, default=None,
                    help="index directory (default: the demo index, built once under indexes/demo)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent HTTP clients (default 8)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load with --clients (default 30)")
    ap.add_argument("--baseline-duration", type=float, default=12.0,
                    help="seconds for each of the bare and single-client runs, over all rounds (default 12)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternate bare and HTTP runs this many times (default 3), splitting the durations")
    ap.add_argument("-k", "--k", type=int, default=10, help="results per query (default 10)")
    ap.add_argument("--images", type=int, default=32, help="distinct gallery images used as queries (default 32)")
    ap.add_argument("--out", type=Path, default=None,
                    help="also write the table to this Markdown file (default: print only; kept "
                         "figures: docs/benchmarks/serving.md)")
    ap.add_argument("--no-write", action="store_true", help="print only, even with --out")
    return run_main(PROG, ap, argv, handler=lambda args: run(args, argv))


def run(args: argparse.Namespace, argv: list[str] | None) -> int | None:
    if args.rounds < 1 or args.clients < 1 or args.duration <= 0 or args.baseline_duration <= 0 or not 1 <= args.k <= 1000:
        raise UsageError("--clients >= 1, durations > 0 and 1 <= -k <= 1000 expected")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

    import httpx

    from serving import Searcher, ensure_demo_index

    index_dir = args.index or ensure_demo_index(REPO / "indexes" / "demo")
    if not (index_dir / "manifest.json").is_file():
        print(f"serve_load: {index_dir}: not an index directory (no manifest.json)", file=sys.stderr)
        return 2
    searcher = Searcher.open([index_dir])
    store = searcher.index().store
    ids = store.ids()[: args.images]
    images = [store.get_bytes(int(i)) for i in ids]
    print(f"index {index_dir}: {len(searcher.index())} images; {len(images)} query images, k={args.k}",
          file=sys.stderr)

    def bare(data: bytes) -> bool:
        return len(searcher.search(data, args.k).results) > 0

    for d in images[:4]:
        bare(d)  # warm-up: session initialisation

    proc, url = start_app(index_dir)
    parts: dict[str, list[dict]] = {k: [] for k in ("bare1", "bareN", "http1", "httpN")}
    try:
        if (why := wait_healthy(proc, url)) is not None:
            print(f"serve_load: {why}", file=sys.stderr)
            return 1
        local = threading.local()

        def http(data: bytes) -> bool:
            c = getattr(local, "client", None)
            if c is None:
                c = local.client = httpx.Client(timeout=60)
            r = c.post(f"{url}/api/search", files={"image": ("q.jpg", data)}, data={"k": str(args.k)})
            return r.status_code == 200 and len(r.json()["results"]) > 0

        for d in images[:4]:
            http(d)
        # The cores are shared with other work, so bare and HTTP runs alternate in rounds and
        # each side sees the same background load on average.
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
            parts["bare1"].append(run_load(bare, images, 1, args.baseline_duration / args.rounds))
            parts["http1"].append(run_load(http, images, 1, args.baseline_duration / args.rounds))
            parts["bareN"].append(run_load(bare, images, args.clients, args.baseline_duration / args.rounds))
            parts["httpN"].append(run_load(http, images, args.clients, args.duration / args.rounds))
    finally:
        stop_app(proc)
    rows = [("bare Searcher.search", merge(parts["bare1"])),
            (f"bare Searcher.search, {args.clients} threads", merge(parts["bareN"])),
            ("HTTP POST /api/search, 1 client", merge(parts["http1"])),
            (f"HTTP POST /api/search, {args.clients} clients", merge(parts["httpN"]))]

    cmd = " ".join(["python -m benchmarks.serving.serve_load", *(argv if argv is not None else sys.argv[1:])])
    r1 = rows[2][1]["p50"] / rows[0][1]["p50"]
    rn = rows[3][1]["p50"] / rows[1][1]["p50"]
    lines = [
        "## Serving: HTTP load vs bare Searcher.search",
        "",
        f"Command: `{cmd}`  ",
        f"Index: {len(store.ids())} images ({_show(index_dir)}), k={args.k}; machine: {os.cpu_count()} cores "
        f"(shared), CPU onnxruntime + faiss; all on 127.0.0.1.",
        "",
        "| run | clients | queries | errors | p50 ms | p99 ms | queries/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        *[f"| {name} | {s['clients']} | {s['n']} | {s['errors']} | {s['p50']:.1f} | {s['p99']:.1f} | {s['qps']:.1f} |"
          for name, s in rows],
        "",
        f"p50 ratio HTTP / bare at 1 client: **{r1:.2f}x**; at {args.clients} concurrent: **{rn:.2f}x** "
        f"(goal: within 1.5x). Errors under load: **{rows[3][1]['errors']}** (goal 0).",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out is not None and not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
