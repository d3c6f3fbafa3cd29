"""``indexer eval``: Recall@k on a labelled query folder, or leave-one-out on the gallery. A query
whose content is in the gallery (same id) is removed from its own results, and passed to DBA as
``exclude`` (its neighbours' augmented vectors rebuilt without it): a leave-one-out figure is what
the photo gets as a query the gallery never held.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from embedder.folders import walk_gallery

from ..ann.new_photos import suggest_label
from ..directory.manifest import DbaCheckRecord
from ..errors import IndexerError
from ..store.gallery import id_for_sha256
from .index import Index


def _ks(ks: Sequence[int]) -> list[int]:
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise IndexerError(f"k values {ks}: expected positive integers")
    return ks


#: queries searched at a time: a leave-one-out of a million 2,560-d items held 10 GB of query
#: vectors at once; a block holds 40 MB, and the bar moves a block at a time
BLOCK = 4096
Vectors = Callable[[int, int], np.ndarray]      # (lo, hi) -> the vectors of queries lo..hi-1


#: a suggested label whose share of the vote is at least this is "confident" in `indexer eval`
#: (new photos of the validation classes: right 99.4-99.5%, benchmarks/indexer/new_photos.py)
SURE = 0.9


def _recall(found: list[list[str | None]], labels: Sequence[str], ks: list[int]) -> tuple[dict[int, float], np.ndarray]:
    """Recall@k of queries whose results' labels are ``found``, and whether each one's first
    result has its label."""
    from embedder.metrics import recall_at_k_of_labels

    rec = recall_at_k_of_labels(found, list(labels), ks)
    top1 = np.array([bool(row) and row[0] == lab for row, lab in zip(found, labels)], dtype=bool)
    return {int(k): float(v) for k, v in rec.items()}, top1


def _both(index: Index, vectors: Vectors, labels: Sequence[str], own: Sequence[int | None],
          ks: list[int], dba: bool | None, progress: bool = False) -> dict:
    """The figures as asked (``dba``; None: as the index serves by default) and, for an index
    with DBA neighbourhoods, the other setting beside them (``recall_plain`` / ``recall_dba``) and
    ``dba_z``: McNemar's z of DBA's R@1 against plain's on the same queries (> 0: DBA ahead;
    |z| < 2: within the noise); ``per_label``: each query label's queries and Recall@1 (as
    asked). ``BLOCK`` queries at a time (``own[r]``: the gallery id query r is, left out and
    guarded), each block's vectors read once for both settings and its neighbours' labels in
    one transaction."""
    from tqdm.auto import tqdm

    used = index.has_dba if dba is None else bool(dba)
    settings = [used, not used] if index.has_dba else [used]
    kmax = min(ks[-1], len(index))
    found: dict[bool, list[list[str | None]]] = {s: [] for s in settings}
    votes: list[tuple[str, float] | None] = []          # the suggested label, as asked
    with tqdm(total=len(labels), desc="searching", unit="query", disable=not progress, mininterval=1.0) as bar:
        for lo in range(0, len(labels), BLOCK):
            hi = min(len(labels), lo + BLOCK)
            q = vectors(lo, hi)
            for s in settings:
                got = index.answer(q, kmax, dba=s, exclude=list(own[lo:hi]))
                ids = got.ids
                metas = index.metas(np.unique(ids[ids >= 0]).tolist())    # one gone since: a miss (None)
                rows = [[metas[int(i)].get("label") if int(i) in metas else None for i in row if i >= 0]
                        for row in ids]
                found[s] += rows
                if s == used:
                    votes += [suggest_label(r, sc[i >= 0], p) for r, sc, i, p in zip(rows, got.scores, ids, got.p_values())]
            bar.update(hi - lo)
    measured = [k for k in ks if k <= kmax]
    rec, top1 = _recall(found[used], labels, measured)
    names, of = np.unique(np.asarray(labels, dtype=str), return_inverse=True)
    n, hit = np.bincount(of, minlength=len(names)), np.bincount(of, weights=top1, minlength=len(names))
    right = np.array([v is not None and v[0] == lab for v, lab in zip(votes, labels)], dtype=bool)
    sure = np.array([v is not None and v[1] >= SURE for v in votes], dtype=bool)
    out: dict[str, Any] = {"recall": rec, "dba": used,      # which labels the search serves worst
                           "per_label": {str(k): {"queries": int(c), "recall@1": float(h / c)}
                                         for k, c, h in zip(names, n, hit)},
                           # auto-labelling: how often the hits' vote names the query's label
                           "suggested": {"hits": kmax, "accuracy": float(right.mean()), "confident": float(sure.mean()),
                                         "confident_accuracy": float(right[sure].mean()) if sure.any() else None}}
    if index.has_dba:
        out["recall_dba" if not used else "recall_plain"], other = _recall(found[not used], labels, measured)
        with_dba, plain = (top1, other) if used else (other, top1)
        ahead, behind = int((with_dba & ~plain).sum()), int((plain & ~with_dba).sum())
        out["dba_z"] = (ahead - behind) / float(np.sqrt(ahead + behind)) if ahead + behind else 0.0
    return out


def weakest(per_label: dict[str, dict]) -> list[tuple[str, float, int]]:
    """(label, Recall@1, queries) of an evaluation's ``per_label``, weakest first (then by name)."""
    return sorted(((lab, v["recall@1"], v["queries"]) for lab, v in per_label.items()), key=lambda t: (t[1], t[0]))


