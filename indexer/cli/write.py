"""The commands that write an index directory: build (one process, ``--shard``, ``--ray``),
merge, add, remove, repair. Each holds the directory's writer lock through the library."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from embedder.cli import UsageError

from ..ann.options import BuildOptions
from ..directory.index_dir import REPORT, IndexDir
from ..directory.manifest import Manifest
from .defaults import dba_where_it_helps, int8_model, resolve_build_defaults, resolve_merge_defaults, say_notes


def build_options(args: argparse.Namespace) -> BuildOptions:
    """The ``index_opts`` flags as one checked value (indexer.ann.options)."""
    return BuildOptions(args.index_type, args.flat_threshold, args.nlist, args.target_recall, args.seed,
                        args.index_memory)


def dba_params(args: argparse.Namespace) -> object:
    """The --dba flags as a DbaParams (None without --dba; the parameters alone are refused)."""
    from ..ann.neighbours import DEFAULT_ALPHA, DEFAULT_DEPTH, DEFAULT_K, DbaParams

    if not args.dba:
        if (args.dba_k, args.dba_alpha, args.dba_depth) != (DEFAULT_K, DEFAULT_ALPHA, DEFAULT_DEPTH):
            raise UsageError("--dba-k/--dba-alpha/--dba-depth need --dba")
        return None
    return DbaParams(args.dba_k, args.dba_alpha, args.dba_depth)


def build_with_ray_command(args: argparse.Namespace, dba_verdict: bool) -> Manifest:
    """``indexer build --ray``: the build and its shard summary line (flags checked by `build`;
    ``dba_verdict``: DBA is the default's, as ``build_index``)."""
    from ..directory.index_dir import SHARDS_DIR
    from ..build.ray_build import build_with_ray

    m = build_with_ray(args.gallery, args.out, args.model, address=args.ray, shards=args.shards,
                       max_retries=args.max_retries, cpus_per_shard=args.cpus_per_shard,
                       batch_size=args.batch_size, workers=args.workers, device=args.device,
                       progress=not args.quiet, wait=args.wait, sharded=args.sharded,
                       options=build_options(args), dba=dba_params(args), dba_verdict=dba_verdict,
                       prune=args.prune)
    r = m.extra["ray"]
    skipped = m.ingest.skipped if m.ingest else 0
    print(f"{r['found']} files in {r['shards']} shards on Ray ({r['num_gpus']} GPU / "
          f"{r['num_cpus']} CPU per task; attempts per shard: {', '.join(map(str, r['attempts']))}), "
          f"{skipped} skipped" + (f" (reasons in {Path(args.out) / m.report})" if skipped else "")
          + f"; shards kept in {Path(args.out) / SHARDS_DIR}")
    return m


def ingest_line(found: int, new: int, unchanged: int, duplicates: int, skipped: int, embedded: int,
                report: Path) -> str:
    """The summary `build` and `add` print. "embedded" also counts stored images new to the model
    (a rebuild with another model), which are neither new nor unchanged."""
    return (f"{found} files: {new} new, {unchanged} unchanged, {duplicates} duplicate content"
            + (" (stored once; `indexer audit` lists the files)" if duplicates else "")
            + f", {skipped} skipped" + (f" (reasons in {report})" if skipped else "") + f"; {embedded} embedded"
            + (f" ({embedded - new} of them stored before: the model is another)" if embedded > new else ""))


def check_build_flags(args: argparse.Namespace, ray: bool) -> None:
    """Flags that exclude each other and an --out that cannot become an index: refused before
    the build prints its plan (a failing command says one thing)."""
    if ray and args.ray is None:
        raise UsageError(("--sharded" if args.sharded and args.shards is None else "--shards")
                         + " needs --ray (for one shard by hand use --shard i/n)")
    if ray and args.shard:
        raise UsageError("--shard and --ray exclude each other: --ray builds every shard itself")
    if args.sharded and args.dba:
        raise UsageError("--dba is not available with --sharded builds yet; build without "
                         "--sharded, or `indexer merge --dba` the shards")
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out}: a file is there; expected an index directory (new or existing)")


