"""Past one machine: the driver's one walk, and the streaming build against today's merge.

Run from the repository root, under ``nice -n 10`` (the machine is shared):

    python -m benchmarks.scaling.scale_bench walk --files 1000000 --shards 8
    python -m benchmarks.scaling.scale_bench stream --sizes 1000000,2000000 --baseline-up-to 2000000
    python -m benchmarks.scaling.scale_bench stream --sizes 10000000 --baseline-up-to 0

``walk`` makes a synthetic tree of empty ``.jpg`` files (1,000 per folder) and times, each in
its own process (peak RSS is that process's ``ru_maxrss``): what the build did before (every
shard task walks the whole gallery and keeps its share by path hash, and the driver walks it
once more for the progress bar: S + 1 walks) and after (one walk on the driver writing the S
lists, and a task reading its own list). ``stream`` is documented in its own function.
Figures are printed as a Markdown table; ratios against a baseline of the same run are what
counts on these shared cores.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.scaling import serve_stages, stream_stages
from benchmarks.scaling.procmem import peak_rss_mib

REPO = Path(__file__).resolve().parents[2]


def child(fn: str, *args: str) -> dict:
    """Run ``fn`` of this file in a fresh process; its JSON result (time, peak RSS)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-m", "benchmarks.scaling.scale_bench", "_child", fn, *args], capture_output=True,
                       text=True, env=env, cwd=REPO)
    if p.returncode != 0:
        raise SystemExit(f"{fn} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- walk
def make_tree(root: Path, n: int, per_dir: int = 1000) -> None:
    from tqdm import tqdm

    for s in tqdm(range(0, n, per_dir), desc="making the tree", unit="folder"):
        d = root / f"c{s // per_dir:05d}"
        d.mkdir(parents=True, exist_ok=True)
        for j in range(min(per_dir, n - s)):
            os.close(os.open(d / f"{j:04d}.jpg", os.O_CREAT | os.O_WRONLY, 0o644))


def _task_walk(root: str, shard: str, n: str) -> dict:
    """Before: one shard task's walk (the whole gallery, its share kept by path hash)."""
    from embedder import walk_gallery
    from indexer.store.walk import shard_of

    t0 = time.perf_counter()
    kept = sum(1 for f in walk_gallery(root) if shard_of(f.relpath, int(n)) == int(shard))
    return {"seconds": time.perf_counter() - t0, "files": kept, "rss_mib": peak_rss_mib()}


def _count_walk(root: str) -> dict:
    """Before: the driver's own walk, counting files for the progress bar."""
    from embedder import walk_gallery

    t0 = time.perf_counter()
    n = sum(1 for _ in walk_gallery(root))
    return {"seconds": time.perf_counter() - t0, "files": n, "rss_mib": peak_rss_mib()}


def _split(root: str, lists_dir: str, n: str) -> dict:
    """After: the driver's one walk, writing the S lists."""
    from indexer.store.walk import split_walk

    lists = [Path(lists_dir) / str(i) / "files.jsonl" for i in range(int(n))]
    for p in lists:
        p.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    counts = split_walk(root, lists)
    return {"seconds": time.perf_counter() - t0, "files": sum(counts), "rss_mib": peak_rss_mib(),
            "list_mib": sum(p.stat().st_size for p in lists) / 2 ** 20}


def _read_list(root: str, path: str) -> dict:
    """After: a shard task reading its own list (what a retry repeats)."""
    from indexer.store.walk import read_file_list

    t0 = time.perf_counter()
    n = sum(1 for _ in read_file_list(root, path))
    return {"seconds": time.perf_counter() - t0, "files": n, "rss_mib": peak_rss_mib()}


def bench_walk(files: int, shards: int, keep: Path | None) -> list[str]:
    tmp = Path(tempfile.mkdtemp(prefix="walk-bench-"))
    try:
        root = keep or tmp / "gallery"
        if not (root.exists() and any(root.iterdir())):
            make_tree(root, files)
        for _ in range(2):         # warm the dentry cache, as a long build would find it
            child("_count_walk", str(root))
        before_task = child("_task_walk", str(root), "0", str(shards))
        before_count = child("_count_walk", str(root))
        after_split = child("_split", str(root), str(tmp / "lists"), str(shards))
        after_read = child("_read_list", str(root), str(tmp / "lists" / "0" / "files.jsonl"))
        before_total = shards * before_task["seconds"] + before_count["seconds"]
        after_total = after_split["seconds"] + shards * after_read["seconds"]
        return [
            f"Walk of a synthetic tree of {before_count['files']:,} empty .jpg files (1,000 per folder, "
            f"warm dentry cache), {shards} shards; each row its own process; load average "
            f"{os.getloadavg()[0]:.1f}. Command: `python -m benchmarks.scaling.scale_bench walk --files {files} "
            f"--shards {shards}`.", "",
            "| stage | files | seconds | peak RSS MiB |", "|---|---:|---:|---:|",
            f"| before: one shard task's walk (whole tree, keeps 1/{shards}) | {before_task['files']:,} | "
            f"{before_task['seconds']:.1f} | {before_task['rss_mib']:.0f} |",
            f"| before: the driver's counting walk | {before_count['files']:,} | {before_count['seconds']:.1f} | "
            f"{before_count['rss_mib']:.0f} |",
            f"| before: total walking ({shards} tasks + driver; {shards + 1} walks of the tree) | | "
            f"{before_total:.1f} | |",
            f"| after: the driver's one walk, writing {shards} lists ({after_split['list_mib']:.0f} MiB) | "
            f"{after_split['files']:,} | {after_split['seconds']:.1f} | {after_split['rss_mib']:.0f} |",
            f"| after: one shard task reading its list | {after_read['files']:,} | {after_read['seconds']:.1f} | "
            f"{after_read['rss_mib']:.0f} |",
            f"| after: total ({shards} list reads + 1 walk) | | {after_total:.1f} | |",
            f"| before / after, total seconds of tree walking and listing | | {before_total / after_total:.1f}x | |",
        ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------- streaming build
def bench_stream(n: int, shards: int, d: int, baseline: bool, work_root: Path | None,
                 index_type: str, nlist: int = 0, only_plan: bool = False) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="stream-bench-", dir=work_root))
    rows = []
    try:
        w, s = str(tmp), str(shards)
        gen = child("_gen", w, str(n), s, str(d))
        print(f"  generated {n:,} x {d} in {shards} shards: {gen}", flush=True)
        plan = child("_plan", w, s, index_type, str(nlist))
        print(f"  plan: {plan}", flush=True)
        if only_plan:
            return [{"n": n, "d": d, "shards": shards, "plan": plan, "load": os.getloadavg()[0]}]
        fills = [child("_fill", w, s, str(i)) for i in range(shards)]
        print(f"  fill: {fills}", flush=True)
        tune = child("_tune", w, s)
        print(f"  tune: {tune}", flush=True)
        merge = child("_merge", w, s)
        print(f"  merge: {merge}", flush=True)
        ev = child("_eval", w, s)
        print(f"  eval: {ev}", flush=True)
        row = {"n": n, "d": d, "shards": shards, "gen": gen, "plan": plan, "fill": fills,
               "tune": tune, "merge": merge, "eval": ev, "load": os.getloadavg()[0]}
        if baseline:
            row["same_type"] = child("_baseline_same", w, s)
            print(f"  one process, the stream's type: {row['same_type']}", flush=True)
            row["baseline"] = child("_baseline", w, s)
            print(f"  baseline: {row['baseline']}", flush=True)
        rows.append(row)
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_parity(n: int, shards: int, d: int, seeds: int, work_root: Path | None) -> list[dict]:
    """Streamed vs one process, same type, several seeds on the same shards: how far apart the
    two builds' fresh recall@10 lie next to how far each lies from itself across seeds (the
    seed draws the held-out tuning queries and the k-means sample of both)."""
    tmp = Path(tempfile.mkdtemp(prefix="parity-bench-", dir=work_root))
    rows = []
    try:
        w, s = str(tmp), str(shards)
        child("_gen", w, str(n), s, str(d))
        for seed in range(seeds):
            plan = child("_plan", w, s, "auto", "0", str(seed))
            for i in range(shards):
                child("_fill", w, s, str(i))
            tune = child("_tune", w, s)
            child("_merge", w, s)
            ev = child("_eval", w, s)
            same = child("_baseline_same", w, s, str(seed))
            rows.append({"n": n, "seed": seed, "spec": plan["spec"], "stream_params": tune["params"],
                         "stream_recall": ev["recall_merged"], **{f"one_{k}": v for k, v in same.items()}})
            print(f"  seed {seed}: {rows[-1]}", flush=True)
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def parity_table(rows: list[dict], cmd: str) -> list[str]:
    import numpy as np

    out = [f"Streamed build vs one process of the same type, per seed (fresh recall@10, 1,000 "
           f"generated queries). Command: `{cmd}`.", "",
           "| n | seed | index | streamed: params, recall | one process: params, recall | one process at "
           "the streamed params | streamed - one process (own tuning) | streamed - one process (same params) |",
           "|---:|---:|---|---|---|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['n']:,} | {r['seed']} | {r['spec']} | {r['stream_params']}, {r['stream_recall']:.4f} | "
                   f"{r['one_params']}, {r['one_recall']:.4f} | {r['one_recall_at_stream_params']:.4f} | "
                   f"{r['stream_recall'] - r['one_recall']:+.4f} | "
                   f"{r['stream_recall'] - r['one_recall_at_stream_params']:+.4f} |")
    for key, name in (("stream_recall", "streamed"), ("one_recall", "one process")):
        v = np.array([r[key] for r in rows])
        out.append(f"\n{name}: mean {v.mean():.4f}, range {v.min():.4f}-{v.max():.4f} over {len(v)} seeds")
    return out