def per_label_figure(worst: list[tuple[str, float, int]], out: str | Path, most: int = 40) -> None:
    """A PNG of the ``most`` weakest labels' Recall@1 (:func:`weakest`'s order), bars with their
    query counts, written to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = worst[:most][::-1]                      # the weakest at the top
    fig, ax = plt.subplots(figsize=(6.5, 1.2 + 0.22 * len(shown)), dpi=110)
    ax.barh(range(len(shown)), [100 * r for _, r, _ in shown], color="#4c72b0")
    ax.set_yticks(range(len(shown)), [f"{lab[:40]} ({n})" for lab, _, n in shown], fontsize=7)
    ax.set(xlabel="Recall@1 (%)", xlim=(0, 100))
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"the {len(shown)} weakest of {len(worst)} labels (queries)", fontsize=9)
    fig.tight_layout()
    tmp = Path(out).with_name(f".{Path(out).name}.partial")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(out)                            # replaced whole


def evaluate_queries(index: Index, queries: str | Path, ks: Sequence[int] = (1, 2, 4, 8),
                     *, progress: bool = False, dba: bool | None = None) -> dict:
    """{"recall": {k: value}, "dba": used, "queries": n, "skipped": [...], "self_matches": m},
    plus "recall_plain" or "recall_dba" (the other setting) for an index with DBA."""
    queries = Path(queries)
    if not queries.is_dir():
        raise IndexerError(f"{queries}: query folder not found")
    ks = _ks(ks)
    files = list(walk_gallery(queries))
    skipped = [{"path": f.relpath, "reason": f.problem} for f in files if f.problem]
    unlabeled = [f for f in files if not f.problem and f.label is None]
    skipped += [{"path": f.relpath, "reason": "no label (query at the folder root)"} for f in unlabeled]
    known = set(index.labels())         # a query of a label the gallery lacks finds nothing of it
    labelled = [f for f in files if not f.problem and f.label is not None]
    todo = [f for f in labelled if f.label in known]
    skipped += [{"path": f.relpath, "reason": f"no gallery image has its label {f.label!r}"}
                for f in labelled if f.label not in known]
    if not todo:
        raise IndexerError(f"{queries}: no labelled query images (put them in one folder per label)" if not labelled
                           else f"{queries}: no query's label is a label of the index (its folders are named "
                                f"as the gallery's, e.g. {sorted(known)[:3]})")

    def items() -> Iterator[tuple[tuple[str, str, int], bytes]]:
        for f in todo:
            try:
                data = f.abspath.read_bytes()
            except OSError as e:
                skipped.append({"path": f.relpath, "reason": f"unreadable: {e.strerror or e}"})
                continue
            yield (f.relpath, f.label, id_for_sha256(hashlib.sha256(data).hexdigest())), data

    keys, embs = [], []
    for kk, emb, failures in index.embedder.embed_iter(items(), progress=progress, total=len(todo)):
        keys += kk
        embs.append(emb)
        skipped += [{"path": key[0], "reason": getattr(e, "reason", str(e))} for key, e in failures]
    if not keys:
        raise IndexerError(f"{queries}: no query image could be read ({len(skipped)} skipped)")
    own = [own_id if own_id in index else None for _, _, own_id in keys]   # a query the gallery holds
    held = {lab: len(index.ids_for_label(lab)) for (_, lab, _), o in zip(keys, own) if o is not None}
    alone = [o is not None and held[lab] == 1 for (_, lab, _), o in zip(keys, own)]   # a label read once
    skipped += [{"path": key[0], "reason": "it is the gallery's only image of its label"}
                for key, a in zip(keys, alone) if a]
    keep = [i for i, a in enumerate(alone) if not a]
    if not keep:
        raise IndexerError(f"{queries}: each query is the gallery's only image of its label: nothing to find")
    keys, own = [keys[i] for i in keep], [own[i] for i in keep]
    x = np.concatenate(embs)[keep]
    res = _both(index, lambda lo, hi: x[lo:hi], [lab for _, lab, _ in keys], own, ks, dba, progress)
    return {**res, "queries": len(keys), "self_matches": sum(o is not None for o in own),
            "skipped": skipped}


def search_files(index: Index, folder: str | Path, k: int, *, dba: bool | None = None, progress: bool = False,
                 labels: Sequence[str] = ()) -> tuple[list[tuple[str, list, float | None]], list[dict], list[int]]:
    """Batch search of every image under ``folder``: ([(relative path, hits, novelty p-value or
    None)], skipped [{"path", "reason"}], shards left out); a gallery item stays in its results (as
    ``indexer search``); ``labels``: only images of these answer."""
    folder = Path(folder)
    if not folder.is_dir():
        raise IndexerError(f"{folder}: query folder not found")
    files = list(walk_gallery(folder))
    skipped = [{"path": f.relpath, "reason": f.problem} for f in files if f.problem]
    todo = [f for f in files if not f.problem]
    if not todo:
        raise IndexerError(f"{folder}: no query images ({len(skipped)} skipped)")
    out: list[tuple[str, list, float | None]] = []
    partial: set[int] = set()
    for keys, emb, failures in index.embedder.embed_iter(((f.relpath, f.abspath) for f in todo),
                                                         progress=progress, total=len(todo)):
        skipped += [{"path": key, "reason": getattr(e, "reason", str(e))} for key, e in failures]
        if keys:
            found = index.answer(emb, k, dba=dba, labels=labels)
            partial.update(found.partial)
            out += [(key, index.hits(s, i), p) for key, s, i, p in zip(keys, found.scores, found.ids, found.p_values())]
    if not out:
        raise IndexerError(f"{folder}: no query image could be read ({len(skipped)} skipped)")
    return out, skipped, sorted(partial)


def evaluate_gallery(index: Index, ks: Sequence[int] = (1, 2, 4, 8), *, dba: bool | None = None,
                     max_queries: int | None = None, seed: int = 0, progress: bool = False) -> dict:
    """Leave-one-out: each labelled item (a sample of ``max_queries``) queries the others with
    its stored vector, excluded and guarded. Same keys as :func:`evaluate_queries`, and ``lone``:
    the labelled items left out as the only image of their label, and ``unlabelled``: the items
    with no label (files at the gallery root), candidates in every query's results but no query."""
    ks = _ks(ks)
    ids, labels, lone, labelled = _labelled(index, max_queries, seed)
    if not ids:
        raise IndexerError(f"{index.directory}: each of its {lone} labels holds one image; leave-one-out needs "
                           "a second image of a query's label" if lone else
                           f"{index.directory}: the gallery has no labels to evaluate against")
    res = _both(index, lambda lo, hi: index.embeddings(ids[lo:hi]), labels, ids, ks, dba, progress)
    return {**res, "queries": len(ids), "self_matches": len(ids), "skipped": [], "lone": lone,
            "unlabelled": max(0, len(index) - labelled)}