def check_same_gallery(args: argparse.Namespace) -> None:
    """Refuse to build a gallery into an index of another folder none of whose sampled images
    this gallery holds (``indexer build`` without --out twice: the second would keep the first's
    images, searchable under the first's labels, with one line): --prune replaces them. A gallery
    moved or mounted elsewhere holds its stored paths and goes on."""
    from ..errors import IndexerError
    from ..store.gallery import GalleryStore

    d = IndexDir(args.out)
    if args.prune or not d.store_dir.is_dir():
        return
    try:
        m = d.read_manifest()
        if m.gallery is None or Path(m.gallery) == args.gallery.resolve():
            return
        with GalleryStore(d.store_dir) as store:
            sample = store.path_sample(200)
    except (IndexerError, ValueError, OSError):       # a damaged index: the build says what is wrong
        return
    if sample and not any((args.gallery / p).exists() for p in sample):
        raise UsageError(f"--out {args.out} holds an index of {m.gallery} ({m.count} images, none found in "
                         f"{args.gallery}): give another --out, or --prune to replace its images with "
                         f"{args.gallery}'s (`indexer add {args.gallery} --index {args.out}` adds them to it)")


def build(args: argparse.Namespace) -> None:
    from ..build.single import build_index, gallery_files
    from ..store.walk import parse_shard

    ray = args.ray is not None or args.shards is not None or args.sharded
    check_build_flags(args, ray)
    gallery_files(args.gallery)       # missing or empty: one line before the plan and any export
    check_same_gallery(args)
    auto_int8, auto_dba = args.int8 is None, args.dba is None
    d = resolve_build_defaults(args)
    dba_params(args)                                      # bad --dba-* flags: refused before any export
    if args.ray is not None:                              # a Ray that could never start: likewise
        from ..ray.cluster import check_can_start

        check_can_start(args.ray)
    if args.model is None:                                # a first build exports it: say so first
        from embedder import default_model_path

        args.model = default_model_path(d.embedder, on_export=None if args.quiet else lambda m: print(
            f"indexer build: {m}", file=sys.stderr, flush=True))
    if args.int8:
        args.model = int8_model(args, fallback=auto_int8)
    before = _selected_at(args.out)
    if ray:
        m = build_with_ray_command(args, auto_dba)        # locks --out itself
        say_notes(d)
    else:
        shard = parse_shard(args.shard) if args.shard else None
        m = build_index(args.gallery, args.out, args.model, options=build_options(args), shard=shard,
                        batch_size=args.batch_size, workers=args.workers, device=args.device,
                        progress=not args.quiet, wait=args.wait, dba=dba_params(args), prune=args.prune,
                        dba_verdict=auto_dba)
        say_notes(d)
        ing = m.ingest
        print(ingest_line(ing.found, ing.new, ing.unchanged, ing.duplicates, ing.skipped, ing.embedded,
                          args.out / m.report))
        if ing.moved:
            print(f"indexer build: {ing.moved} stored files were moved or renamed within {args.gallery} (the same "
                  "image under a new path): their old paths dropped")
    say_absent(m, f"in {args.gallery}")
    if m.neighbours or (m.dba_check and auto_dba):
        m = dba_where_it_helps(args.out, m, drop=auto_dba, wait=args.wait)
    if m.is_shard:
        print(f"shard {m.shard.i}/{m.shard.n}: {m.count} images in {args.out}")
    else:
        print_index_line(m, args.out, kept=before is not None and m.selected_at == before)


def _selected_at(out: Path) -> str | None:
    """When the index at ``out`` had its type chosen (None: no index, or none recorded): the same
    after a build says it kept that index (``indexer.build.single.kept_index``)."""
    from ..errors import IndexerError

    d = IndexDir(out)
    try:
        return d.read_manifest().selected_at if d.exists() else None
    except (IndexerError, ValueError):
        return None


def say_absent(m: Manifest, where: str, command: str = "build") -> None:
    """The build's or merge's line on stored files its walk (or its shards) no longer hold."""
    ing = m.ingest
    if ing is not None and ing.absent:
        print(f"indexer {command}: {ing.absent} stored files are not {where} any more (deleted, or "
              "brought by `indexer add` from another folder): kept and searchable; --prune drops them",
              file=sys.stderr)
    if ing is not None and ing.pruned:
        print(f"indexer {command}: {ing.pruned} stored files not {where} any more: dropped (--prune)")


