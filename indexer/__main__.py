"""``python -m indexer``: build, add, remove, repair, search, eval, info, merge.

Every command prints a one-line reason to stderr and exits 1 on bad input (2 for bad usage).
The commands that write an index directory (build, add, remove, repair, merge) hold its writer
lock (:mod:`indexer.lock`): a second writer exits 1 naming the first one's pid, or waits with
``--wait``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_DIR = "indexes/default"


def _parser() -> argparse.ArgumentParser:
    from .faiss_index import DEFAULT_FLAT_THRESHOLD, INDEX_TYPES
    from .manifest import DEFAULT_TARGET_RECALL

    p = argparse.ArgumentParser(prog="python -m indexer",
                                description="LMDB gallery store + faiss index tuned to a recall target.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def index_opts(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--index-type", choices=INDEX_TYPES, default="auto",
                        help="auto (default): exact Flat below --flat-threshold images; above, the "
                             "fastest of a few types measured on a sample that reaches the target "
                             "recall within --max-memory. Any other value forces that type")
        sp.add_argument("--flat-threshold", type=int, default=DEFAULT_FLAT_THRESHOLD, metavar="N",
                        help=f"gallery size from which auto uses IVF (default {DEFAULT_FLAT_THRESHOLD})")
        sp.add_argument("--nlist", type=int, default=None, help="IVF lists (default: from the gallery size)")
        sp.add_argument("--target-recall", type=float, default=DEFAULT_TARGET_RECALL,
                        help="recall@10 vs exact search that nprobe is tuned to reach "
                             f"(default {DEFAULT_TARGET_RECALL})")
        sp.add_argument("--max-memory", default=None, metavar="SIZE",
                        help="memory budget for the index, e.g. 4G or 512M (default: no limit; "
                             "the build holds the gallery's vectors in memory anyway); index types "
                             "whose codes alone exceed it are not even built")
        sp.add_argument("--seed", type=int, default=0)

    shared = {      # the options several commands take, each defined once
        "--index": dict(type=Path, default=Path(DEFAULT_DIR), help=f"index directory (default {DEFAULT_DIR})"),
        "--device": dict(choices=("auto", "cpu", "cuda"), default="auto",
                         help="faiss/onnxruntime device (GPU when available with auto)"),
        "--quiet": dict(action="store_true", help="no progress bars"),
        "--batch-size": dict(type=int, default=32),
        "--workers": dict(type=int, default=None, help="image decoding threads"),
        "--json": dict(action="store_true", help="print JSON instead of a table"),
        "--wait": dict(action="store_true", help="if another process is writing this index directory, "
                       "wait for it to finish (default: exit 1 naming its pid)")}

    def opts(sp: argparse.ArgumentParser, *flags: str) -> argparse.ArgumentParser:
        for flag in flags:
            sp.add_argument(flag, **shared[flag])
        return sp

    b = sub.add_parser("build", help="ingest a gallery folder and build its index",
                       description="Walk GALLERY (labels = sub-folders), store and embed every image, "
                                   "build and tune the faiss index. Rerun to resume.")
    b.add_argument("gallery", type=Path)
    b.add_argument("--model", type=Path, default=None,
                   help="exported .onnx embedder (default: the offline pretrained ImageNet embedder, "
                        "embedder.pretrained.DEFAULT; `python -m embedder pretrained --help`)")
    b.add_argument("--int8", action="store_true",
                   help="embed with the int8 version of --model (default: of the default embedder), "
                        "quantised once on 256 of the gallery's images and cached in $DAS_CACHE/int8 "
                        "(`python -m embedder quantize --help`); the network runs ~2x as fast, "
                        "the whole build ~1.6x (BENCHMARKS.md)")
    b.add_argument("--out", type=Path, default=Path(DEFAULT_DIR), help=f"index directory (default {DEFAULT_DIR})")
    b.add_argument("--shard", default=None, metavar="i/n",
                   help="ingest and embed only shard i of n (0 <= i < n); combine with `merge`")
    _ray_arguments(opts(b, "--batch-size", "--workers"))
    index_opts(b)
    dba_opts(b)
    opts(b, "--device", "--quiet", "--wait")

    a = opts(sub.add_parser("add", help="add the images of a folder to an existing index"), "--index")
    a.add_argument("folder", type=Path)
    a.add_argument("--model", type=Path, default=None,
                   help="must be the model the index was built with (default: the index's copy)")
    a.add_argument("--prefix", default="", help="prefix for the stored relative paths (and labels)")
    opts(a, "--batch-size", "--workers", "--device", "--quiet", "--wait")

    r = sub.add_parser("remove", help="remove images by id or stored relative path")
    r.add_argument("targets", nargs="+", metavar="ID|PATH")
    opts(r, "--index", "--wait")

    opts(sub.add_parser("repair", help="bring index.faiss and the manifest in step with the store",
                        description="What `info` names when the store, index.faiss and the manifest "
                                    "disagree on the image count: embeds stored images the index's "
                                    "model has not embedded, adds/drops faiss vectors to match the "
                                    "store, retunes, rewrites the manifest. Needs no gallery folder."),
         "--index", "--batch-size", "--workers", "--device", "--quiet", "--wait")

    s = sub.add_parser("search", help="the k nearest gallery images of a query image")
    s.add_argument("image", type=Path)
    s.add_argument("-k", type=int, default=10)
    s.add_argument("--dba", choices=("auto", "on", "off"), default="auto",
                   help="DBA re-ranking (auto: on for an index built with --dba)")
    opts(s, "--index", "--json", "--device")
    serve_memory_opt(s)

    e = sub.add_parser("eval", help="Recall@k on a labelled query folder, or leave-one-out",
                       description="Recall@k of the index on a labelled query folder (photos the "
                                   "gallery does not hold: a held-out split; a query the gallery "
                                   "does hold is left out of its own results), or --leave-one-out: "
                                   "each labelled gallery item queries the others. For an index "
                                   "built with --dba both settings are reported; a query that is a "
                                   "gallery item is scored as if the gallery did not hold it (its "
                                   "neighbours' DBA vectors are rebuilt without it).")
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--queries", type=Path, help="query folder, one sub-folder per label")
    src.add_argument("--leave-one-out", action="store_true",
                     help="query with the gallery's own labelled items (their stored vectors)")
    e.add_argument("--max-queries", type=int, default=None, metavar="N",
                   help="with --leave-one-out: a random sample of N items (default: all)")
    e.add_argument("-k", type=int, nargs="+", default=[1, 2, 4, 8])
    e.add_argument("--dba", choices=("auto", "on", "off"), default="auto",
                   help="the figures' DBA setting (auto: as the index serves; the other setting is "
                        "reported beside them when the index has DBA)")
    opts(e, "--index", "--json", "--device")
    serve_memory_opt(e)

    i = sub.add_parser("info", help="what an index directory holds",
                       description="Prints what an index directory holds; exits 1 when the store, "
                                   "index.faiss and the manifest disagree on the image count "
                                   "(naming `indexer repair`).")
    opts(i, "--index", "--json")
    i.add_argument("--deep", action="store_true",
                   help="also read every record of the gallery store(s), values included, and "
                        "exit 1 naming the file if LMDB cannot read one (garbage inside data.mdb "
                        "that the cheap open-time checks cannot see; reads the whole store)")

    m = sub.add_parser("merge", help="merge shard directories into one index",
                       description="Train one IVF quantizer over all shards and merge their inverted lists.")
    m.add_argument("shards", type=Path, nargs="+", metavar="SHARD_DIR")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--sharded", action="store_true",
                   help="leave the shards where they are: train once on a sample of their stores, "
                        "give each shard its own part of the index, and write a manifest in --out "
                        "that lists them (searched as one; nothing is copied)")
    index_opts(m)
    dba_opts(m)
    opts(m, "--device", "--quiet", "--wait")
    return p


def dba_opts(sp: argparse.ArgumentParser) -> None:
    """``--dba`` and its parameters (indexer.neighbours), for build and merge."""
    from .neighbours import DEFAULT_ALPHA, DEFAULT_DEPTH, DEFAULT_K

    sp.add_argument("--dba", action="store_true",
                    help="database-side augmentation at serve time: each gallery vector is also "
                         "kept as the sim^alpha-weighted mean of its --dba-k nearest gallery "
                         "vectors (itself included) and searches re-rank their top candidates with "
                         "those (switchable per request; kept right by add/remove)")
    sp.add_argument("--dba-k", type=int, default=DEFAULT_K, metavar="K",
                    help=f"gallery vectors averaged, the item included (default {DEFAULT_K})")
    sp.add_argument("--dba-alpha", type=float, default=DEFAULT_ALPHA, metavar="A",
                    help=f"neighbour weight = similarity^A (default {DEFAULT_ALPHA:g})")
    sp.add_argument("--dba-depth", type=int, default=DEFAULT_DEPTH, metavar="N",
                    help=f"plain candidates re-ranked per query (default {DEFAULT_DEPTH})")


def dba_params(args: argparse.Namespace) -> object:
    """The --dba flags as a DbaParams (None without --dba; the parameters alone are refused)."""
    from .neighbours import DEFAULT_ALPHA, DEFAULT_DEPTH, DEFAULT_K, DbaParams

    if not args.dba:
        if (args.dba_k, args.dba_alpha, args.dba_depth) != (DEFAULT_K, DEFAULT_ALPHA, DEFAULT_DEPTH):
            raise ValueError("--dba-k/--dba-alpha/--dba-depth need --dba")
        return None
    return DbaParams(args.dba_k, args.dba_alpha, args.dba_depth)


def _ray_arguments(b: argparse.ArgumentParser) -> None:
    """``indexer build``'s Ray options (``indexer.ray_build``)."""
    b.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS|auto|local",
                   help="build the shards as Ray tasks and merge them: `local` starts Ray on this "
                        "machine, `auto` joins the cluster `ray start` runs here, HOST:PORT a head "
                        "node. Gallery and --out must be paths every node can read")
    b.add_argument("--shards", type=int, default=None, metavar="N",
                   help="with --ray: shard count (default: one per GPU of the cluster, else one per node)")
    b.add_argument("--max-retries", type=int, default=3, metavar="N",
                   help="with --ray: retries of a shard task whose worker died (default 3); "
                        "a retry resumes from what the shard stored")
    b.add_argument("--cpus-per-shard", type=int, default=None, metavar="N",
                   help="with --ray: CPUs each shard task reserves (default: the cluster's CPUs / shards)")
    b.add_argument("--sharded", action="store_true",
                   help="with --ray: keep the shards as the index's parts (searched as one, nothing "
                        "copied), each filled by its own Ray task from a quantizer trained once on a "
                        "sample of their stores, instead of merging them into one store and index")


