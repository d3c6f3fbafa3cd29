"""What `indexer build` and `merge` get for a flag left unset: the embedder (an index keeps its
own), int8 (the gallery's own calibration, or the index's int8 model), DBA, and the check on the
gallery's labels that drops the default's DBA where it is behind. The commands: indexer.cli.write."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from embedder.cli import UsageError

from ..ann.options import BuildDefaults
from ..directory.index_dir import IndexDir, now_utc
from ..directory.manifest import DbaCheckRecord, Manifest


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
