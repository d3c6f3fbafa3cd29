"""``python -m indexer``'s arguments: one subparser per command, each bound to its function
(:mod:`indexer.cli.write`, :mod:`indexer.cli.read`)."""
from __future__ import annotations

import argparse
from pathlib import Path

from embedder.cli import positive

from ..audit.cli import add_parser as add_audit_parser
from ..cli import read, write

DEFAULT_DIR = "indexes/default"


def parser() -> argparse.ArgumentParser:
    from embedder.cli import add_index_option, add_options, memory_size

    from ..ann.faiss_index import DEFAULT_FLAT_THRESHOLD, INDEX_TYPES
    from ..directory.manifest import DEFAULT_TARGET_RECALL

    p = argparse.ArgumentParser(prog="python -m indexer",
                                description="LMDB gallery store + faiss index tuned to a recall target.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def index_opts(sp: argparse.ArgumentParser) -> None:
        """The build's options (indexer.ann.options.BuildOptions)."""
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
    b.add_argument("gallery", type=Path, help="folder of images; sub-folders are the labels")
    b.add_argument("--model", type=Path, default=None,
                   help="exported .onnx embedder (default: an offline pretrained ImageNet embedder, "
                        "Lite1; in int8 on a CPU with int8 dot products (VNNI, AMX) Lite0 + Lite1, "
                        "and an index keeps its own: indexer.ann.options; `python -m embedder "
                        "pretrained --help`)")
    b.add_argument("--int8", action=argparse.BooleanOptionalAction, default=None,
                   help="embed with the int8 version of --model (default: of the default embedder), "
                        "quantised once on 256 of the gallery's images and cached in $DAS_CACHE/int8 "
                        "(`python -m embedder quantize --help`); the network runs ~2x as fast, "
                        "the whole build ~1.6x (docs/benchmarks/embedder.md). Default (auto): on "
                        "for a gallery of >= 256 images (the measured default, with --dba: "
                        "docs/benchmarks/quality-round5.md), --shard and --ray builds too; off "
                        "below 256, for a --model of a timm backbone (int8 leaves MatMul float) "
                        "and for a model whose int8 version misses the int8/fp32 check (one "
                        "line each). --no-int8: the fp32 model")
    b.add_argument("--out", type=Path, default=Path(DEFAULT_DIR), help=f"index directory (default {DEFAULT_DIR})")
    b.add_argument("--prune", action="store_true",
                   help="drop stored images whose file is no longer under GALLERY (deleted, renamed, or brought "
                        "by `indexer add` from another folder); by default they are kept and counted in one line")
    b.add_argument("--shard", default=None, metavar="i/n",
                   help="ingest and embed only shard i of n (0 <= i < n); combine with `merge`")
    ray_arguments(opts(b, "--batch-size", "--workers"))
    index_opts(b)
    dba_opts(b)
    opts(b, "--device", "--quiet", "--wait").set_defaults(func=write.build)

    a = opts(sub.add_parser("add", help="add the images of a folder (or one image) to an existing index"), index=True)
    a.add_argument("folder", type=Path, help="folder of images, stored as PREFIX/<path in it> (one image file: "
                                             "PREFIX/<its name>); a file at a path the "
                                             "index holds with other content is skipped and reported, never replaces")
    a.add_argument("--model", type=Path, default=None,
                   help="must be the model the index was built with (default: the index's copy)")
    a.add_argument("--prefix", default="", help="prefix for the stored relative paths (and labels)")
    opts(a, "--batch-size", "--workers", "--device", "--quiet", "--wait").set_defaults(func=write.add)

    r = sub.add_parser("remove", help="remove images by id, stored relative path or folder")
    r.add_argument("targets", nargs="+", metavar="ID|PATH|FOLDER/",
                   help="an image id, a stored relative path (dogs/a.jpg), or a folder ending in / (dogs/: every "
                        "stored path under it, e.g. a class the audit found wrong)")
    opts(r, "--wait", index=True).set_defaults(func=write.remove)

    opts(sub.add_parser("repair", help="bring the faiss index and the manifest in step with the store",
                        description="What `info` names when the store(s), the faiss index and the "
                                    "manifest disagree on the image count: embeds stored images the "
                                    "index's model has not embedded, adds/drops faiss vectors to match "
                                    "the store(s), retunes, rewrites the manifest. Needs no gallery "
                                    "folder. Single and sharded indexes alike."),
         "--batch-size", "--workers", "--device", "--quiet", "--wait", index=True).set_defaults(func=write.repair)

    s = sub.add_parser("search", help="the k nearest gallery images of a query image, or of every "
                                      "image of a folder (batch)")
    s.add_argument("image", type=Path, help="a query image, or a folder of them (searched in batches; "
                                           "unreadable files skipped and reported)")
    s.add_argument("--box", metavar="X0,Y0,X1,Y1", default=None,
                   help="search this region of the image only (pixels of the image as shown)")
    s.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="with a folder: write the top-k of each file to FILE, .jsonl or .csv, with its "
                        "suggested label (the hits' vote) and novelty (p-value of no close match; DBA "
                        "indexes) (default: JSON lines on stdout)")
    s.add_argument("--dba", choices=("auto", "on", "off"), default="auto",
                   help="DBA re-ranking (auto: on for an index built with --dba)")
    s.add_argument("--label", action="append", default=None, metavar="LABEL",
                   help="only images of this label (a gallery sub-folder) answer; repeat for several")
    s.add_argument("--copies", action="store_true",
                   help="mark each hit that is the query's own picture (resized, re-encoded, cropped: "
                        "the audit's pixel check; ~50 ms a hit on 2 cores): new photos checked before `indexer add`")
    opts(s, "-k", "--json", "--device", "--max-memory", "--ray", "--shard-timeout", "--quiet",
         index=True).set_defaults(func=read.search)

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
    e.add_argument("--per-label", type=Path, default=None, metavar="FILE.csv",
                   help="write each label's queries and Recall@1, weakest first, and a PNG of the 40 "
                        "weakest beside it (the five weakest are printed either way)")
    opts(e, "--json", "--device", "--max-memory", "--ray", "--shard-timeout", "--quiet",
         index=True).set_defaults(func=read.evaluate)

    i = sub.add_parser("info", help="what an index directory holds",
                       description="Prints what an index directory holds; exits 1 when the store, "
                                   "the faiss index and the manifest disagree on the image count "
                                   "(naming `indexer repair`).")
    opts(i, "--json", index=True).set_defaults(func=read.info)
    i.add_argument("--deep", action="store_true",
                   help="also read every record of the gallery store(s), values included, and "
                        "exit 1 naming the file if LMDB cannot read one (garbage inside data.mdb "
                        "that the cheap open-time checks cannot see; reads the whole store)")

    x = sub.add_parser("export", help="the stored vectors as a .npy array and the items as CSV",
                       description="Write FILE.npy ((n, dim) float32, L2-normalised: what the index "
                                   "searches) and FILE.csv (row, id, label, path: the array's rows), "
                                   "for work outside the engine; single and sharded indexes alike.")
    x.add_argument("--out", type=Path, required=True, metavar="FILE.npy", help="the array (the CSV beside it)")
    opts(x, "--quiet", index=True).set_defaults(func=read.export)

    m = sub.add_parser("merge", help="merge shard directories into one index",
                       description="Train one IVF quantizer over all shards and merge their inverted lists; "
                                   "DBA by `indexer build`'s rule for the merged gallery, so the "
                                   "result equals one build of it.")
    m.add_argument("shards", type=Path, nargs="+", metavar="SHARD_DIR")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--sharded", action="store_true",
                   help="leave the shards where they are: train once on a sample of their stores, "
                        "give each shard its own part of the index, and write a manifest in --out "
                        "that lists them (searched as one; nothing is copied)")
    m.add_argument("--prune", action="store_true",
                   help="drop images --out holds that no shard holds any more (pruned from a shard by "
                        "`build --shard i/n --prune`, or brought by `indexer add`); by default kept and counted")
    index_opts(m)
    dba_opts(m)
    opts(m, "--device", "--quiet", "--wait").set_defaults(func=write.merge)
    add_audit_parser(sub)
    return p