def _int8_model(args: argparse.Namespace) -> Path:
    """``indexer build --int8``: the int8 version of --model (or the default), calibrated on the
    gallery (embedder.quantize.int8_model_path; the same gallery gives the same file, so a rerun
    resumes)."""
    from embedder import default_model_path
    from embedder.quantize import int8_model_path

    from .model import load_embedder

    fp32 = load_embedder(args.model, device="cpu").path if args.model else default_model_path()
    if not args.gallery.is_dir():
        raise ValueError(f"{args.gallery}: gallery folder not found")
    return int8_model_path(fp32, args.gallery, progress=not args.quiet)


def _build_with_ray(args: argparse.Namespace) -> dict:
    """``indexer build --ray``: the flags only --ray takes, the build, the shard summary line."""
    from .ray_build import SHARDS_DIR, build_with_ray

    if args.ray is None:
        raise ValueError(("--sharded" if args.sharded and args.shards is None else "--shards")
                         + " needs --ray (for one shard by hand use --shard i/n)")
    if args.shard:
        raise ValueError("--shard and --ray exclude each other: --ray builds every shard itself")
    m = build_with_ray(args.gallery, args.out, args.model, address=args.ray, shards=args.shards,
                       max_retries=args.max_retries, cpus_per_shard=args.cpus_per_shard,
                       batch_size=args.batch_size, workers=args.workers, device=args.device,
                       progress=not args.quiet, wait=args.wait, sharded=args.sharded,
                       **index_options(args))
    r = m["ray"]
    skipped = int(m.get("ingest", {}).get("skipped", 0))
    print(f"{r['found']} files in {r['shards']} shards on Ray ({r['num_gpus']} GPU / "
          f"{r['num_cpus']} CPU per task; attempts per shard: {', '.join(map(str, r['attempts']))}), "
          f"{skipped} skipped" + (f" (reasons in {Path(args.out) / m['report']})" if skipped else "")
          + f"; shards kept in {Path(args.out) / SHARDS_DIR}")
    return m


