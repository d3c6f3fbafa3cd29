"""Low-rank galleries: unit vectors near a 16-dim subspace, the synthetic vectors of the indexer
and scaling benchmarks (``benchmarks/indexer/index_bench.py``, ``benchmarks/scaling/``) and of
the tests that need a gallery that behaves like real embeddings (tests/indexer)."""
from __future__ import annotations

import numpy as np

LR_RANK = 16        # intrinsic dimension: points lie near a 16-dim subspace of R^d
LR_CLUSTERS = 1000  # a mixture of clusters inside that subspace
LR_SPREAD = 0.8     # cluster spread relative to the spread of the centres (clusters overlap)
LR_NOISE = 0.1      # isotropic noise off the subspace, relative to the signal's norm


def low_rank_law(d: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(basis d x 16, cluster centres 1000 x 16): shared by a gallery and its queries."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.normal(size=(d, LR_RANK)))[0].astype(np.float32)
    return basis, rng.normal(size=(LR_CLUSTERS, LR_RANK)).astype(np.float32)


def low_rank(n: int, law: tuple[np.ndarray, np.ndarray], seed: int, chunk: int = 100_000) -> np.ndarray:
    """:func:`low_rank_labelled`'s vectors."""
    return low_rank_labelled(n, law, seed, chunk)[0]


def low_rank_labelled(n: int, law: tuple[np.ndarray, np.ndarray], seed: int,
                      chunk: int = 100_000) -> tuple[np.ndarray, np.ndarray]:
    """Unit vectors near a low-dimensional subspace, generated in chunks (1M x 512 is 2 GB), and
    each one's cluster (grouped, a label that occupies a region as a class does).

    Harder than index_bench's ``clustered``: in 16 dimensions a query's ten neighbours are
    nearly as far as the next hundred and lie in many IVF lists, which is how real image
    embeddings behave (their spectrum decays fast). With these constants IVF4096,Flat needs nprobe ~32 for
    recall@10 0.95 at 1M x 128.
    """
    import faiss

    basis, centres = law
    d = basis.shape[0]
    rng = np.random.default_rng(seed)
    out = np.empty((n, d), dtype=np.float32)
    cluster = np.empty(n, dtype=np.int64)
    for s in range(0, n, chunk):
        m = min(chunk, n - s)
        cluster[s:s + m] = rng.integers(0, len(centres), m)
        z = centres[cluster[s:s + m]] + LR_SPREAD * rng.normal(size=(m, LR_RANK))
        out[s:s + m] = z.astype(np.float32) @ basis.T
        out[s:s + m] += (LR_NOISE * np.sqrt(LR_RANK / d)) * rng.normal(size=(m, d)).astype(np.float32)
    faiss.normalize_L2(out)
    return out, cluster
