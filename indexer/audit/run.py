"""One audit of an index directory: the kNN graph once, then the four kinds from it. (a)
near-duplicates and (c) outliers for every gallery; (b) mislabelled images and (d) confused class
pairs need labels: without, the summary says why they are missing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embedder.folders import label_of

from . import report
from .duplicates import (DEFAULT_THRESHOLD, MAX_DIFFER, MIN_INLIERS, DuplicateGroup, Pairs, candidates,
                         near_duplicates, scored_pairs, verify_pairs, verify_scored)
from .graph import KnnGraph, build_graph
from .labels import ClassView, ConfusedPair, class_view, confused_pairs, mislabelled
from .outliers import OutlierScores, outlier_scores, ranked
from .source import Gallery, open_gallery

DEFAULT_K = 10          # neighbours per image (chosen on validation classes)
DEFAULT_TOP = 1000      # rows written per ranked list (mislabelled, outliers)
#: candidate pairs verified by pixels at most, likeliest copies first (bounds the audit's time: about
#: 30-45 ms CPU a pair, docs/benchmarks/audit.md)
DEFAULT_VERIFY_MAX = 5000
KINDS = ("duplicates", "mislabelled", "outliers", "confused")
LABEL_KINDS = ("mislabelled", "confused")
NO_LABELS = ("the gallery has no labels (no image is in a class sub-folder): mislabelled and confused "
             "classes need them (outliers are ranked by kNN distance alone: a group of similar "
             "off-topic photos larger than k is not seen)")


@dataclass
class Audit:
    """What one audit found, by gallery row (``gallery.ids[row]`` is the image's id)."""

    gallery: Gallery
    graph: KnnGraph
    threshold: float
    duplicates: list[DuplicateGroup]
    outliers: OutlierScores
    view: ClassView | None = None                       # None: no labels
    confused: list[ConfusedPair] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)   # kind -> why not computed
    seconds: dict[str, float] = field(default_factory=dict)
    verified: dict[str, Any] = field(default_factory=dict)  # the pixel check of near-duplicates
    identical: dict[int, list[str]] = field(default_factory=dict)   # row -> its files, when several

    def mislabelled(self, top: int | None = None) -> np.ndarray:
        return np.zeros(0, dtype=np.int64) if self.view is None else mislabelled(self.view, top)

    def outlier_rows(self, top: int | None = None) -> np.ndarray:
        return ranked(self.outliers, top)


def run_audit(directory: str | Path | Gallery, *, k: int | None = None, threshold: float = DEFAULT_THRESHOLD,
              kinds: tuple[str, ...] = KINDS, progress: bool = False, ray: Any = None,
              verify: bool = True, verify_max: int = DEFAULT_VERIFY_MAX, **params: float) -> Audit:
    """Audit an index directory (or an opened :class:`Gallery`). ``kinds``: the ones asked for;
    asking for a label kind of a gallery without labels is an error (ValueError), not asking
    leaves them out with the reason in ``skipped``. ``verify``: near-duplicate candidates below
    the threshold checked by pixels (ORB + RANSAC, ``duplicates.verify_pairs``), at most ``verify_max``
    pairs, likeliest copies first, and the pairs above it (``duplicates.verify_scored``: those the
    pixels show are two pictures are dropped), at most ``verify_max``, lowest-scored first.
    ``params``: labels.class_view's weights."""
    bad = [x for x in kinds if x not in KINDS]
    if bad:
        raise ValueError(f"unknown audit kinds {bad}: expected some of {list(KINDS)}")
    if k is not None and k < 1:
        raise ValueError(f"-k {k}: expected a positive number of neighbours")
    if not -1.0 <= threshold <= 1.0:
        raise ValueError(f"--threshold {threshold}: a cosine similarity is between -1 and 1")
    if verify_max < 0:
        raise ValueError(f"--verify-max {verify_max}: expected 0 or more pairs")
    if isinstance(directory, Gallery):
        return _audit(directory, k, threshold, kinds, progress, verify, verify_max, params)
    g = open_gallery(directory, ray=ray)
    try:
        return _audit(g, k, threshold, kinds, progress, verify, verify_max, params)
    except BaseException:
        g.close()               # opened here and failed: nobody else can close it
        raise


