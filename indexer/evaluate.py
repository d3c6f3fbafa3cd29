"""``indexer eval``: Recall@k of an index on a labelled query folder.

The metric itself comes from ``embedder.metrics`` (one definition for training, indexing and
serving). A query whose exact content is in the gallery (same sha256, hence the same id) is
removed from its own results, as in the paper's protocol where the query is excluded.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from embedder.knn import drop_self

from .errors import IndexerError
from .index import Index
from .store import id_for_sha256
from .walk import walk_gallery


def evaluate_queries(index: Index, queries: str | Path, ks: Sequence[int] = (1, 2, 4, 8),
                     *, progress: bool = False) -> dict:
    """{"recall": {k: value}, "queries": n, "skipped": [...], "self_matches": m}."""
    from embedder.metrics import recall_at_k_of_labels

    queries = Path(queries)
    if not queries.is_dir():
        raise IndexerError(f"{queries}: query folder not found")
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise IndexerError(f"k values {ks}: expected positive integers")
    files = list(walk_gallery(queries))
    skipped = [{"path": f.relpath, "reason": f.problem} for f in files if f.problem]
    unlabeled = [f for f in files if not f.problem and f.label is None]
    skipped += [{"path": f.relpath, "reason": "no label (query at the folder root)"} for f in unlabeled]
    todo = [f for f in files if not f.problem and f.label is not None]
    if not todo:
        raise IndexerError(f"{queries}: no labelled query images (put them in one folder per label)")

    def items() -> Iterator[tuple[tuple[str, str, int], bytes]]:
        for f in todo:
            try:
                data = f.abspath.read_bytes()
            except OSError as e:
                skipped.append({"path": f.relpath, "reason": f"unreadable: {e.strerror or e}"})
                continue
            yield (f.relpath, f.label, id_for_sha256(hashlib.sha256(data).hexdigest())), data

    kmax = min(ks[-1], len(index))
    keys, embs = [], []
    for kk, emb, failures in index.embedder.embed_iter(items(), progress=progress):
        keys += kk
        embs.append(emb)
        skipped += [{"path": key[0], "reason": getattr(e, "reason", str(e))} for key, e in failures]
    if not keys:
        raise IndexerError(f"{queries}: no query image could be read ({len(skipped)} skipped)")
    scores, ids = index.search_embeddings(np.concatenate(embs), min(kmax + 1, len(index)))
    own = np.array([own_id for _, _, own_id in keys], dtype=np.int64)    # a query the gallery holds
    self_matches = int((ids == own[:, None]).any(1).sum())
    neighbor_labels = [[_label(index, int(i)) for i in row if i >= 0] for row in drop_self(ids, own, kmax)[0]]
    rec = recall_at_k_of_labels(neighbor_labels, [lab for _, lab, _ in keys], [k for k in ks if k <= kmax])
    return {"recall": {int(k): float(v) for k, v in rec.items()}, "queries": len(keys),
            "self_matches": self_matches, "skipped": skipped}


def _label(index: Index, id: int) -> str | None:
    """A neighbour's label; None (a miss) when it left the store after the index was loaded."""
    try:
        return index.meta(id).get("label")
    except KeyError:
        return None
