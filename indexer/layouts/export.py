"""``indexer export``: an index's stored vectors as a NumPy array and its items as CSV rows in
the same order, for work outside the engine (a UMAP, your own classifier, autofaiss, another
vector store), as clip-retrieval's inference writes them. Read in blocks, never whole."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from ..errors import IndexerError
from .index import Index

#: stored vectors read (and written) at a time
BLOCK = 65_536


def export_embeddings(index: Index, out: str | Path, *, progress: bool = False) -> int:
    """Write ``out`` (.npy: (n, dim) float32, L2-normalised, as searched) and ``out`` with .csv
    (row, id, label, path), the items the index's model embedded, ids ascending within a store;
    each file replaced whole. Returns n."""
    from tqdm.auto import tqdm

    out = Path(out)
    store, model = index.store, index.model_hash
    n = sum(len(ids) for ids, _ in store.iter_embeddings(model, BLOCK, vectors=False))
    if n == 0:
        raise IndexerError(f"{index.directory}: no stored vectors of its model to export")
    table = out.with_suffix(".csv")
    tmp_x, tmp_t = out.with_name(f".{out.name}.partial"), table.with_name(f".{table.name}.partial")
    x = np.lib.format.open_memmap(tmp_x, mode="w+", dtype=np.float32, shape=(n, index.dim))
    row = 0
    try:
        with open(tmp_t, "w", newline="") as fh, tqdm(total=n, desc="exporting", unit="vector",
                                                       disable=not progress, mininterval=1.0) as bar:
            w = csv.writer(fh)
            w.writerow(["row", "id", "label", "path"])
            for ids, v in store.iter_embeddings(model, BLOCK):
                metas = store.get_metas(ids.tolist())
                x[row:row + len(ids)] = v           # more than counted: ValueError
                w.writerows([row + j, int(i), metas[int(i)].get("label") or "", metas[int(i)]["path"]]
                            for j, i in enumerate(ids))   # removed since: KeyError
                row += len(ids)
                bar.update(len(ids))
        if row != n:
            raise KeyError(row)
    except (KeyError, ValueError):
        tmp_x.unlink(missing_ok=True)            # the mapping goes with ``x``
        tmp_t.unlink(missing_ok=True)
        raise IndexerError(f"{index.directory}: images were added or removed during the export; "
                           "run it again") from None
    x.flush()
    del x
    tmp_x.replace(out)
    tmp_t.replace(table)
    return n


__all__ = ["export_embeddings"]