def _audit(g: Gallery, k: int | None, threshold: float, kinds: tuple[str, ...], progress: bool, verify: bool,
           verify_max: int, params: dict[str, float]) -> Audit:
    t = {}
    t0 = time.perf_counter()
    if len(g.ids) < 2:
        raise ValueError(f"{g.directory}: the index holds 1 image; an audit compares images with each other")
    if k is None:               # the default on a tiny gallery: all its other images
        k = min(DEFAULT_K, len(g.ids) - 1)
    if len(g.ids) - 1 < k:
        raise ValueError(f"-k {k}: the gallery holds only {len(g.ids)} images, so each has at most "
                         f"{len(g.ids) - 1} others; use -k {max(1, len(g.ids) - 1)} or less")
    skipped: dict[str, str] = {}
    if not g.has_labels:
        asked = [x for x in kinds if x in LABEL_KINDS]
        if asked and tuple(kinds) != KINDS:
            raise ValueError(f"{g.directory}: {NO_LABELS}; asked for {', '.join(asked)}")
        skipped.update({x: NO_LABELS for x in LABEL_KINDS})
    graph = build_graph(g, k, progress=progress)
    t["graph"] = time.perf_counter() - t0
    view = None
    if g.has_labels:
        t0 = time.perf_counter()
        view = class_view(g, graph, **params)
        t["classes"] = time.perf_counter() - t0
    dups, checked, ident = [], {}, {}
    if "duplicates" in kinds:
        extra, scored = None, scored_pairs(graph, threshold)
        if verify and verify_max > 0:
            t0 = time.perf_counter()
            scored, dropped = _unrefuted(g, scored, verify_max, progress)
            extra, checked = _verified(g, graph, threshold, verify_max, progress)
            checked.update(dropped)
            t["verify"] = time.perf_counter() - t0
        dups = near_duplicates(scored, extra)
        ident = g.identical_files()
    t0 = time.perf_counter()
    out = outlier_scores(graph, view)
    conf = confused_pairs(view, graph) if view is not None and "confused" in kinds else []
    t["kinds"] = time.perf_counter() - t0
    skipped.update({x: "not asked for" for x in KINDS if x not in kinds and x not in skipped})
    return Audit(g, graph, threshold, dups, out, view, conf, skipped, t, checked, ident)


def _unrefuted(g: Gallery, scored: Pairs, cap: int, progress: bool = False) -> tuple[Pairs, dict[str, Any]]:
    """The pairs the score joined, less those the pixels show are two pictures
    (``duplicates.verify_scored``); the ``cap`` lowest-scored are checked, the rest kept as the
    score says."""
    a, b, cos, score, _ = scored
    order = np.lexsort((b, a, score))[:cap]
    v = verify_scored(a[order], b[order], g.image_bytes, progress="pixel checks, pairs above" if progress else "")
    counts: list[int | None] = [None] * len(a)
    keep = np.ones(len(a), dtype=bool)
    keep[order] = v.same
    for i, n in zip(order.tolist(), v.inliers.tolist()):
        counts[i] = n if n >= 0 else None
    info = {"scored": int(len(a)), "scored_checked": int(len(order)), "scored_dropped": int((~keep).sum())}
    return (a[keep], b[keep], cos[keep], score[keep], [n for n, k in zip(counts, keep) if k]), info