def serve_memory_opt(sp: argparse.ArgumentParser) -> None:
    """``--max-memory`` of the commands that search (and of app.py): indexer.rerank."""
    sp.add_argument("--max-memory", default=None, metavar="SIZE",
                    help="hold at most SIZE (e.g. 2G) of index in RAM: an index larger than that is "
                         "read memory-mapped and re-encoded to codes (SQ8, SQ4 or PQ, the most "
                         "accurate that fits), and each query's top 10 x k candidates are re-ranked "
                         "with the exact vectors read from the store (default: the whole index in RAM)")


def index_options(args: argparse.Namespace) -> dict:
    """The ``index_opts`` flags as keyword arguments of build_index / merge_shards."""
    return {k: getattr(args, k) for k in ("index_type", "flat_threshold", "nlist", "target_recall",
                                          "seed", "max_memory")}


def _positive(name: str, v: int | None) -> None:
    if v is not None and v < 1:
        raise ValueError(f"{name}={v}: expected a positive integer")


def _run(args: argparse.Namespace) -> int:
    from .build import add_images, build_index, merge_shards, remove_items, repair_index
    from .walk import parse_shard

    if args.cmd == "build" and args.int8:
        args.model = _int8_model(args)
    if args.cmd == "build" and (args.ray is not None or args.shards is not None or args.sharded):
        if args.dba:
            raise ValueError("--dba is not available with --ray/--sharded builds yet; build "
                             "without --ray, or `indexer merge --dba` the shards")
        _print_index_line(_build_with_ray(args), args.out)   # locks --out itself
        return 0
    for flag in ("batch_size", "workers"):
        _positive(f"--{flag.replace('_', '-')}", getattr(args, flag, None))
    if args.cmd == "build":
        shard = parse_shard(args.shard) if args.shard else None
        m = build_index(args.gallery, args.out, args.model, shard=shard, batch_size=args.batch_size,
                        workers=args.workers, device=args.device, progress=not args.quiet,
                        wait=args.wait, dba=dba_params(args), **index_options(args))
        ing = m["ingest"]
        print(f"{ing['found']} files: {ing['new']} new, {ing['unchanged']} unchanged, "
              f"{ing['duplicates']} duplicate content, {ing['skipped']} skipped"
              + (f" (reasons in {args.out / m['report']})" if ing["skipped"] else ""))
        if m.get("shard"):
            print(f"shard {m['shard']['i']}/{m['shard']['n']}: {m['count']} images in {args.out}")
        else:
            _print_index_line(m, args.out)
        return 0
    if args.cmd in ("add", "remove", "info") and _sharded(args.index):
        return _run_sharded(args)
    if args.cmd == "add":
        m, stats = add_images(args.index, args.folder, args.model, prefix=args.prefix,
                              batch_size=args.batch_size, workers=args.workers, device=args.device,
                              progress=not args.quiet, wait=args.wait)
        print(stats.summary())
        print(f"added {m['added']} vectors; index now holds {m['count']}, nprobe {m.get('nprobe')}")
        return 0
    if args.cmd == "remove":
        m, msgs = remove_items(args.index, args.targets, wait=args.wait)
        print("\n".join(msgs))
        print(f"index now holds {m['count']}")
        return 0
    if args.cmd == "repair":
        m = repair_index(args.index, batch_size=args.batch_size, workers=args.workers,
                         device=args.device, progress=not args.quiet, wait=args.wait)
        print(f"repaired: embedded {m['embedded']}, added {m['added']} and dropped {m['removed']} "
              f"faiss vectors; index now holds {m['count']}")
        return 0
    if args.cmd == "search":
        from .index import Index

        _positive("-k", args.k)
        idx = Index.open(args.index, device=args.device, check_model=True, max_memory=args.max_memory)
        hits = idx.search([args.image], args.k, dba={"auto": None, "on": True, "off": False}[args.dba])[0]
        if args.json:
            print(json.dumps([h.__dict__ for h in hits], indent=2))
        else:
            for r, h in enumerate(hits, 1):
                print(f"{r:3d}  {h.score:.4f}  id={h.id}  label={h.label}  {h.path}")
        return 0
    if args.cmd == "eval":
        return _eval(args)
    if args.cmd == "info":
        return _info(args)
    if args.cmd == "merge" and args.sharded:
        if args.dba:
            raise ValueError("--dba is not available with merge --sharded yet; merge without --sharded")
        from .lock import writer_lock
        from .shard_build import build_sharded

        from contextlib import ExitStack

        with ExitStack() as held:       # the shard folders too: their part.faiss is (re)written
            for d in [args.out, *[s for s in args.shards if Path(s).is_dir()]]:
                held.enter_context(writer_lock(d, "indexer merge --sharded", wait=args.wait))
            m = build_sharded(args.shards, args.out, device=args.device, progress=not args.quiet,
                              **index_options(args))
        _print_index_line(m, args.out)
        return 0
    if args.cmd == "merge":
        m = merge_shards(args.shards, args.out, device=args.device, progress=not args.quiet,
                         wait=args.wait, dba=dba_params(args), **index_options(args))
        _print_index_line(m, args.out)
        return 0
    raise AssertionError(args.cmd)


