"""The commands that read an index directory: search, eval, info (the manifest's facts, the
layout's parts, the selection's table)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from embedder.cli import UsageError

from ..ann.new_photos import NOVEL_P, no_close_match
from ..directory.manifest import Manifest
from ..errors import IndexerError


DBA = {"auto": None, "on": True, "off": False}


def open_index(args: argparse.Namespace, check_model: bool = True, strict: bool = False) -> Any:
    """``Index.open`` with the reading commands' flags; ``--ray``/``--shard-timeout`` as its ``ray``
    (``strict``, eval: a shard left out fails the run in one line)."""
    from ..layouts.index import Index
    from ..ray.fanout import RayServing

    ray = None if args.ray is None else RayServing(address=args.ray, timeout=args.shard_timeout, strict=strict)
    return Index.open(args.index, device=args.device, check_model=check_model, max_memory=args.max_memory,
                      ray=ray)


def warn_partial(partial: Any, args: argparse.Namespace) -> None:
    if len(partial):     # over Ray, a shard did not answer in time: said, on stderr
        print(f"indexer search: warning: partial answer: shard(s) {', '.join(map(str, partial))} did not "
              f"answer within {args.shard_timeout:g} s", file=sys.stderr)


def search(args: argparse.Namespace) -> None:
    """``indexer search IMAGE [--box]``, or ``indexer search FOLDER [--out FILE]`` (batch)."""
    from embedder.regions import load_region, parse_box

    box = parse_box(args.box, "--box")
    if args.copies and box is not None:
        raise UsageError("--copies checks whole images; a region is not one (drop --box)")
    if args.image.is_dir():
        if box is not None:
            raise UsageError("--box is a region of one image; a folder is searched whole")
        return search_folder(args)
    if args.out is not None:
        raise UsageError("--out is for a folder of queries (one image prints its results)")
    # closed on return: LMDB allows one environment a path per process (main() may run again)
    with open_index(args) as idx:
        labels = idx.check_labels(args.label or [])        # a wrong label fails before any decoding
        if not args.image.is_file():
            scheme, sep, _ = str(args.image).partition(":/")        # Path folds "https://" to "https:/"
            url = bool(sep) and scheme.isalpha()
            raise IndexerError(f"{args.image}: " + ("a URL: images are not downloaded; save it and give its path"
                                                    if url else "no such image or folder"))
        query = args.image if box is None else load_region(    # decoded no larger than the box needs
            args.image, box, idx.decode_side, name=str(args.image), field="--box")
        found = idx.answer(idx.embed([query]), args.k, dba=DBA[args.dba], labels=labels)
        hits = idx.hits(found.scores[0], found.ids[0])
        marks = copy_marks(args, idx, lambda _: args.image.read_bytes(), [hits])[0]
    warn_partial(found.partial, args)
    if found.novelty is not None and found.novelty[0] <= NOVEL_P:
        print(f"indexer search: {no_close_match(found.novelty[0])}", file=sys.stderr)
    if args.json:
        print(json.dumps([{**h.__dict__, **m} for h, m in zip(hits, marks)], indent=2))
    else:
        for r, (h, m) in enumerate(zip(hits, marks), 1):
            print(f"{r:3d}  {h.score:.4f}  id={h.id}  label={h.label}  {h.path}" + ("  COPY" if m.get("copy") else ""))
        if (vote := suggested(hits, None if found.novelty is None else float(found.novelty[0]))) is not None:
            print(f"suggested label: {vote['label']} (confidence {vote['confidence']:.2f})")


def suggested(hits: list[Any], novelty: float | None) -> dict | None:
    """{"label", "confidence"}: what the hits' labels vote for (:func:`indexer.ann.new_photos.suggest_label`;
    None with no close match)."""
    from ..ann.new_photos import suggest_label

    vote = suggest_label([h.label for h in hits], [h.score for h in hits], novelty)
    return None if vote is None else {"label": vote[0], "confidence": vote[1]}


def copy_marks(args: argparse.Namespace, idx: Any, query: Any, rows: list[list[Any]]) -> list[list[dict]]:
    """With ``--copies``, each hit's ``{"copy": bool}`` (:func:`indexer.audit.copies.copies`);
    else empty marks."""
    if not args.copies:
        return [[{} for _ in hits] for hits in rows]
    from ..audit.copies import copies

    found = copies(query, idx.image_bytes, [[(h.id, h.score) for h in hits] for hits in rows],
                   progress="" if args.quiet else "checking copies")
    return [[{"copy": c} for c in row] for row in found]


def search_folder(args: argparse.Namespace) -> None:
    """Every image under a folder searched in batches, its top-k written as JSON lines or CSV
    rows; an unreadable file is skipped and listed on stderr."""
    from ..layouts.evaluate import search_files

    if args.out is not None and args.out.suffix.lower() not in (".jsonl", ".csv"):
        raise UsageError(f"--out {args.out}: expected a .jsonl or .csv file")
    with open_index(args) as idx:
        rows, skipped, partial = search_files(idx, args.image, args.k, dba=DBA[args.dba],
                                              progress=not args.quiet, labels=idx.check_labels(args.label or []))
        marks = copy_marks(args, idx, lambda r: (args.image / rows[r][0]).read_bytes(), [h for _, h, _ in rows])
    warn_partial(partial, args)
    out = sys.stdout if args.out is None else None
    tmp = None if args.out is None else args.out.with_name(f".{args.out.name}.partial")
    with (open(tmp, "w", newline="") if tmp else out) as fh:       # replaced whole, never half written
        if args.out is not None and args.out.suffix.lower() == ".csv":
            import csv

            w = csv.writer(fh)
            w.writerow(["query", "rank", "id", "score", "label", "path", "novelty", "suggested", "confidence"]
                       + (["copy"] if args.copies else []))
            for (q, hits, p), ms in zip(rows, marks):
                vote = suggested(hits, p) or {"label": "", "confidence": ""}
                w.writerows([q, r, h.id, f"{h.score:.6f}", h.label, h.path, "" if p is None else f"{p:.6f}",
                             vote["label"], vote["confidence"] and f"{vote['confidence']:.4f}", *m.values()]
                            for r, (h, m) in enumerate(zip(hits, ms), 1))
        else:
            for (q, hits, p), ms in zip(rows, marks):
                fh.write(json.dumps({"query": q, "novelty": p, "suggested": suggested(hits, p),
                                     "results": [{**h.__dict__, **m} for h, m in zip(hits, ms)]}) + "\n")
    if tmp is not None:
        tmp.replace(args.out)
        print(f"{len(rows)} queries searched, top-{args.k} each -> {args.out}", file=sys.stderr)
    for s in skipped:
        print(f"indexer search: skipped {s['path']}: {s['reason']}", file=sys.stderr)
    novel = [q for q, _, p in rows if p is not None and p <= NOVEL_P]
    if novel:
        print(f"indexer search: {len(novel)} of {len(rows)} queries have no close match in the gallery (novelty "
              f"p <= {NOVEL_P:g}), e.g. {', '.join(novel[:3])}", file=sys.stderr)


def evaluate(args: argparse.Namespace) -> int:
    """``indexer eval``: a query folder or --leave-one-out, with and without DBA."""
    from ..layouts.evaluate import SURE, dba_verdict, evaluate_gallery, evaluate_queries, per_label_figure, weakest

    if args.max_queries is not None and not args.leave_one_out:
        raise UsageError("--max-queries needs --leave-one-out")
    if args.per_label is not None and args.per_label.suffix.lower() != ".csv":
        raise UsageError(f"--per-label {args.per_label}: expected a .csv file")
    dba = DBA[args.dba]
    with open_index(args, check_model=not args.leave_one_out, strict=True) as idx:
        if dba and not idx.has_dba:
            raise ValueError(f"--dba on: {args.index} was built without DBA (rebuild with `indexer build --dba`)")
        if args.leave_one_out:
            res = evaluate_gallery(idx, args.k, dba=dba, max_queries=args.max_queries, progress=not args.quiet)
        else:
            res = evaluate_queries(idx, args.queries, args.k, dba=dba, progress=not args.quiet)
        stored = len(idx)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    if args.leave_one_out:
        print(f"{res['queries']} gallery items, each left out of its own results (leave-one-out)"
              + (f"; {res['lone']} more are the only image of their label: no query" if res["lone"] else "")
              + (f"; {res['unlabelled']} unlabelled (at the gallery root): in the results, no query"
                 if res["unlabelled"] else ""))
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
    if "dba_z" in res:
        z = res["dba_z"]
        print(f"DBA vs plain at Recall@1, same queries: McNemar z {z:+.2f} ({dba_verdict(z)})")
    sug = res["suggested"]
    print(f"Suggested label (the vote of the top-{sug['hits']}) right: {sug['accuracy']:.4f}; confident "
          f"(share >= {SURE:g}) for {100 * sug['confident']:.1f}% of the queries"
          + ("" if sug["confident_accuracy"] is None else f", right {sug['confident_accuracy']:.4f} of those"))
    worst = weakest(res["per_label"])
    print(f"Weakest labels at Recall@1 (of {len(worst)}): "
          + ", ".join(f"{lab} {r:.2f} ({n})" for lab, r, n in worst[:5]))
    if args.per_label is not None:       # every label, weakest first; replaced whole
        tmp = args.per_label.with_name(f".{args.per_label.name}.partial")
        with open(tmp, "w", newline="") as fh:
            import csv

            w = csv.writer(fh)
            w.writerow(["label", "queries", "recall@1"])
            w.writerows([lab, n, f"{r:.6f}"] for lab, r, n in worst)
        tmp.replace(args.per_label)
        per_label_figure(worst, args.per_label.with_suffix(".png"))
    beyond = sorted(set(args.k) - set(res["recall"]))
    if beyond:                            # more results than the index holds: no figure, said
        print(f"indexer eval: Recall@{', @'.join(map(str, beyond))} not measured: the index holds {stored} "
              "images", file=sys.stderr)
    for s in res["skipped"][:10]:
        print(f"indexer eval: skipped {s['path']}: {s['reason']}", file=sys.stderr)
    if len(res["skipped"]) > 10:
        print(f"indexer eval: ... and {len(res['skipped']) - 10} more skipped (--json lists them)", file=sys.stderr)
    return 0


def export(args: argparse.Namespace) -> None:
    """``indexer export --out FILE.npy``: the vectors and, beside them, FILE.csv."""
    from ..layouts.export import export_embeddings
    from ..layouts.index import Index

    if args.out.suffix.lower() != ".npy":
        raise UsageError(f"--out {args.out}: expected a .npy file (the CSV is written beside it)")
    with Index.open(args.index) as idx:
        n = export_embeddings(idx, args.out, progress=not args.quiet)
        dim = idx.dim
    print(f"{n} vectors of {dim} dims -> {args.out}, their items -> {args.out.with_suffix('.csv')}")


def info(args: argparse.Namespace) -> None:
    """``indexer info``: the library's facts (indexer.build.update.info) as a table or JSON; counts
    that differ end in the one error line (exit 1) after the table."""
    from ..build.update import info

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
        print_layout(args.index, m, facts)
        if counts is not None:
            print(f"counts:   {counts.message if counts.ok else 'DIFFER (see below)'}")
    if counts is not None and not counts.ok:
        raise IndexerError(counts.message)


def print_layout(directory: Path, m: Manifest, facts: dict) -> None:
    """The table of either layout: what the manifest says, then its parts (a shard's folder
    named per line), the held-out part and the stores."""
    mod, shards = m.model, [p for p in facts["parts"] if p["shard"]]
    print(f"index:    {directory}" + (f" ({facts['layout']}: {len(shards)} shards searched as one)" if shards else ""))
    print(f"model:    {mod.backbone} {mod.hash[:12]} ({mod.dim}-d) from {mod.source}")
    if m.is_shard:
        print(f"shard:    {m.shard.i}/{m.shard.n} (merge before searching)")
    else:
        print(f"faiss:    {m.index_type} ({m.factory}), {m.count} vectors, metric {m.metric}")
        if m.search_params or m.nlist:
            print(f"search:   {m.search_params or f'nprobe={m.nprobe}'}" + (f", nlist {m.nlist}" if m.nlist else ""))
            print(f"recall:   {m.recall_text()}")
        print_candidates(m)
        nb = m.neighbours
        if nb:
            print(f"rerank:   DBA, k={nb.k} (item included), weights sim^{nb.alpha:g}, top "
                  f"{nb.depth} re-ranked (neighbours.npz, {(nb.bytes or 0) / 2 ** 20:.1f} MiB)")
        elif m.dba_check:
            from ..layouts.evaluate import dba_figures

            print(f"rerank:   none: the build's check found DBA behind ({dba_figures(m.dba_check)}, {m.dba_check.at})")
        for i, s in enumerate(shards):
            print(f"shard {i}:  {s['shard']}: {s['images']} images stored, {s['vectors']} vectors in its part")
        if facts["held"] is not None:
            print(f"held-out: {facts['held']} vectors in the held-out part")
        print(f"checksum: {facts['checksums']}")
    st = facts["store"]
    print(f"store:    {st['items']} images, {st['labels']} labels, embeddings from {st['models']} model(s)")
    print(f"built:    {m.built_at} in {m.build_seconds}s; skipped "
          f"{m.ingest.skipped if m.ingest else 0} (see {m.report})")


def print_candidates(m: Manifest) -> None:
    """The selection's table (manifests from before it have none: nothing is printed)."""
    from ..errors import size_text

    rows = m.candidates
    if not rows:
        return
    print(f"chosen by measurement in {m.selection_seconds or 0:.1f}s on a sample "
          f"(q/s: one batch of the tuning queries, Flat's scaled to the gallery size; memory "
          f"extrapolated to the gallery"
          + (f"; budget {size_text(m.max_memory)}" if m.max_memory else "") + "):")
    print(f"  {'':1} {'type':7} {'factory':32} {'search params':34} {'recall':>6} {'q/s':>9} "
          f"{'MiB':>7} {'build s':>7}")
    for r in rows:
        mark = "*" if r.chosen else ("-" if not (r.meets_target and r.fits_memory) else "")
        print(f"  {mark:1} {r.index_type:7} {r.factory:32} {r.search_params or '(exact)':34} "
              f"{r.recall_at_10:6.3f} {r.rank_qps if r.rank_qps is not None else r.qps:9,.0f} {r.memory_bytes / 2 ** 20:7.0f} "
              f"{r.build_seconds:7.1f}")
    print("  (* chosen, - misses the target or the memory budget)")