@dataclass(frozen=True)
class DbaCheck:
    """Leave-one-out R@1 of labelled gallery items without and with DBA (same queries, guarded),
    and McNemar's z of the difference (> 0: DBA ahead; |z| < 2: within the noise)."""

    queries: int
    plain: float
    dba: float
    z: float


def dba_verdict(z: float) -> str:
    """McNemar's z of DBA against plain in words (|z| < 2: the 95% bar)."""
    return "within the noise" if abs(z) < 2 else "DBA ahead" if z > 0 else "DBA behind"


def dba_figures(c: DbaCheck | DbaCheckRecord) -> str:
    """A DBA check's figures in words (the check, or the manifest's record of it)."""
    return (f"leave-one-out R@1 of {c.queries} labelled images {100 * c.dba:.2f} with it, "
            f"{100 * c.plain:.2f} without")


def dba_check(index: Index, max_queries: int = 2000, seed: int = 0) -> DbaCheck | None:
    """:class:`DbaCheck` of an index with DBA on (a sample of) its labelled items; None when no
    label holds two images (nothing to measure)."""
    ids, labels, _, _ = _labelled(index, max_queries, seed)
    if not ids:
        return None
    r = _both(index, lambda lo, hi: index.embeddings(ids[lo:hi]), labels, ids, [1], True)
    return DbaCheck(len(ids), r["recall_plain"][1], r["recall"][1], r["dba_z"])


def labels_digest(held: Any) -> str:
    """sha256 of every label and its ids, of an :class:`Index` or a ``GalleryStore`` (the same
    two methods): what the build's DBA check measured on, so a rebuild keeps its verdict only
    while no image changed label (a file moved to another folder keeps its id)."""
    h = hashlib.sha256()
    for label in sorted(held.labels()):
        h.update(label.encode("utf-8") + b"\0")
        h.update(np.sort(np.asarray(held.ids_for_label(label), dtype=np.int64)).tobytes() + b"\0")
    return h.hexdigest()


def _labelled(index: Index, max_queries: int | None, seed: int) -> tuple[list[int], list[str], int, int]:
    """The ids (a seeded sample of ``max_queries``) and labels of the labelled items whose label
    has another item, how many are not (a label's only image finds nothing of its label:
    ``metrics.evaluate``'s rule), and how many items have a label."""
    by_label = [index.ids_for_label(lab) for lab in index.labels()]
    ids = [i for held in by_label if len(held) > 1 for i in held]
    if max_queries is not None and len(ids) > max_queries:
        ids = sorted(np.random.default_rng(seed).choice(ids, size=max_queries, replace=False).tolist())
    labels = [m[i].get("label") for lo in range(0, len(ids), BLOCK)   # a block's records at a time
              for m in [index.metas(ids[lo:lo + BLOCK])] for i in ids[lo:lo + BLOCK]]
    return ids, labels, sum(len(held) == 1 for held in by_label), sum(map(len, by_label))
