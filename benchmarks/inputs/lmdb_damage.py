"""Damage inside an LMDB file, for the reliability probes and the tests (one copy of the layout
arithmetic: tests/indexer and benchmarks/reliability/index_probes.py both use it)."""
from __future__ import annotations

import struct
from pathlib import Path


def garbage_inside(data: Path, page: int = 4096) -> int:
    """Overwrite with garbage every page of an LMDB file but its two meta pages and the main
    database's root (the page naming the store's databases, so that the store still opens):
    its size is unchanged. LMDB's layout (lmdb.h, 64-bit): a meta page is a 16-byte page
    header, then magic, version, address, mapsize (24 bytes), then two 48-byte MDB_db records
    (free, main) whose last 8 bytes are the root page, then last_pgno and txnid. Returns the
    pages overwritten."""
    raw = data.read_bytes()
    metas = [raw[i * page:(i + 1) * page] for i in (0, 1)]
    txn = [struct.unpack_from("<Q", m, 16 + 24 + 2 * 48 + 8)[0] for m in metas]
    main_root = struct.unpack_from("<Q", metas[int(txn[1] > txn[0])], 16 + 24 + 48 + 40)[0]
    n = 0
    with open(data, "r+b") as f:
        for p in range(2, len(raw) // page):
            if p != main_root:
                f.seek(p * page)
                f.write(bytes([0xA5]) * page)
                n += 1
    return n