def plan_table(rows: list[dict], cmd: str) -> list[str]:
    out = [f"The driver's plan alone (census, held-out sets, exact answers, training), its own "
           f"process; peak RSS = `ru_maxrss`, anon = sampled peak `RssAnon`. Command: `{cmd}`.", "",
           "| n x d (shards) | index | plan s | peak RSS MiB | anon MiB | stage s |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        pl = r["plan"]
        st = ", ".join(f"{k} {v:.0f}" for k, v in pl["stages"].items())
        out.append(f"| {r['n']:,} x {r['d']} ({r['shards']}) | {pl['spec']} | {pl['seconds']:.0f} | "
                   f"{pl['rss_mib']:,.0f} | {pl['anon_mib']:,.0f} | {st} |")
    return out


def stream_table(rows: list[dict], cmd: str) -> list[str]:
    out = [f"Streaming build of low-rank synthetic vectors (`inputs.low_rank`) in shards, each "
           "stage its own process (peak RSS = `ru_maxrss`, which counts the memory-mapped shard "
           "and index pages too; anon = sampled peak `RssAnon`, the process's own memory); fresh "
           f"recall@10 on 1000 generated queries against exact search. Command: `{cmd}`.", "",
           "| n x d (shards) | index | plan s (RSS / anon MiB) | fill s per shard (RSS / anon) | "
           "tune s (RSS / anon) | merge s (RSS / anon) | index MiB | merge RSS / (1.5 x index + 1 GiB) "
           "| fresh recall@10 merged / sharded | one process, the stream's type: fresh recall@10 (its own "
           "tuning) / at the stream's parameters | q/s sharded / merged | today's merge s (RSS / anon), recall |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        pl, tu, me, ev = r["plan"], r["tune"], r["merge"], r["eval"]
        fill_s = max(f["seconds"] for f in r["fill"])
        fill_rss = max(f["rss_mib"] for f in r["fill"])
        fill_anon = max(f["anon_mib"] for f in r["fill"])
        goal = 1.5 * me["index_mib"] + 1024
        b = r.get("baseline")
        base = (f"{b['seconds']:.0f} ({b['rss_mib']:,.0f} / {b['anon_mib']:,.0f}), {b['recall']:.3f} "
                f"[{b['index']}]" if b else "-")
        st = r.get("same_type")
        same = (f"{st['recall']:.3f} ({st['params']}) / {st['recall_at_stream_params']:.3f}" if st else "-")
        out.append(f"| {r['n']:,} x {r['d']} ({r['shards']}) | {pl['spec']} ({tu['params']}) | "
                   f"{pl['seconds']:.0f} ({pl['rss_mib']:,.0f} / {pl['anon_mib']:,.0f}) | {fill_s:.0f} "
                   f"({fill_rss:,.0f} / {fill_anon:,.0f}) | {tu['seconds']:.0f} ({tu['rss_mib']:,.0f} / "
                   f"{tu['anon_mib']:,.0f}) | {me['seconds']:.0f} ({me['rss_mib']:,.0f} / {me['anon_mib']:,.0f}) | "
                   f"{me['index_mib']:,.0f} | {me['rss_mib'] / goal:.2f} | {ev['recall_merged']:.3f} / "
                   f"{ev['recall_sharded']:.3f} | {same} | {ev['qps_sharded'] / ev['qps_merged']:.2f}x | {base} |")
    return out


# ---------------------------------------------------------------------------- codes-only serving
def bench_serve(n: int, d: int, nlist: int, nprobe: int, codecs: list[str], work_root: Path | None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="serve-bench-", dir=work_root))
    try:
        gen = child("_serve_gen", str(tmp), str(n), str(d), str(nlist))
        print(f"  gallery: {gen}", flush=True)
        rows = []
        for mode in ["ram", *codecs]:
            rows.append(child("_serve", str(tmp), mode, str(nprobe)))
            print(f"  {rows[-1]}", flush=True)
        return {"n": n, "d": d, "nlist": nlist, "nprobe": nprobe, "gen": gen, "rows": rows,
                "load": os.getloadavg()[0]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def serve_table(r: dict, cmd: str) -> list[str]:
    base = r["rows"][0]
    out = [f"Serving {r['n']:,} x {r['d']} (IVF{r['nlist']},Flat, nprobe {r['nprobe']}; vectors "
           f"{r['gen']['vectors_mib']:,.0f} MiB, LMDB store {r['gen']['store_mib']:,.0f} MiB): each mode "
           "its own process, memory read from /proc/self/status after 4 batches of 1000 fresh "
           "queries (RssAnon: the process's own; RssFile: mapped pages of the store and index "
           f"files, which the kernel can drop). Load average {r['load']:.1f}. Command: `{cmd}`.", "",
           "| serving | load s | RssAnon MiB | RssFile MiB | VmRSS MiB | peak RSS MiB | RssAnon saved vs in-RAM "
           "/ vectors' size | recall@10 | q/s vs in-RAM |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        saved = (base["RssAnon"] - row["RssAnon"]) / r["gen"]["vectors_mib"]
        name = "whole IVF-Flat index in RAM" if row["mode"] == "ram" else f"{row['mode']} codes + re-rank of 10k from LMDB"
        out.append(f"| {name} | {row['load_seconds']:.1f} | {row['RssAnon']:,.0f} | {row['RssFile']:,.0f} | "
                   f"{row['VmRSS']:,.0f} | {row['peak_rss_mib']:,.0f} | {saved:.2f} | {row['recall']:.4f} | "
                   f"{row['qps'] / base['qps']:.2f}x |")
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "_child":
        stage = next(getattr(m, sys.argv[2]) for m in (sys.modules[__name__], stream_stages, serve_stages)
                     if hasattr(m, sys.argv[2]))
        print(json.dumps(stage(*sys.argv[3:])))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("walk", help="one walk on the driver vs one walk per shard task")
    w.add_argument("--files", type=int, default=1_000_000)
    w.add_argument("--shards", type=int, default=8)
    w.add_argument("--keep", type=Path, default=None, help="make (or reuse) the tree here, and keep it")
    st = sub.add_parser("stream", help="the streaming build in shards vs today's merge")
    st.add_argument("--sizes", default="1000000", help="gallery sizes, comma-separated")
    st.add_argument("--shards", type=int, default=4)
    st.add_argument("--dim", type=int, default=128)
    st.add_argument("--baseline-up-to", type=int, default=2_000_000,
                    help="also run today's merge at sizes up to this (it holds ~3 copies of the vectors)")
    st.add_argument("--index-type", default="auto")
    st.add_argument("--nlist", type=int, default=0,
                    help="IVF-Flat with this many lists instead of the measured choice (as `indexer "
                         "build --nlist`): k-means cost grows with nlist, a budget for 2 cores at 10M")
    st.add_argument("--work", type=Path, default=None, help="scratch folder (default: $TMPDIR)")
    st.add_argument("--only-plan", action="store_true",
                    help="generate and run the driver's plan only (its peak RSS against N)")
    pa = sub.add_parser("parity", help="streamed vs one process of the same type, over seeds")
    pa.add_argument("--size", type=int, default=1_000_000)
    pa.add_argument("--shards", type=int, default=4)
    pa.add_argument("--dim", type=int, default=128)
    pa.add_argument("--seeds", type=int, default=3)
    pa.add_argument("--work", type=Path, default=None, help="scratch folder (default: $TMPDIR)")
    sv = sub.add_parser("serve", help="a codes-only serving process (--max-memory) vs the index in RAM")
    sv.add_argument("--size", type=int, default=1_000_000)
    sv.add_argument("--dim", type=int, default=128)
    sv.add_argument("--nlist", type=int, default=1024)
    sv.add_argument("--nprobe", type=int, default=16)
    sv.add_argument("--codecs", default="SQ8,PQ32", help="codes to serve, comma-separated")
    sv.add_argument("--work", type=Path, default=None, help="scratch folder (default: $TMPDIR)")
    args = ap.parse_args()
    if args.cmd == "serve":
        import shlex

        r = bench_serve(args.size, args.dim, args.nlist, args.nprobe, args.codecs.split(","), args.work)
        print("\n".join(serve_table(r, "python -m benchmarks.scaling.scale_bench " + shlex.join(sys.argv[1:]))))
        print(json.dumps(r))
        return
    if args.cmd == "parity":
        import shlex

        rows = bench_parity(args.size, args.shards, args.dim, args.seeds, args.work)
        print("\n".join(parity_table(rows, "python -m benchmarks.scaling.scale_bench " + shlex.join(sys.argv[1:]))))
        print(json.dumps(rows))
        return
    if args.cmd == "stream":
        import shlex

        rows = []
        for n in (int(v) for v in args.sizes.split(",") if v):
            print(f"stream {n:,} ...", flush=True)
            rows += bench_stream(n, args.shards, args.dim, n <= args.baseline_up_to, args.work,
                                 args.index_type, args.nlist, args.only_plan)
        cmd = "python -m benchmarks.scaling.scale_bench " + shlex.join(sys.argv[1:])
        if args.only_plan:
            print("\n".join(plan_table(rows, cmd)))
            print(json.dumps(rows))
            return
        print("\n".join(stream_table(rows, cmd)))
        print(json.dumps(rows))
        return
    if args.cmd == "walk":
        print("\n".join(bench_walk(args.files, args.shards, args.keep)))


if __name__ == "__main__":
    main()