def dba_opts(sp: argparse.ArgumentParser) -> None:
    """``--dba``/``--no-dba`` and DBA's parameters (indexer.ann.neighbours), for build and merge;
    unset = the default of indexer.ann.options.resolve_defaults."""
    from ..ann.neighbours import DEFAULT_ALPHA, DEFAULT_DEPTH, DEFAULT_K
    from ..ann.options import DBA_MAX_AT_DIM, DBA_MAX_IMAGES, dba_min_images

    what = ("database-side augmentation at serve time: each gallery vector is also "
            "kept as the sim^alpha-weighted mean of its --dba-k nearest gallery "
            "vectors (itself included) and searches re-rank their top candidates with "
            "those (switchable per request; kept right by add/remove)")
    sp.add_argument("--dba", action=argparse.BooleanOptionalAction, default=None,
                    help=what + f". Default (auto): on for a gallery of >= "
                                f"{dba_min_images(DEFAULT_K)} images (2 x --dba-k + 1), then "
                                "measured on its labels and dropped where it hurts; off below, "
                                f"above {DBA_MAX_IMAGES:,} images of {DBA_MAX_AT_DIM:,}-d (an n^2 d "
                                "neighbour pass: more images of narrower embeddings), "
                                "with --model on a gallery without labels, with --shard (the "
                                "merge decides, by the same rule) and with --sharded (not "
                                "available there). --no-dba: without")
    sp.add_argument("--dba-k", type=int, default=DEFAULT_K, metavar="K",
                    help=f"gallery vectors averaged, the item included (default {DEFAULT_K})")
    sp.add_argument("--dba-alpha", type=float, default=DEFAULT_ALPHA, metavar="A",
                    help=f"neighbour weight = similarity^A (default {DEFAULT_ALPHA:g})")
    sp.add_argument("--dba-depth", type=int, default=DEFAULT_DEPTH, metavar="N",
                    help=f"plain candidates re-ranked per query (default {DEFAULT_DEPTH})")


def ray_arguments(b: argparse.ArgumentParser) -> None:
    """``indexer build``'s Ray options (``indexer.build.ray_build``)."""
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