def _eval(args: argparse.Namespace) -> int:
    """``indexer eval``: a query folder or --leave-one-out, with and without DBA."""
    from .evaluate import evaluate_gallery, evaluate_queries
    from .index import Index

    if args.max_queries is not None and not args.leave_one_out:
        raise ValueError("--max-queries needs --leave-one-out")
    _positive("--max-queries", args.max_queries)
    dba = {"auto": None, "on": True, "off": False}[args.dba]
    idx = Index.open(args.index, device=args.device, check_model=not args.leave_one_out,
                     max_memory=args.max_memory)
    if dba and not idx.has_dba:
        raise ValueError(f"--dba on: {args.index} was built without DBA (rebuild with `indexer build --dba`)")
    if args.leave_one_out:
        res = evaluate_gallery(idx, args.k, dba=dba, max_queries=args.max_queries)
    else:
        res = evaluate_queries(idx, args.queries, args.k, dba=dba)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    if args.leave_one_out:
        print(f"{res['queries']} gallery items, each left out of its own results (leave-one-out)")
    else:
        print(f"{res['queries']} queries ({res['self_matches']} also in the gallery, excluded from "
              f"their own results), {len(res['skipped'])} skipped")
    rows = [("DBA" if res["dba"] else "plain", res["recall"])]
    other = res.get("recall_plain") or res.get("recall_dba")
    if other is not None:
        rows.append(("plain" if res["dba"] else "DBA", other))
    for name, rec in rows:
        tag = f" ({name})" if len(rows) > 1 else ""
        for k, v in rec.items():
            print(f"Recall@{k}{tag}: {v:.4f}")
    return 0