def merge(args: argparse.Namespace) -> None:
    if args.prune and args.sharded:
        raise UsageError("--prune with --sharded: the shards are the index (nothing is copied); "
                         "`indexer build GALLERY --shard i/n --prune` drops a shard's deleted files")
    auto_dba = args.dba is None
    d = resolve_merge_defaults(args)
    before = _selected_at(args.out)
    if args.sharded:
        from ..build.sharded import build_sharded

        m = build_sharded(args.shards, args.out, options=build_options(args), device=args.device,
                          progress=not args.quiet, wait=args.wait)      # locks --out and the shards
    else:
        from ..build.single import merge_shards

        m = merge_shards(args.shards, args.out, options=build_options(args), device=args.device,
                         progress=not args.quiet, wait=args.wait, dba=dba_params(args), dba_verdict=auto_dba,
                         prune=args.prune)
    say_notes(d, "merge")
    say_absent(m, "in the gallery or its shards", "merge")
    if m.neighbours or (m.dba_check and auto_dba):
        m = dba_where_it_helps(args.out, m, drop=auto_dba, wait=args.wait, command="merge")
    print_index_line(m, args.out, kept=before is not None and m.selected_at == before)


def add(args: argparse.Namespace) -> None:
    from ..build.update import add_images

    if any(part in ("..", ".") for part in args.prefix.replace("\\", "/").split("/")):
        raise UsageError(f"--prefix {args.prefix}: expected a folder path inside the index (labels and "
                         "stored paths start with it), without '.' or '..'")
    c = add_images(args.index, args.folder, args.model, prefix=args.prefix, batch_size=args.batch_size,
                   workers=args.workers, device=args.device, progress=not args.quiet, wait=args.wait)
    st = c.stats
    print(ingest_line(st.found, st.new, st.unchanged, st.duplicates, len(st.skipped), st.embedded,
                      Path(args.index) / REPORT))
    if c.shard is not None:
        print(f"added {c.added} vectors to shard {c.shard}; index now holds {c.manifest.count}, "
              f"retuned to {c.manifest.search_params}")
    else:
        print(f"added {c.added} vectors; index now holds {c.manifest.count}"
              + (f", nprobe {c.manifest.nprobe}" if c.manifest.nprobe else ""))
    hint = int8_hint(c.manifest, c.added, args.index)
    if hint:
        print(hint, file=sys.stderr)


def int8_hint(m: Manifest, added: int, index: str | Path) -> str | None:
    """One line when ``add`` takes an fp32 index of a default embedder past the images int8
    calibration needs: ``add`` keeps the index's model (a small gallery's), while a rebuild gives
    the gallery the default of its size (int8; the two-backbone pair where the CPU has int8 dot
    products). Else None."""
    from embedder.quantize import is_quantized

    from ..ann.options import INT8_MIN_IMAGES, default_embedder_of

    meta = m.model.metadata or {}
    if default_embedder_of(meta.get("source_hash")) is None or is_quantized(meta):
        return None
    if not m.count - added < INT8_MIN_IMAGES <= m.count:
        return None
    return (f"indexer add: the index now holds {m.count} images, enough for the int8 default; `add` keeps "
            f"its fp32 model: `python -m indexer build {m.gallery or 'GALLERY'} --out {index}` embeds them "
            "again with the default of this size")


def remove(args: argparse.Namespace) -> None:
    from ..build.update import remove_items

    c = remove_items(args.index, args.targets, wait=args.wait)
    print("\n".join(c.messages))
    print(f"index now holds {c.manifest.count}")


def repair(args: argparse.Namespace) -> None:
    from ..build.update import repair_index

    c = repair_index(args.index, batch_size=args.batch_size, workers=args.workers, device=args.device,
                     progress=not args.quiet, wait=args.wait)
    print(f"repaired: embedded {c.embedded}, added {c.added} and dropped {c.removed} "
          f"faiss vectors; index now holds {c.manifest.count}")


def print_index_line(m: Manifest, out: Path, *, kept: bool = False) -> None:
    params = f", {m.search_params}" if m.search_params else (
        f", nlist {m.nlist}, nprobe {m.nprobe}" if m.nlist else "")
    held = " on held-out queries" if m.heldout_queries else ""
    same = f"; kept: chosen {m.selected_at[:19]}Z for the same images, model and options" if kept else ""
    print(f"{m.index_type} index of {m.count} x {m.dim}{params}, recall@10 vs exact{held} "
          f"{m.recall_at_10:.3f} (target {m.target_recall}) in {m.build_seconds:.1f}s{same} -> {out}")
    if m.warning:
        print(f"warning: {m.warning}", file=sys.stderr)
