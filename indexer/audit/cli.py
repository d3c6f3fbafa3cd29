"""``python -m indexer audit``: ``add_parser(subparsers)`` adds the command, ``run(args)`` handles it."""
from __future__ import annotations

import argparse
from pathlib import Path

from embedder.cli import UsageError, add_options, bounded, positive

from .duplicates import DEFAULT_THRESHOLD, MIN_INLIERS
from .run import DEFAULT_K, DEFAULT_TOP, DEFAULT_VERIFY_MAX, KINDS, print_summary, run_audit, write_audit
from .source import ray_serving

DESCRIPTION = ("Audit a gallery from its index: near-duplicate groups, likely mislabelled images "
               "(each with the label its neighbourhood suggests), outliers and the most confused "
               "class pairs, from the index's own kNN graph. Writes JSONL + CSV per kind, PNG "
               "contact sheets and summary.json into --out (replaced as a whole: never half "
               "written), and prints a summary. A gallery without labels (no class sub-folders) "
               "gets near-duplicates and outliers only.")


_count = bounded(int, "count (0 or more)", 0)
_cosine = bounded(float, "cosine (-1..1)", -1.0, 1.0)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``audit`` to a parser's subcommands (``python -m indexer``'s), its handler set."""
    p = subparsers.add_parser("audit", help="near-duplicates, likely mislabelled images, outliers, "
                                            "confused classes", description=DESCRIPTION)
    configure(p)
    return p


def configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--index", type=Path, required=True, metavar="DIR", help="index directory to audit")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="where to write the audit (default: DIR/audit beside the index's files)")
    p.add_argument("-k", type=positive, default=None,
                   help=f"neighbours per image in the kNN graph (default {DEFAULT_K}, or all the others of a "
                        "smaller gallery)")
    p.add_argument("--threshold", type=_cosine, default=DEFAULT_THRESHOLD,
                   help=f"pair score (cosine + its lead over both neighbourhoods) from which two images "
                        f"are near-duplicates (default {DEFAULT_THRESHOLD})")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="do not check near-duplicates by their pixels (by default the pairs among each other's 2 "
                        "nearest that score a little below --threshold, and each image's nearest, are matched with "
                        "ORB keypoints + RANSAC, "
                        f"and those with >= {MIN_INLIERS} inliers that agree pixel by pixel once aligned are the "
                        "same picture, e.g. a cropped or resized copy; pairs above it with fewer inliers, "
                        "mirrored too, are dropped: frames or other photos of one object)")
    p.add_argument("--verify-max", type=_count, default=DEFAULT_VERIFY_MAX, metavar="PAIRS",
                   help=f"check at most this many pairs by pixels of each: above --threshold lowest first, below "
                        f"it likeliest copies first (default "
                        f"{DEFAULT_VERIFY_MAX}: about 30-45 ms CPU a pair; 0: none)")
    p.add_argument("--top", type=positive, default=DEFAULT_TOP,
                   help=f"rows written per ranked list (default {DEFAULT_TOP})")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                   help="what to compute (default all; mislabelled and confused need labels: "
                        "asking for them on a gallery without labels is an error)")
    p.add_argument("--no-sheets", dest="sheets", action="store_false", help="no PNG contact sheets")
    add_options(p, "--quiet", "--json", "--ray", "--shard-timeout")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """The handler: audit, write, print the summary (or it as JSON with --json)."""
    if args.out is not None and args.out.exists() and not args.out.is_dir():   # before the graph
        raise UsageError(f"--out {args.out}: a file is there; expected a folder for the audit")
    ray = None if args.ray is None else ray_serving(args.ray, args.shard_timeout)
    a = run_audit(args.index, k=args.k, threshold=args.threshold, kinds=tuple(args.kinds),
                  progress=not args.quiet, ray=ray, verify=args.verify, verify_max=args.verify_max)
    out = args.out if args.out is not None else args.index / "audit"
    try:
        info = write_audit(a, out, top=args.top, sheets=args.sheets)
    finally:
        a.gallery.close()
    if args.json:
        import json

        print(json.dumps({**info, "out": str(out)}, indent=2))
    else:
        print_summary(info, out)
    return 0


__all__ = ["add_parser", "configure", "run"]