# ---------------------------------------------------------------------------- sharded indexes
def _sharded(directory: Path) -> bool:
    from .shards import is_sharded_dir

    return is_sharded_dir(directory)


def _run_sharded(args: argparse.Namespace) -> int:
    """add / remove / info on a sharded index (indexer.shards): same flags, same output lines."""
    from .lock import writer_lock
    from .shard_build import add_sharded, remove_sharded
    from .shards import print_info

    if args.cmd == "info":
        from .index_dir import IndexDir
        from .shards import shard_paths

        d = IndexDir(args.index)
        m = d.read_manifest()
        if args.deep:
            for p in shard_paths(d.path, m):
                _walk_store(p / "store.lmdb", args.json)
        return print_info(d.path, m, args.json)
    if args.cmd == "add":
        with writer_lock(args.index, "indexer add", wait=args.wait):
            m, stats = add_sharded(args.index, args.folder, args.model, prefix=args.prefix,
                                   batch_size=args.batch_size, workers=args.workers,
                                   device=args.device, progress=not args.quiet)
        print(stats.summary())
        print(f"added {m['added']} vectors to shard {m['shard']}; index now holds {m['count']}, "
              f"retuned to {m.get('search_params')}")
        return 0
    with writer_lock(args.index, "indexer remove", wait=args.wait):
        m, msgs = remove_sharded(args.index, args.targets)
    print("\n".join(msgs))
    print(f"index now holds {m['count']}")
    return 0


def _print_index_line(m: dict, out: Path) -> None:
    params = f", {m['search_params']}" if m.get("search_params") else (
        f", nlist {m['nlist']}, nprobe {m['nprobe']}" if m.get("nlist") else "")
    held = " on held-out queries" if m.get("heldout_queries") else ""
    print(f"{m['index_type']} index of {m['count']} x {m['dim']}{params}, recall@10 vs exact{held} "
          f"{m['recall_at_10']:.3f} (target {m['target_recall']}) in {m['build_seconds']:.1f}s -> {out}")
    if m.get("warning"):
        print(f"warning: {m['warning']}", file=sys.stderr)