def _verified(g: Gallery, graph: KnnGraph, threshold: float, cap: int,
              progress: bool = False) -> tuple[tuple, dict[str, Any]]:
    """The candidate pairs below the threshold that the pixel check confirms, and its counts."""
    a, b, cos, score = candidates(graph, threshold)
    n = min(len(a), cap)
    t0, c0 = time.perf_counter(), time.process_time()
    v = verify_pairs(a[:n], b[:n], g.image_bytes, progress="pixel checks, band below" if progress else "")
    sec, cpu = time.perf_counter() - t0, time.process_time() - c0
    ok, inl = v.same, v.inliers
    info = {"band": int(len(a)), "checked": int(n), "confirmed": int(ok.sum()),
            "min_inliers": MIN_INLIERS, "max_differ": MAX_DIFFER,
            "ms_per_pair": round(1000 * sec / n, 1) if n else None,
            "cpu_ms_per_pair": round(1000 * cpu / n, 1) if n else None}
    return (a[:n][ok], b[:n][ok], cos[:n][ok], score[:n][ok], inl[ok]), info


# ---------------------------------------------------------------------------- writing
def _item(a: Audit, row: int) -> dict:
    g = a.gallery
    try:
        m = g.meta(row)
    except KeyError:                         # removed since the audit opened the store
        m = {}
    code = int(g.codes[row])
    return {"id": int(g.ids[row]), "path": m.get("path"), "label": g.label_names[code] if code >= 0 else None}


def _neighbours(a: Audit, row: int, n: int = 5) -> list[dict]:
    out = []
    for j, s in zip(a.graph.nbr[row][:n], a.graph.sim[row][:n]):
        if j >= 0:
            out.append({**_item(a, int(j)), "cosine": round(float(s), 4)})
    return out


def _f(x: float) -> float | None:
    return None if x is None or not np.isfinite(x) else round(float(x), 4)


def _duplicate_groups(a: Audit) -> list[dict]:
    """Groups of files that are one picture: byte-identical files first (one stored image under
    several paths, the graph cannot pair them: the same photo filed under two labels shows here),
    then the graph's near-duplicate groups, an image stored as several files listed once a file."""
    g = a.gallery

    def files(r: int) -> list[dict]:
        paths = a.identical.get(r)
        return [_item(a, r)] if paths is None else [{"id": int(g.ids[r]), "path": p, "label": label_of(p)}
                                                   for p in paths]

    def group(rows: list[int], pairs: list, max_cosine: float | None, max_score: float | None) -> dict:
        items = [it for r in rows for it in files(r)]
        return {"size": len(items), "max_cosine": max_cosine,
                "labels_differ": len({it["label"] for it in items}) > 1,
                "identical_files": sum(len(a.identical.get(r, [None])) - 1 for r in rows),
                "items": items, "max_score": max_score,
                "pairs": [{"a": int(g.ids[x]), "b": int(g.ids[y]), "cosine": _f(s), "score": _f(sc),
                           "inliers": n} for x, y, s, sc, n in pairs]}

    near = {r for grp in a.duplicates for r in grp.rows}
    alone = [group([r], [], 1.0, None) for r in sorted(a.identical, key=lambda r: a.identical[r]) if r not in near]
    return alone + [group(grp.rows, grp.pairs, _f(grp.max_sim), _f(grp.max_score)) for grp in a.duplicates]


