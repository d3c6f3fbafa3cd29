"""`indexer export` through the real CLI on the shared Omniglot indexes (a single Flat one and a
sharded IVF one): the .npy rows are the stored vectors of the CSV's ids, every item once, with
its label and path; a wrong file name is a usage error naming it."""
from __future__ import annotations

import csv

import numpy as np
import pytest

from indexer import Index
from indexer_testlib import run_cli


@pytest.mark.parametrize("which", ["single", "sharded"])
def test_export_writes_the_stored_vectors_and_their_items(tmp_path, built_index, two_shards, which):
    where = built_index if which == "single" else two_shards / "sharded"
    out = tmp_path / "vectors.npy"
    p = run_cli("export", "--index", where, "--out", out)
    assert "240 vectors of" in p.stdout
    x = np.load(out)
    with out.with_suffix(".csv").open() as fh:
        rows = list(csv.DictReader(fh))
    with Index.open(where) as idx:
        assert x.shape == (240, idx.dim) and x.dtype == np.float32
        ids = [int(r["id"]) for r in rows]
        assert [int(r["row"]) for r in rows] == list(range(240)) and len(set(ids)) == 240
        assert set(ids) == {i for lab in idx.labels() for i in idx.ids_for_label(lab)}
        np.testing.assert_array_equal(x, idx.embeddings(ids))
        metas = idx.metas(ids)
        assert [(r["label"], r["path"]) for r in rows] == [(metas[i]["label"], metas[i]["path"]) for i in ids]
    assert not list(tmp_path.glob(".*partial"))
    bad = run_cli("export", "--index", where, "--out", tmp_path / "v.txt", check=False)
    assert bad.returncode == 2 and "--out" in bad.stderr.strip().splitlines()[-1]
    assert "expected a .npy file" in bad.stderr.strip().splitlines()[-1]