def _info(args: argparse.Namespace) -> int:
    from .consistency import check_counts
    from .index_dir import IndexDir
    from .store import GalleryStore
    from .validate import read_faiss

    d = IndexDir(args.index)
    m = d.read_manifest()
    d.check(m, model=not m.get("shard"))                   # a damaged file ends here, in one line
    if args.deep:
        _walk_store(d.store_dir, args.json)
    if not m.get("shard") and not m.get("index_file"):     # no checksum recorded: let faiss read it
        read_faiss(d.index_file)
    with GalleryStore(d.store_dir) as st:
        store = {"items": len(st), "labels": len(st.labels()), "models": len(st.models())}
        counts = None if m.get("shard") else check_counts(args.index, store=st)
    bad = counts is not None and not counts.ok
    if args.json:
        print(json.dumps({"manifest": m, "store": store, "counts": counts and {
            **{k: getattr(counts, k) for k in ("store", "embedded", "faiss", "manifest", "busy")},
            "ok": counts.ok, "message": counts.message}}, indent=2))
        if bad:
            print(f"indexer info: error: {counts.message}", file=sys.stderr)
        return 1 if bad else 0
    mod = m["model"]
    print(f"index:    {args.index}")
    print(f"model:    {mod.get('backbone')} {mod['hash'][:12]} ({mod['dim']}-d) from {mod.get('source')}")
    if m.get("shard"):
        print(f"shard:    {m['shard']['i']}/{m['shard']['n']} (merge before searching)")
    else:
        print(f"faiss:    {m['index_type']} ({m.get('factory')}), {m['count']} vectors, metric {m['metric']}")
        if m.get("nlist") or m.get("search_params"):
            params = m.get("search_params") or f"nprobe={m['nprobe']}"
            print(f"search:   {params}" + (f", nlist {m['nlist']}" if m.get("nlist") else ""))
            from .manifest import recall_text

            print(f"recall:   {recall_text(m)}")
        _print_candidates(m)
        nb = m.get("neighbours")
        if nb:
            print(f"rerank:   DBA, k={nb['k']} (item included), weights sim^{nb['alpha']:g}, top "
                  f"{nb['depth']} re-ranked (neighbours.npz, {nb.get('bytes', 0) / 2 ** 20:.1f} MiB)")
        rec = m.get("index_file")
        print(f"checksum: index.faiss {rec['bytes']} bytes, sha256 {rec['sha256'][:16]} verified" if rec
              else "checksum: not recorded (built before checksums; rebuild to add one)")
    print(f"store:    {store['items']} images, {store['labels']} labels, embeddings from "
          f"{store['models']} model(s)")
    print(f"built:    {m.get('built_at')} in {m.get('build_seconds')}s; skipped "
          f"{m.get('ingest', {}).get('skipped', 0)} (see {m.get('report')})")
    if counts is not None:
        print(f"counts:   {counts.message if counts.ok else 'DIFFER (see below)'}")
    if bad:
        print(f"indexer info: error: {counts.message}", file=sys.stderr)
        return 1
    return 0


def _walk_store(store_dir: Path, as_json: bool) -> None:
    """``info --deep``: every record of the store read (``LmdbStore.walk``); raises, in one line
    naming the file and the database, at the first page LMDB cannot read."""
    from .store import GalleryStore

    with GalleryStore(store_dir) as st:
        counts = st.walk()
    if not as_json:
        print(f"deep:     {store_dir}: every record read ({sum(counts.values())} in "
              f"{len(counts)} databases)")


def _print_candidates(m: dict) -> None:
    """The selection's table (manifests from before it have none: nothing is printed)."""
    from .errors import size_text

    rows = m.get("candidates")
    if not rows:
        return
    print(f"chosen by measurement in {m.get('selection_seconds', 0):.1f}s on a sample "
          f"(q/s: one batch of the tuning queries, Flat's scaled to the gallery size; memory "
          f"extrapolated to the gallery"
          + (f"; budget {size_text(m['max_memory'])}" if m.get("max_memory") else "") + "):")
    print(f"  {'':1} {'type':7} {'factory':32} {'search params':34} {'recall':>6} {'q/s':>9} "
          f"{'MiB':>7} {'build s':>7}")
    for r in rows:
        mark = "*" if r.get("chosen") else ("-" if not (r["meets_target"] and r["fits_memory"]) else "")
        print(f"  {mark:1} {r['index_type']:7} {r['factory']:32} {r['search_params'] or '(exact)':34} "
              f"{r['recall_at_10']:6.3f} {r.get('rank_qps', r['qps']):9,.0f} {r['memory_bytes'] / 2 ** 20:7.0f} "
              f"{r['build_seconds']:7.1f}")
    print("  (* chosen, - misses the target or the memory budget)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from embedder.cli import fail

    from .errors import IndexerError

    import lmdb

    try:
        return _run(args)
    except (IndexerError, ValueError, OSError, KeyError, lmdb.Error) as e:
        return fail(f"indexer {args.cmd}", e)
    except KeyboardInterrupt:
        print(f"indexer {args.cmd}: interrupted (rerun the same command to resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