def lists(a: Audit, top: int = DEFAULT_TOP) -> dict[str, list[dict]]:
    """The four lists as rows (what the JSONL files hold; the API can serve the same)."""
    g, out = a.gallery, {}
    out["duplicates"] = [{"group": i + 1, **grp} for i, grp in enumerate(_duplicate_groups(a)[:top])]
    if a.view is not None:
        v = a.view
        out["mislabelled"] = [{"rank": i + 1, **_item(a, r),
                               "suggested": g.label_names[v.suggested[r]] if v.suggested[r] >= 0 else None,
                               "score": _f(v.score[r]), "margin": _f(v.margin[r]), "p_label": _f(v.p_given[r]),
                               "p_suggested": _f(v.p_suggested[r]), "neighbours_agree": _f(v.knn_agree[r]),
                               "neighbours": _neighbours(a, r)}
                              for i, r in enumerate(a.mislabelled(top).tolist())]
        out["confused"] = [{"rank": i + 1, "label_a": g.label_names[p.a], "label_b": g.label_names[p.b],
                            "images_a": int(v.counts[p.a]), "images_b": int(v.counts[p.b]),
                            "edges": p.edges, "rate": _f(p.rate), "flagged": p.suggested}
                           for i, p in enumerate(a.confused)]
    o = a.outliers
    out["outliers"] = [{"rank": i + 1, **_item(a, r), "score": _f(o.score[r]), "knn_far": _f(o.knn_far[r]),
                        "class_far": _f(o.class_far[r]), "own_class_far": _f(o.own_far[r]),
                        "mixed_neighbours": _f(o.mixed[r]),
                        "neighbours": _neighbours(a, r)}
                       for i, r in enumerate(a.outlier_rows(top).tolist())]
    return out


COLUMNS = {
    "duplicates": ["group", "size", "max_cosine", "max_score", "labels_differ", "identical_files", "id", "path",
                   "label"],
    "mislabelled": ["rank", "id", "path", "label", "suggested", "score", "margin", "p_label", "p_suggested",
                    "neighbours_agree"],
    "outliers": ["rank", "id", "path", "label", "score", "knn_far", "class_far", "own_class_far",
                 "mixed_neighbours"],
    "confused": ["rank", "label_a", "label_b", "images_a", "images_b", "edges", "rate", "flagged"],
}


def summary(a: Audit, rows: dict[str, list[dict]]) -> dict:
    g = a.gallery
    near = {r for x in a.duplicates for r in x.rows}
    return {"index": str(g.directory), "images": int(len(g.ids)), "labels": len(g.label_names),
            "labelled_images": int((g.codes >= 0).sum()), "k": a.graph.k,
            "duplicate_threshold": a.threshold, "duplicates_verified": a.verified or None,
            "index_type": g.index.manifest.index_type,
            "scores": "exact" if g.exact_scores else "recomputed from the stored vectors",
            "found": {"duplicate_groups": len(a.duplicates) + len(set(a.identical) - near),
                      "duplicate_images": len(near | set(a.identical)),
                      "identical_files": sum(len(p) - 1 for p in a.identical.values()),
                      "identical_across_labels": sum(len({label_of(x) for x in p}) > 1
                                                     for p in a.identical.values()),
                      **({"mislabelled": int(len(a.mislabelled())), "confused_pairs": len(a.confused)}
                         if a.view is not None else {})},
            "written": {kind: len(r) for kind, r in rows.items()},
            "skipped": a.skipped, "seconds": {x: round(s, 2) for x, s in a.seconds.items()}}


def write_audit(a: Audit, out: str | Path, *, top: int = DEFAULT_TOP, sheets: bool = True) -> dict:
    """Write the lists, contact sheets and summary.json into ``out`` (replaced as a whole)."""
    rows = lists(a, top)
    info = summary(a, rows)
    with report.replacing_dir(Path(out)) as tmp:
        for kind, r in rows.items():
            flat = None
            if kind == "duplicates":        # the CSV: one line per member
                flat = [{**{c: grp[c] for c in COLUMNS[kind][:6]}, **it}
                        for grp in r for it in grp["items"]]
            report.write_rows(tmp, kind, r, COLUMNS[kind], flat)
        if sheets:
            info["sheets"] = _sheets(a, rows, tmp)
        (tmp / "summary.json").write_text(json_text(info))
    return info


