"""One IVF index whose lists live in a file: the streaming build's filled parts combined on disk
(faiss's ``OnDiskInvertedLists``), written list by list, and read back memory-mapped. Not a
product path (moved out of indexer/ann/): the scaling benchmark's stage 4 and its tests use it."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import faiss
import numpy as np

from indexer import IndexerError
from indexer.ann import faiss_index as fx


def merge_ondisk(trained: faiss.Index, part_files: Sequence[str | Path], out_index: str | Path,
                 params: str = "") -> int:
    """Combine filled parts into one IVF index whose lists live in ``out_index`` + ``.ivfdata``
    (``OnDiskInvertedLists``; read back with ``read_ondisk``); returns the count. Not
    ``faiss.contrib.ondisk.merge_ondisk``, which maps everything (peak RSS ~2x the index): here
    codes and ids go in by ``os.pwrite``, one part mapped at a time (peak ~ the largest part).
    """
    out_index = Path(out_index)
    data = out_index.with_suffix(".ivfdata")
    data.unlink(missing_ok=True)
    if not fx.is_ivf(trained):
        raise IndexerError(f"{trained}: only IVF indexes merge on disk")
    index = faiss.clone_index(trained)
    ivf = faiss.extract_index_ivf(index)
    nlist, code_size = ivf.nlist, ivf.code_size
    sizes = np.zeros(nlist, dtype=np.int64)
    for f in part_files:                     # list sizes only: the lists stay on disk
        part = faiss.read_index(str(f), faiss.IO_FLAG_MMAP)     # (owns inv: keep it alive)
        inv = faiss.extract_index_ivf(part).invlists
        sizes += np.array([inv.list_size(l) for l in range(nlist)], dtype=np.int64)
        del part, inv
    cap = np.where(sizes > 0, 2 ** np.ceil(np.log2(np.maximum(sizes, 1))).astype(np.int64), 0)
    il = faiss.OnDiskInvertedLists(nlist, code_size, str(data))
    il.update_totsize(int(max(32, (cap * (code_size + 8)).sum())))   # one file, one map
    for l in np.nonzero(sizes)[0]:
        il.resize(int(l), int(sizes[l]))     # faiss picks the slot (capacity: a power of two)
    where = [(il.lists.at(int(l)).offset, il.lists.at(int(l)).capacity) for l in range(nlist)]
    done = np.zeros(nlist, dtype=np.int64)
    fd = os.open(data, os.O_WRONLY)
    try:
        for f in part_files:
            part = faiss.read_index(str(f), faiss.IO_FLAG_MMAP)
            inv = faiss.extract_index_ivf(part).invlists
            for l in range(nlist):
                n = inv.list_size(l)
                if not n:
                    continue
                off, capacity = where[l]
                codes = faiss.rev_swig_ptr(inv.get_codes(l), n * code_size)
                ids = faiss.rev_swig_ptr(inv.get_ids(l), n)
                os.pwrite(fd, codes, off + int(done[l]) * code_size)
                os.pwrite(fd, ids, off + capacity * code_size + int(done[l]) * 8)
                done[l] += n
            del part, inv                    # unmapped: its pages leave this process
        os.fsync(fd)
    finally:
        os.close(fd)
    ivf.replace_invlists(il, True)
    il.this.disown()
    index.ntotal = ivf.ntotal = int(sizes.sum())
    fx.set_search_params(index, params)
    fx.write_atomic(index, out_index)
    return int(index.ntotal)


def read_ondisk(path: str | Path) -> faiss.Index:
    """An index written by ``merge_ondisk``: its ``.ivfdata`` is found beside it (wherever the
    directory has moved) and memory-mapped."""
    return fx.no_prefetch(faiss.read_index(str(path), faiss.IO_FLAG_ONDISK_SAME_DIR))
