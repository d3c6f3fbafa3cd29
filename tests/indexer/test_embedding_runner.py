"""The one embedding runner (indexer.store.ingest.run: reader -> embedder -> writer, with per-stage
seconds) under the missing-embedding pass, and the one decode thread pool under it (issue 31)."""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np
import pytest

from embedder import OnnxEmbedder
from embedder.vectors import l2_normalize
from indexer.store.ingest import embed_missing, run
from indexer.store.gallery import GalleryStore, NewItem


def _item(path: str, data: bytes) -> NewItem:
    return NewItem(path, None, data, hashlib.sha256(data).hexdigest(), 105, 105)


def test_embed_missing_goes_through_the_runner_and_skips_a_bad_blob(tmp_path: Path, small_onnx: Path,
                                                                    omniglot_paths: list[Path]) -> None:
    """Stored images without this model's embedding (a rebuild with a new model): embedded from
    their stored bytes in commits of ``commit_every``, a blob the decoder refuses is reported
    (a warning naming its id) and left out, and the runner's stage times are reported."""
    emb = OnnxEmbedder(small_onnx, device="cpu", threads=1, batch_size=4)
    files = omniglot_paths[:9]
    good = [_item(f"a/{f.name}", f.read_bytes()) for f in files]
    bad = _item("a/broken.png", b"\x89PNG\r\n\x1a\n not really")
    with GalleryStore(tmp_path / "store", readonly=False) as st:
        st.put_items(good + [bad])                      # bytes only, no embeddings
        seconds: dict[str, float] = {}
        with pytest.warns(UserWarning, match=f"id {bad.id}: "):
            done = embed_missing(st, emb, workers=2, progress=False, commit_every=3, seconds=seconds)
        assert done == len(good)
        assert st.missing_embeddings(emb.model_hash) == [bad.id]
        got = st.get_embeddings(emb.model_hash, [it.id for it in good])
        np.testing.assert_allclose(got, l2_normalize(emb.embed(files)), atol=1e-5)
        assert set(seconds) == {"read", "embed", "write", "total"}
        with pytest.warns(UserWarning, match=f"id {bad.id}: "):
            assert embed_missing(st, emb, progress=False) == 0      # nothing left but the bad one


def test_run_decodes_in_the_embedders_pool_and_a_failed_commit_stops_it(small_onnx: Path,
                                                                       omniglot_paths: list[Path]) -> None:
    """``read`` runs in the embedder's decode threads (one pool for embed_iter and the indexer),
    batches reach ``commit`` L2-normalised and in input order, and a commit's failure is raised
    to the caller instead of being lost on the commit thread, with the threads stopped."""
    emb = OnnxEmbedder(small_onnx, device="cpu", threads=1, batch_size=2)
    threads: set[str] = set()
    got: list[tuple[list, np.ndarray]] = []

    def read(chunk: list[Path]) -> list[tuple[str, np.ndarray]]:
        threads.add(threading.current_thread().name)
        return [(p.name, emb.prepare(p)) for p in chunk]

    chunks = ([omniglot_paths[i], omniglot_paths[i + 1]] for i in range(0, 8, 2))
    run(emb, chunks, read, iter, lambda k, e: got.append((k, e)), workers=2, commit_every=3)
    assert threads and all(t.startswith("embed-decode") for t in threads)
    assert [k for keys, _ in got for k in keys] == [p.name for p in omniglot_paths[:8]]
    np.testing.assert_allclose(np.concatenate([e for _, e in got]),
                               l2_normalize(emb.embed(omniglot_paths[:8])), atol=1e-5)

    def fail(keys: list, e: np.ndarray) -> None:
        raise OSError("disk gone")

    many = ([omniglot_paths[i % 8]] * 2 for i in range(10_000))      # far more than gets read
    with pytest.raises(OSError, match="disk gone"):
        run(emb, many, read, iter, fail, workers=2, commit_every=1)
    assert not [t for t in threading.enumerate() if t.name.startswith(("embed-decode", "indexer-commit"))]