def _sheets(a: Audit, rows: dict[str, list[dict]], tmp: Path) -> list[str]:
    g, done = a.gallery, []

    def cell(item: dict, extra: str = "") -> tuple[Any, str]:
        row = int(g.rows_of(np.array([item["id"]]))[0])
        try:
            data = g.image_bytes(row)
        except KeyError:
            data = b""
        return data, f"{item['label'] or '-'}{extra}"

    def nb_cells(r: dict) -> list:
        return [cell(r), *[cell(n, f" {n['cosine']:.2f}") for n in r["neighbours"]]]

    plan = {
        "duplicates": [[cell(it) for it in grp["items"][:report.SHEET_COLS]] for grp in rows["duplicates"]],
        "outliers": [nb_cells(r) for r in rows["outliers"]],
    }
    if "mislabelled" in rows:
        plan["mislabelled"] = [[cell(r, f" -> {r['suggested']}"), *nb_cells(r)[1:]] for r in rows["mislabelled"]]
    titles = {"duplicates": "near-duplicate groups (each row one group)",
              "mislabelled": "likely mislabelled: image (label -> suggested), then its nearest neighbours",
              "outliers": "outliers: image, then its nearest neighbours"}
    sheets = tmp / "sheets"
    sheets.mkdir()
    for kind, cells in plan.items():
        if report.contact_sheet(sheets / f"{kind}.png", cells, titles[kind]):
            done.append(f"sheets/{kind}.png")
    return done


def json_text(x: Any) -> str:
    import json

    return json.dumps(x, indent=2, ensure_ascii=False) + "\n"


def print_summary(info: dict, out: Path | None, file: Any = None) -> None:
    import sys

    f = file or sys.stdout
    fd = info["found"]
    print(f"audited {info['images']} images ({info['labelled_images']} labelled, {info['labels']} labels) "
          f"of {info['index']}, k={info['k']}, {info['index_type']} index", file=f)
    print(f"  near-duplicates: {fd['duplicate_groups']} groups, {fd['duplicate_images']} images "
          f"(pair score >= {info['duplicate_threshold']}: cosine + its lead over the neighbourhoods)", file=f)
    if fd.get("identical_files"):
        print(f"    files byte-identical to another: {fd['identical_files']} (stored once; filed under two "
              f"labels or more: {fd['identical_across_labels']} images)", file=f)
    v = info.get("duplicates_verified")
    if v and v.get("scored_checked"):
        print(f"    {v['scored_dropped']} of {v['scored_checked']} pairs above it dropped: under {v['min_inliers']} "
              "ORB + RANSAC inliers, or on backdrops the objects differ (other frames or photos of one object)"
              + (f"; {v['scored'] - v['scored_checked']} more kept unchecked: --verify-max"
                 if v["scored"] > v["scored_checked"] else ""), file=f)
    if v:
        print(f"    verified by pixels (ORB + RANSAC >= {v['min_inliers']} inliers, then aligned and compared): "
              f"{v['confirmed']} of "
              f"{v['checked']} candidate pairs below it confirmed"
              + (f" ({v['band'] - v['checked']} more left unchecked: --verify-max)"
                 if v["band"] > v["checked"] else ""), file=f)
    if "mislabelled" in fd:
        print(f"  likely mislabelled: {fd['mislabelled']} images nearer another label's images than their own", file=f)
        print(f"  confused class pairs: {fd['confused_pairs']} listed", file=f)
    print(f"  outliers: ranked, top {info['written']['outliers']} written", file=f)
    by_why: dict[str, list[str]] = {}       # one line a reason: an unlabelled gallery skips two kinds
    for kind, why in info["skipped"].items():
        by_why.setdefault(why, []).append(kind)
    for why, kinds in by_why.items():
        print(f"  {' and '.join(kinds)}: not computed: {why}", file=f)
    if out is not None:
        print(f"-> {out} (JSONL + CSV per kind, sheets/*.png, summary.json)", file=f)


__all__ = ["Audit", "run_audit", "write_audit", "lists", "summary", "print_summary", "DEFAULT_K",
           "DEFAULT_TOP", "DEFAULT_VERIFY_MAX", "KINDS"]
