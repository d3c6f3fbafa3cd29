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
from typing import Any

from embedder.cli import UsageError, run_main

from .errors import IndexerError
from .manifest import Manifest
from .options import BuildOptions

DEFAULT_DIR = "indexes/default"


def _parser() -> argparse.ArgumentParser:
    from embedder.cli import add_index_option, add_options, memory_size

    from .faiss_index import DEFAULT_FLAT_THRESHOLD, INDEX_TYPES
    from .manifest import DEFAULT_TARGET_RECALL

    p = argparse.ArgumentParser(prog="python -m indexer",
                                description="LMDB gallery store + faiss index tuned to a recall target.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def index_opts(sp: argparse.ArgumentParser) -> None:
        """The build's options (indexer.options.BuildOptions)."""
        sp.add_argument("--index-type", choices=INDEX_TYPES, default="auto",
                        help="auto (default): exact Flat below --flat-threshold images; above, the "
                             "fastest of a few types measured on a sample that reaches the target "
                             "recall within --index-memory. Any other value forces that type")
        sp.add_argument("--flat-threshold", type=positive, default=DEFAULT_FLAT_THRESHOLD, metavar="N",
                        help=f"gallery size from which auto uses IVF (default {DEFAULT_FLAT_THRESHOLD})")
        sp.add_argument("--nlist", type=positive, default=None, help="IVF lists (default: from the gallery size)")
        sp.add_argument("--target-recall", type=float, default=DEFAULT_TARGET_RECALL,
                        help="recall@10 vs exact search that nprobe is tuned to reach "
                             f"(default {DEFAULT_TARGET_RECALL})")
        sp.add_argument("--index-memory", "--max-memory", dest="index_memory", type=memory_size, default=None,
                        metavar="SIZE",
                        help="the BUILD's memory budget for the index, e.g. 4G or 512M (default: no "
                             "limit; the build holds the gallery's vectors in memory anyway): index "
                             "types whose codes alone exceed it are not even built. --max-memory is "
                             "its old name, deprecated here (search, eval and app.py's --max-memory "
                             "is the serving budget)")
        sp.add_argument("--seed", type=int, default=0)

    def opts(sp: argparse.ArgumentParser, *flags: str, index: bool = False) -> argparse.ArgumentParser:
        """The kit's shared options, the indexer's own (--wait), and --index."""
        if index:
            add_index_option(sp, DEFAULT_DIR)
        if "--wait" in flags:
            sp.add_argument("--wait", action="store_true", help="if another process is writing this index "
                            "directory, wait for it to finish (default: exit 1 naming its pid)")
        return add_options(sp, *[f for f in flags if f != "--wait"],
                           **{f: dict(type=positive) for f in ("--batch-size", "--workers", "-k")})

    b = sub.add_parser("build", help="ingest a gallery folder and build its index",
                       description="Walk GALLERY (labels = sub-folders), store and embed every image, "
                                   "build and tune the faiss index. Rerun to resume.")
    b.add_argument("gallery", type=Path)
    b.add_argument("--model", type=Path, default=None,
                   help="exported .onnx embedder (default: the offline pretrained ImageNet embedder, "
                        "embedder.pretrained.DEFAULT; `python -m embedder pretrained --help`)")
    b.add_argument("--int8", action=argparse.BooleanOptionalAction, default=None,
                   help="embed with the int8 version of --model (default: of the default embedder), "
                        "quantised once on 256 of the gallery's images and cached in $DAS_CACHE/int8 "
                        "(`python -m embedder quantize --help`); the network runs ~2x as fast, "
                        "the whole build ~1.6x (docs/benchmarks/embedder.md). Default (auto): on "
                        "for the default embedder on a gallery of >= 256 images (the measured "
                        "default, with --dba: docs/benchmarks/quality-round5.md), off below 256 "
                        "and with --model (measured for the default embedder only); --shard and "
                        "--ray builds too. --no-int8: the fp32 model")
    b.add_argument("--out", type=Path, default=Path(DEFAULT_DIR), help=f"index directory (default {DEFAULT_DIR})")
    b.add_argument("--shard", default=None, metavar="i/n",
                   help="ingest and embed only shard i of n (0 <= i < n); combine with `merge`")
    _ray_arguments(opts(b, "--batch-size", "--workers"))
    index_opts(b)
    dba_opts(b, auto=True)
    opts(b, "--device", "--quiet", "--wait").set_defaults(func=_build)

    a = opts(sub.add_parser("add", help="add the images of a folder to an existing index"), index=True)
    a.add_argument("folder", type=Path)
    a.add_argument("--model", type=Path, default=None,
                   help="must be the model the index was built with (default: the index's copy)")
    a.add_argument("--prefix", default="", help="prefix for the stored relative paths (and labels)")
    opts(a, "--batch-size", "--workers", "--device", "--quiet", "--wait").set_defaults(func=_add)

    r = sub.add_parser("remove", help="remove images by id or stored relative path")
    r.add_argument("targets", nargs="+", metavar="ID|PATH")
    opts(r, "--wait", index=True).set_defaults(func=_remove)

    opts(sub.add_parser("repair", help="bring the faiss index and the manifest in step with the store",
                        description="What `info` names when the store(s), the faiss index and the "
                                    "manifest disagree on the image count: embeds stored images the "
                                    "index's model has not embedded, adds/drops faiss vectors to match "
                                    "the store(s), retunes, rewrites the manifest. Needs no gallery "
                                    "folder. Single and sharded indexes alike."),
         "--batch-size", "--workers", "--device", "--quiet", "--wait", index=True).set_defaults(func=_repair)

    s = sub.add_parser("search", help="the k nearest gallery images of a query image")
    s.add_argument("image", type=Path)
    s.add_argument("--dba", choices=("auto", "on", "off"), default="auto",
                   help="DBA re-ranking (auto: on for an index built with --dba)")
    opts(s, "-k", "--json", "--device", "--max-memory", "--ray", "--shard-timeout",
         index=True).set_defaults(func=_search)

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
    e.add_argument("--max-queries", type=positive, default=None, metavar="N",
                   help="with --leave-one-out: a random sample of N items (default: all)")
    e.add_argument("-k", type=positive, nargs="+", default=[1, 2, 4, 8],
                   help="the k of each Recall@k (default 1 2 4 8)")
    e.add_argument("--dba", choices=("auto", "on", "off"), default="auto",
                   help="the figures' DBA setting (auto: as the index serves; the other setting is "
                        "reported beside them when the index has DBA)")
    opts(e, "--json", "--device", "--max-memory", "--ray", "--shard-timeout",
         index=True).set_defaults(func=_eval)

    i = sub.add_parser("info", help="what an index directory holds",
                       description="Prints what an index directory holds; exits 1 when the store, "
                                   "the faiss index and the manifest disagree on the image count "
                                   "(naming `indexer repair`).")
    opts(i, "--json", index=True).set_defaults(func=_info)
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
    opts(m, "--device", "--quiet", "--wait").set_defaults(func=_merge)
    return p


def positive(text: str) -> int:
    """argparse ``type=``: a positive integer (else a usage error naming the option, exit 2)."""
    v = int(text)
    if v < 1:
        raise ValueError(text)
    return v


positive.__name__ = "positive integer"      # argparse: "invalid positive integer value: '0'"


def dba_opts(sp: argparse.ArgumentParser, auto: bool = False) -> None:
    """``--dba`` and its parameters (indexer.neighbours), for build and merge; ``auto`` (build):
    ``--dba``/``--no-dba``, unset = the default of indexer.options.resolve_defaults."""
    from .neighbours import DEFAULT_ALPHA, DEFAULT_DEPTH, DEFAULT_K
    from .options import dba_min_images

    what = ("database-side augmentation at serve time: each gallery vector is also "
            "kept as the sim^alpha-weighted mean of its --dba-k nearest gallery "
            "vectors (itself included) and searches re-rank their top candidates with "
            "those (switchable per request; kept right by add/remove)")
    if auto:
        sp.add_argument("--dba", action=argparse.BooleanOptionalAction, default=None,
                        help=what + f". Default (auto): on for the default embedder on a gallery of "
                                    f">= {dba_min_images(DEFAULT_K)} images (2 x --dba-k + 1), off "
                                    "below, with --model, with --shard (the merge's: `indexer "
                                    "merge --dba`) and with --ray/--sharded (not available there). "
                                    "--no-dba: without")
    else:
        sp.add_argument("--dba", action="store_true", help=what)
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
            raise UsageError("--dba-k/--dba-alpha/--dba-depth need --dba")
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


def _build_with_ray(args: argparse.Namespace) -> Manifest:
    """``indexer build --ray``: the flags only --ray takes, the build, the shard summary line."""
    from .index_dir import SHARDS_DIR
    from .ray_build import build_with_ray

    if args.ray is None:
        raise UsageError(("--sharded" if args.sharded and args.shards is None else "--shards")
                         + " needs --ray (for one shard by hand use --shard i/n)")
    if args.shard:
        raise UsageError("--shard and --ray exclude each other: --ray builds every shard itself")
    m = build_with_ray(args.gallery, args.out, args.model, address=args.ray, shards=args.shards,
                       max_retries=args.max_retries, cpus_per_shard=args.cpus_per_shard,
                       batch_size=args.batch_size, workers=args.workers, device=args.device,
                       progress=not args.quiet, wait=args.wait, sharded=args.sharded,
                       options=build_options(args))
    r = m.extra["ray"]
    skipped = int((m.ingest or {}).get("skipped", 0))
    print(f"{r['found']} files in {r['shards']} shards on Ray ({r['num_gpus']} GPU / "
          f"{r['num_cpus']} CPU per task; attempts per shard: {', '.join(map(str, r['attempts']))}), "
          f"{skipped} skipped" + (f" (reasons in {Path(args.out) / m.report})" if skipped else "")
          + f"; shards kept in {Path(args.out) / SHARDS_DIR}")
    return m


def build_options(args: argparse.Namespace) -> BuildOptions:
    """The ``index_opts`` flags as one checked value (indexer.options)."""
    return BuildOptions(args.index_type, args.flat_threshold, args.nlist, args.target_recall, args.seed,
                        args.index_memory)


DBA = {"auto": None, "on": True, "off": False}


def _resolve_defaults(args: argparse.Namespace, ray: bool) -> tuple[str, ...]:
    """``--int8``/``--dba`` left unset: decided by indexer.options.resolve_defaults (the one
    place), on a bounded count of the gallery's images (the build's own walk, stopped at the
    largest threshold). Returns a line per automatic choice that turned something off."""
    import itertools

    from .options import INT8_MIN_IMAGES, dba_min_images, resolve_defaults
    from .walk import walk_gallery

    if args.int8 is not None and args.dba is not None:
        return ()
    found = args.gallery.is_dir()                         # a missing gallery: the build says so
    images = 0
    if args.model is None and found:
        bound = max(INT8_MIN_IMAGES, dba_min_images(args.dba_k))
        images = sum(1 for _ in itertools.islice((f for f in walk_gallery(args.gallery) if f.problem is None),
                                                 bound))
    d = resolve_defaults(args.int8, args.dba, model_given=args.model is not None, images=images,
                         mode="ray" if ray else "shard" if args.shard else "process", dba_k=args.dba_k)
    args.int8, args.dba = d.int8, d.dba
    return d.notes if found else ()


def _build(args: argparse.Namespace) -> None:
    from .build import build_index
    from .walk import parse_shard

    ray = args.ray is not None or args.shards is not None or args.sharded
    notes = _resolve_defaults(args, ray)
    if ray and args.dba:
        raise UsageError("--dba is not available with --ray/--sharded builds yet; build "
                         "without --ray, or `indexer merge --dba` the shards")
    dba_params(args)                                      # bad --dba-* flags: refused before any note
    for note in notes:
        print(f"indexer build: {note}", file=sys.stderr)
    if args.int8:
        args.model = _int8_model(args)
    if ray:
        return _print_index_line(_build_with_ray(args), args.out)   # locks --out itself
    shard = parse_shard(args.shard) if args.shard else None
    m = build_index(args.gallery, args.out, args.model, options=build_options(args), shard=shard,
                    batch_size=args.batch_size, workers=args.workers, device=args.device,
                    progress=not args.quiet, wait=args.wait, dba=dba_params(args))
    ing = m.ingest
    print(f"{ing['found']} files: {ing['new']} new, {ing['unchanged']} unchanged, "
          f"{ing['duplicates']} duplicate content, {ing['skipped']} skipped"
          + (f" (reasons in {args.out / m.report})" if ing["skipped"] else ""))
    if m.is_shard:
        print(f"shard {m.shard['i']}/{m.shard['n']}: {m.count} images in {args.out}")
    else:
        _print_index_line(m, args.out)


def _add(args: argparse.Namespace) -> None:
    from .update import add_images

    c = add_images(args.index, args.folder, args.model, prefix=args.prefix, batch_size=args.batch_size,
                   workers=args.workers, device=args.device, progress=not args.quiet, wait=args.wait)
    print(c.stats.summary())
    if c.shard is not None:
        print(f"added {c.added} vectors to shard {c.shard}; index now holds {c.manifest.count}, "
              f"retuned to {c.manifest.search_params}")
    else:
        print(f"added {c.added} vectors; index now holds {c.manifest.count}, nprobe {c.manifest.nprobe}")


def _remove(args: argparse.Namespace) -> None:
    from .update import remove_items

    c = remove_items(args.index, args.targets, wait=args.wait)
    print("\n".join(c.messages))
    print(f"index now holds {c.manifest.count}")


def _repair(args: argparse.Namespace) -> None:
    from .update import repair_index

    c = repair_index(args.index, batch_size=args.batch_size, workers=args.workers, device=args.device,
                     progress=not args.quiet, wait=args.wait)
    print(f"repaired: embedded {c.embedded}, added {c.added} and dropped {c.removed} "
          f"faiss vectors; index now holds {c.manifest.count}")


def ray_serving(args: argparse.Namespace, strict: bool = False) -> Any:
    """``--ray``/``--shard-timeout`` as ``Index.open``'s ``ray`` (None: in this process).
    ``strict`` (eval): a figure must not come from a partial answer: a shard left out fails
    the run in one line (``fanout.RayServing.strict``)."""
    if args.ray is None:
        return None
    from .fanout import RayServing

    return RayServing(address=args.ray, timeout=args.shard_timeout, strict=strict)


def _search(args: argparse.Namespace) -> None:
    from .index import Index

    idx = Index.open(args.index, device=args.device, check_model=True, max_memory=args.max_memory,
                     ray=ray_serving(args))
    found = idx.answer(idx.embed([args.image]), args.k, dba=DBA[args.dba])
    hits, partial = idx.hits(found.scores[0], found.ids[0]), found.partial
    if partial:     # over Ray, a shard did not answer in time: said, on stderr
        print(f"indexer search: warning: partial answer: shard(s) {', '.join(map(str, partial))} did not "
              f"answer within {args.shard_timeout:g} s", file=sys.stderr)
    if args.json:
        print(json.dumps([h.__dict__ for h in hits], indent=2))
    else:
        for r, h in enumerate(hits, 1):
            print(f"{r:3d}  {h.score:.4f}  id={h.id}  label={h.label}  {h.path}")


def _merge(args: argparse.Namespace) -> None:
    if args.sharded:
        from .shard_build import build_sharded

        if args.dba:
            raise UsageError("--dba is not available with merge --sharded yet; merge without --sharded")
        m = build_sharded(args.shards, args.out, options=build_options(args), device=args.device,
                          progress=not args.quiet, wait=args.wait)      # locks --out and the shards
    else:
        from .build import merge_shards

        m = merge_shards(args.shards, args.out, options=build_options(args), device=args.device,
                         progress=not args.quiet, wait=args.wait, dba=dba_params(args))
    _print_index_line(m, args.out)


def _eval(args: argparse.Namespace) -> int:
    """``indexer eval``: a query folder or --leave-one-out, with and without DBA."""
    from .evaluate import evaluate_gallery, evaluate_queries
    from .index import Index

    if args.max_queries is not None and not args.leave_one_out:
        raise UsageError("--max-queries needs --leave-one-out")
    dba = DBA[args.dba]
    idx = Index.open(args.index, device=args.device, check_model=not args.leave_one_out,
                     max_memory=args.max_memory, ray=ray_serving(args, strict=True))
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


def _print_index_line(m: Manifest, out: Path) -> None:
    params = f", {m.search_params}" if m.search_params else (
        f", nlist {m.nlist}, nprobe {m.nprobe}" if m.nlist else "")
    held = " on held-out queries" if m.heldout_queries else ""
    print(f"{m.index_type} index of {m.count} x {m.dim}{params}, recall@10 vs exact{held} "
          f"{m.recall_at_10:.3f} (target {m.target_recall}) in {m.build_seconds:.1f}s -> {out}")
    if m.warning:
        print(f"warning: {m.warning}", file=sys.stderr)


def _info(args: argparse.Namespace) -> None:
    """``indexer info``: the library's facts (indexer.update.info) as a table or JSON; counts
    that differ end in the one error line (exit 1) after the table."""
    from .update import info

    facts = info(args.index, deep=args.deep)
    m, counts = facts["manifest"], facts["counts"]
    if args.json:
        out = {"manifest": m.to_dict(), **{k: v for k, v in facts.items()
                                           if k in ("store", "parts", "held")}}
        out["counts"] = counts and {**{k: getattr(counts, k) for k in ("store", "embedded", "faiss",
                                                                         "manifest", "busy")},
                                    "ok": counts.ok, "message": counts.message}
        print(json.dumps(out, indent=2))
    else:
        for store, walked in facts.get("deep", {}).items():
            print(f"deep:     {store}: every record read ({sum(walked.values())} in {len(walked)} databases)")
        _print_layout(args.index, m, facts)
        if counts is not None:
            print(f"counts:   {counts.message if counts.ok else 'DIFFER (see below)'}")
    if counts is not None and not counts.ok:
        raise IndexerError(counts.message)


def _print_layout(directory: Path, m: Manifest, facts: dict) -> None:
    """The table of either layout: what the manifest says, then its parts (a shard's folder
    named per line), the held-out part and the stores."""
    mod, shards = m.model, [p for p in facts["parts"] if p["shard"]]
    print(f"index:    {directory}" + (f" ({facts['layout']}: {len(shards)} shards searched as one)" if shards else ""))
    print(f"model:    {mod.get('backbone')} {mod['hash'][:12]} ({mod['dim']}-d) from {mod.get('source')}")
    if m.is_shard:
        print(f"shard:    {m.shard['i']}/{m.shard['n']} (merge before searching)")
    else:
        print(f"faiss:    {m.index_type} ({m.factory}), {m.count} vectors, metric {m.metric}")
        if m.search_params or m.nlist:
            print(f"search:   {m.search_params or f'nprobe={m.nprobe}'}" + (f", nlist {m.nlist}" if m.nlist else ""))
            print(f"recall:   {m.recall_text()}")
        _print_candidates(m)
        nb = m.neighbours
        if nb:
            print(f"rerank:   DBA, k={nb['k']} (item included), weights sim^{nb['alpha']:g}, top "
                  f"{nb['depth']} re-ranked (neighbours.npz, {nb.get('bytes', 0) / 2 ** 20:.1f} MiB)")
        for i, s in enumerate(shards):
            print(f"shard {i}:  {s['shard']}: {s['images']} images stored, {s['vectors']} vectors in its part")
        if facts["held"] is not None:
            print(f"held-out: {facts['held']} vectors in the held-out part")
        print(f"checksum: {facts['checksums']}")
    st = facts["store"]
    print(f"store:    {st['items']} images, {st['labels']} labels, embeddings from {st['models']} model(s)")
    print(f"built:    {m.built_at} in {m.build_seconds}s; skipped "
          f"{(m.ingest or {}).get('skipped', 0)} (see {m.report})")


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
    import lmdb

    return run_main("indexer", _parser(), argv, expected=(IndexerError, lmdb.Error),
                    on_interrupt="interrupted (rerun the same command to resume)")


if __name__ == "__main__":
    sys.exit(main())
