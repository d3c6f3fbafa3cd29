"""The commands that write an index directory: build (one process, ``--shard``, ``--ray``),
merge, add, remove, repair. Each holds the directory's writer lock through the library."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from embedder.cli import UsageError

from ..ann.options import BuildDefaults, BuildOptions
from ..directory.index_dir import REPORT, IndexDir, now_utc
from ..directory.manifest import DbaCheckRecord, Manifest


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


def int8_model(args: argparse.Namespace, *, fallback: bool = False) -> Path:
    """``indexer build --int8``: the int8 version of --model (or of the default), calibrated on the
    gallery (``int8_model_path``: the same gallery gives the same file), or the one the index at
    --out already has (:func:`kept_int8`). ``fallback`` (int8 by default, not asked for): a model
    whose int8 version misses the fp32 check, even bias-corrected, is built in fp32 with one line."""
    from embedder.quantize import QuantizationError, int8_model_path

    from ..directory.model import load_embedder

    fp32 = load_embedder(args.model, device="cpu").path   # the gallery: checked by `build` first
    try:
        return kept_int8(IndexDir(args.out), Path(fp32)) or int8_model_path(
            fp32, args.gallery, progress=not args.quiet, log=lambda m: print(f"indexer build: {m}", file=sys.stderr))
    except QuantizationError as e:
        if not fallback:
            raise
        print(f"indexer build: fp32 embedder: {e} (--int8 insists)", file=sys.stderr)
        return Path(args.model)


def kept_int8(d: IndexDir, fp32: Path) -> Path | None:
    """``d``'s own ``model.onnx`` when it is an intact int8 version of ``fp32`` (its quantisation
    metadata names fp32's hash). Why: a rebuild after photos were added would calibrate on a new
    list, get another int8 model and embed the whole gallery again (300 photos and one more: 301
    embedded, not 1)."""
    from embedder.hashing import file_sha256

    from ..directory.validate import check_model_file
    from ..errors import IndexerError

    if not d.exists():
        return None
    try:
        model = d.read_manifest().model
        check_model_file(d.model_file, model.hash)
        q = json.loads((model.metadata or {}).get("quantization") or "{}")
    except (IndexerError, ValueError):          # damaged: the build itself says what is wrong
        return None
    return d.model_file if isinstance(q, dict) and q.get("fp32_sha256") == file_sha256(fp32) else None


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


@dataclass(frozen=True)
class KeptIndex:
    """What the index already at --out tells a rebuild (:func:`kept_model`)."""

    name: str | None = None     # the default embedder it was built with, if one
    own: Path | None = None     # else its own model.onnx (a --model, a fine-tuned network say)
    int8: bool = False          # the default's model in it is int8
    count: int = 0              # images it holds: a rebuild keeps those added from other folders too


def kept_model(d: IndexDir) -> KeptIndex:
    """What a rebuild of the index at ``d`` without --model resumes with, so nothing is embedded
    again (an index keeps its embedder): its default embedder's name when it was built with one
    (:func:`~indexer.ann.options.default_embedder_of`; on another machine too, whatever that one's
    default), else its own ``model.onnx``: a --model, which the default used to replace, embedding
    every image again (all 200 of a gallery, measured). Nothing without an intact index: the build
    itself then says what is wrong."""
    from embedder.quantize import is_quantized

    from ..ann.options import default_embedder_of
    from ..directory.validate import check_model_file
    from ..errors import IndexerError

    if not d.exists():
        return KeptIndex()
    try:
        m = d.read_manifest()
        meta = m.model.metadata or {}
        name = default_embedder_of(meta.get("source_hash"))
        if name is None:
            check_model_file(d.model_file, m.model.hash)
    except (IndexerError, ValueError):
        return KeptIndex()
    return KeptIndex(name, None if name else d.model_file, bool(name) and is_quantized(meta), m.count)


def model_metadata(model: Path) -> dict[str, str]:
    """An exported embedder's metadata; {} where it cannot be read (the build's own load of the
    model then says what is wrong, in its words)."""
    from embedder.errors import ModelLoadError
    from embedder.runtime import read_metadata

    try:
        return read_metadata(model)
    except ModelLoadError:
        return {}


def resolve_build_defaults(args: argparse.Namespace) -> BuildDefaults:
    """``--int8``/``--dba`` left unset: decided by ``resolve_defaults`` on a bounded count of the
    gallery (the walk stopped at the largest threshold; labelled if one of those files is), with the
    embedder when there is no --model (an index's own is kept: :func:`kept_model`);
    its notes are a line per choice that turned one off or hangs on the CPU."""
    import itertools

    from embedder.pretrained import resolve_spec
    from embedder.folders import walk_gallery
    from embedder.quantize import int8_dot_product, is_quantized

    from ..ann.options import (EMBEDDER, EMBEDDER_INT8_DOT, INT8_MIN_IMAGES, dba_max_images, dba_min_images,
                               resolve_defaults)

    kept = kept_model(IndexDir(args.out))
    default, own = (None, None) if args.model else (kept.name, kept.own)
    if own is not None:
        args.model = own
    images, labelled = 0, False
    counted = args.int8 is None or args.dba is None
    meta = model_metadata(args.model) if args.model and counted else {}
    dim = int(meta["dim"]) if str(meta.get("dim", "")).isdigit() else None
    if counted:       # DBA's bound: the --model's width, else the narrowest default's (the larger count)
        narrowest = min(resolve_spec(n).dim for n in (EMBEDDER, EMBEDDER_INT8_DOT))
        most = dba_max_images(dim if args.model else narrowest) + 1 if args.dba is None else 0
        bound = max(INT8_MIN_IMAGES, dba_min_images(args.dba_k), most)
        for f in itertools.islice((f for f in walk_gallery(args.gallery) if f.problem is None), bound):
            images, labelled = images + 1, labelled or f.label is not None
    int8 = True if args.int8 is None and is_quantized(meta) else args.int8      # an int8 --model: as it is
    d = resolve_defaults(int8, args.dba,     # the images the index will hold: the folder's or more
                         model_given=args.model is not None, images=max(images, kept.count), labelled=labelled,
                         backbone=meta.get("backbone") if args.int8 is None else None, dim=dim,
                         mode="parts" if args.sharded else "shard" if args.shard else "process", dba_k=args.dba_k,
                         int8_dot=int8_dot_product(), kept=default, kept_int8=kept.int8)
    args.int8, args.dba = d.int8, d.dba
    if own is not None:
        d = replace(d, notes=(f"the embedder {args.out} was built with (its {own.name}; --model changes it)",
                              *d.notes))
    return replace(d, notes=()) if counted and images == 0 else d    # nothing readable: an error


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


def say_notes(d: BuildDefaults, command: str = "build") -> None:
    """The default's notes (what it turned off, and why), once the build has succeeded: a failing
    command says one thing."""
    for note in d.notes:
        print(f"indexer {command}: {note}", file=sys.stderr)


def dba_where_it_helps(out: Path, m: Manifest, *, drop: bool, wait: bool = False,
                       command: str = "build") -> Manifest:
    """DBA measured on the gallery's own labels: leave-one-out R@1 of up to 2,000 labelled images
    with and without it (``indexer eval --leave-one-out``'s search); where DBA is behind beyond the
    noise (McNemar's z < -2) the default's is dropped (``drop``), an asked-for one kept with a
    warning. Why: DBA's sign flips between sets: +-0.6 R@1 on the photo sets the default was chosen
    on, -3.7 on 1,000 Omniglot drawings, -0.9 for a fine-tuned pair in fp32 on unseen birds
    (docs/INDEXING.md#the-default). An unlabelled gallery keeps what it has. What it measured goes
    into the manifest (``dba_check``): a rebuild that keeps the index and the labels reuses it."""
    from ..build.single import with_dba_check, without_dba
    from ..layouts.evaluate import dba_check, dba_figures, labels_digest
    from ..layouts.index import Index

    c, when = m.dba_check, ""
    if c is not None:           # a kept index, the same labels: measured before (its manifest says when)
        when = f"measured {c.at} on the same index and labels; "
    else:
        with Index.open(out, device="cpu") as idx:
            got = dba_check(idx)
            if got is None:     # no label holds two images: nothing to measure
                return m
            p = m.neighbours
            c = DbaCheckRecord(selected_for=m.selected_for or "", labels=labels_digest(idx), k=p.k, alpha=p.alpha,
                               depth=p.depth, queries=got.queries, dba=got.dba, plain=got.plain, z=got.z, at=now_utc())
    if c.z >= -2 or not drop:
        if c.z < -2:
            print(f"indexer {command}: warning: DBA, asked for, is behind on this gallery: {dba_figures(c)} "
                  f"({when}--no-dba drops it; dba=false per request)", file=sys.stderr)
        return m if m.dba_check is not None or m.selected_for is None else with_dba_check(out, c, wait=wait)
    print(f"indexer {command}: no DBA: {dba_figures(c)} ({when}--dba keeps it)", file=sys.stderr)
    return m if m.neighbours is None else without_dba(out, wait=wait, check=c if m.selected_for else None)


def resolve_merge_defaults(args: argparse.Namespace) -> BuildDefaults:
    """``indexer merge`` without --dba/--no-dba: the build's rule (``resolve_defaults``) for the
    merged gallery, so shards merged give what one build of the gallery gives: the shards' image
    count, whether any is labelled, and whether their model is a default embedder."""
    from ..ann.options import default_embedder_of, resolve_defaults
    from ..build.single import check_shards
    from ..store.gallery import GalleryStore

    if args.sharded and args.dba:
        raise UsageError("--dba is not available with merge --sharded yet; merge without --sharded")
    images, labelled, source, dim = 0, False, None, None
    if args.dba is None and not args.sharded:
        dirs = [IndexDir(s) for s in args.shards]
        manifests = check_shards(dirs)           # what merging would refuse, refused first
        for d, m in zip(dirs, manifests):
            with GalleryStore(d.store_dir) as store:
                images, labelled = images + m.count, labelled or bool(store.labels())
        source, dim = (manifests[0].model.metadata or {}).get("source_hash"), manifests[0].dim
    d = resolve_defaults(False, args.dba, model_given=default_embedder_of(source) is None, images=images,
                         labelled=labelled, mode="parts" if args.sharded else "process",
                         dba_k=args.dba_k, dim=dim)
    args.dba = d.dba
    return d


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
