"""Retrieval metrics against brute force and a hand-checked example."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from sklearn.metrics import normalized_mutual_info_score

from embedder.metrics import (cluster_scores, evaluate, knn, map_at_r, pair_f1,
                              recall_at_k, recall_at_k_of_labels)


def _brute_neighbors(x):
    d = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    np.fill_diagonal(d, np.inf)
    return np.argsort(d, axis=1, kind="stable")[:, :-1]          # self (inf) is last


@pytest.fixture()
def random_set():
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(12), rng.integers(2, 7, 12))
    centers = rng.normal(size=(12, 8)) * 0.8
    x = (centers[y] + rng.normal(size=(len(y), 8))).astype(np.float32)
    return x, y


def test_hand_checked_example():
    # 1-D points; classes: a a b b
    x = np.array([[0.0], [1.0], [0.4], [3.0]], dtype=np.float32)
    y = np.array([0, 0, 1, 1])
    _, ids = knn(x, x, 3, exclude_self=True)
    assert ids.tolist() == [[2, 1, 3], [2, 0, 3], [0, 1, 3], [1, 2, 0]]
    nl = y[ids]
    # R@1: query 0 -> 2 (b) miss, 1 -> 2 miss, 2 -> 0 miss, 3 -> 1 miss: 0; R@2: 0 hits at
    # rank 2 (1), 1 hits (0), 2 misses (1 is a), 3 hits (2): 3/4
    assert recall_at_k(nl, y, [1, 2, 3]) == {1: 0.0, 2: 0.75, 3: 1.0}
    # MAP@R with R = 1: precision at rank 1 only -> all zero
    assert map_at_r(nl, y, [1, 1, 1, 1]) == 0.0
    # with R = 2 for query 0: ranks (b, a): (0 + 1/2) / 2 = 0.25
    assert map_at_r(nl[:1], y[:1], [2]) == pytest.approx(0.25)


def test_recall_of_label_lists_codes_misses_once():
    # query "a": its first neighbour is unlabelled (None), then a hit at rank 2;
    # query "b": a short row (one neighbour found), of a label no query has; query "a" again:
    # a hit at rank 1. Missing, unlabelled and unknown neighbours never count as hits.
    rec = recall_at_k_of_labels([[None, "a", "b"], ["zz"], ["a"]], ["a", "b", "a"], [1, 2, 4])
    assert rec == {1: pytest.approx(1 / 3), 2: pytest.approx(2 / 3), 4: pytest.approx(2 / 3)}
    # the same as recall_at_k on the integer codes it stands for
    codes = np.array([[-1, 0, 1], [-1, -1, -1], [0, -1, -1]])
    assert recall_at_k(codes, np.array([0, 1, 0]), [1, 2]) == {1: rec[1], 2: rec[2]}
    with pytest.raises(ValueError, match="2 neighbour lists for 3 queries"):
        recall_at_k_of_labels([["a"], ["b"]], ["a", "b", "c"], [1])


def test_knn_matches_brute_force_in_blocks(random_set):
    x, y = random_set
    brute = _brute_neighbors(x.astype(np.float64))
    for block in (7, 4096):
        d, ids = knn(x, x, 5, exclude_self=True, block=block)
        assert (ids != np.arange(len(x))[:, None]).all()
        assert (ids == brute[:, :5]).mean() > 0.99                # ties may swap
        ref_d = ((x[:, None] - x[ids]) ** 2).sum(-1)
        np.testing.assert_allclose(d, ref_d, rtol=1e-4, atol=1e-4)


def test_knn_exclude_self_with_exact_duplicates():
    x = np.array([[0.0, 0.0], [0.0, 0.0], [5.0, 5.0]], dtype=np.float32)
    _, ids = knn(x, x, 2, exclude_self=True)
    assert ids[0].tolist() == [1, 2] and ids[1].tolist() == [0, 2]


def test_recall_and_map_against_brute_force(random_set):
    x, y = random_set
    brute = _brute_neighbors(x.astype(np.float64))
    nl = y[brute]
    ks = [1, 2, 4, 8]
    expected = {k: np.mean([y[i] in nl[i, :k] for i in range(len(y))]) for k in ks}
    got = recall_at_k(nl, y, ks)
    assert got == pytest.approx(expected)
    r = np.array([(y == y[i]).sum() - 1 for i in range(len(y))])
    aps = []
    for i in range(len(y)):
        hits, s = 0, 0.0
        for rank in range(r[i]):
            if nl[i, rank] == y[i]:
                hits += 1
                s += hits / (rank + 1)
        aps.append(s / r[i])
    assert map_at_r(nl, y, r) == pytest.approx(np.mean(aps))
    out = evaluate(x, y, ks, clustering=False)
    for k in ks:
        assert out[f"R@{k}"] == pytest.approx(expected[k], abs=0.02)
    assert out["MAP@R"] == pytest.approx(np.mean(aps), abs=0.02)


def test_pair_f1_against_all_pairs():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 5, 40)
    c = rng.integers(0, 6, 40)
    tp = fp = fn = 0
    for i, j in itertools.combinations(range(40), 2):
        same_c, same_y = c[i] == c[j], y[i] == y[j]
        tp += same_c and same_y
        fp += same_c and not same_y
        fn += same_y and not same_c
    p, r = tp / (tp + fp), tp / (tp + fn)
    assert pair_f1(y, c) == pytest.approx(2 * p * r / (p + r))
    assert pair_f1(y, y) == pytest.approx(1.0)


def test_cluster_scores_separated_and_random():
    rng = np.random.default_rng(2)
    y = np.repeat(np.arange(5), 20)
    x = (np.eye(5, 16)[y] * 50 + rng.normal(size=(100, 16))).astype(np.float32)
    good = cluster_scores(x, y, seed=0, nredo=5)
    assert good["nmi"] == pytest.approx(1.0) and good["f1"] == pytest.approx(1.0)
    noise = rng.normal(size=(100, 16)).astype(np.float32)
    bad = cluster_scores(noise, y, seed=0)
    assert bad["nmi"] < 0.3 and bad["f1"] < 0.4
    # NMI is sklearn's on the k-means assignment
    assert 0.0 <= bad["nmi"] <= 1.0
    assert normalized_mutual_info_score(y, y) == pytest.approx(1.0)


def test_evaluate_keys_and_perfect_embedding():
    y = np.repeat(np.arange(6), 4)
    x = (np.eye(6, 8)[y] * 10).astype(np.float32)
    out = evaluate(x, y, ks=(1, 2), seed=0)
    assert set(out) == {"R@1", "R@2", "NMI", "F1", "MAP@R"}
    assert all(v == pytest.approx(1.0) for v in out.values())


def test_an_item_alone_in_its_label_is_no_recall_query():
    """Its neighbours cannot hold its label: counted, it put R@k of a perfect embedding at 0.83
    (as PML's lone queries, and as MAP@R leaves it out); a set of such items has no R@k."""
    y = np.array([0, 0, 0, 1, 1, 1, 2])
    x = (np.eye(3, 4)[y] * 10).astype(np.float32)
    assert evaluate(x, y, ks=(1,), clustering=False)["R@1"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="none of the 3 labels holds two items"):
        evaluate(x[[0, 3, 6]], y[[0, 3, 6]], ks=(1,), clustering=False)


@pytest.mark.parametrize("call, match", [
    (lambda: knn(np.zeros((3, 2)), np.zeros((3, 4)), 1), "dim"),
    (lambda: knn(np.zeros((3, 2)), np.zeros((3, 2)), 3, exclude_self=True), "k=3"),
    (lambda: knn(np.full((2, 2), np.nan), np.zeros((2, 2)), 1), "NaN"),
    (lambda: recall_at_k(np.zeros((3, 2)), np.zeros(3), [4]), "k=4"),
    (lambda: recall_at_k(np.zeros((3, 2)), np.zeros(2), [1]), "neighbor_labels"),
    (lambda: map_at_r(np.zeros((3, 2)), np.zeros(3), [3, 1, 1]), "max\\(R\\) = 3"),
    (lambda: cluster_scores(np.zeros((3, 2)), np.zeros(3)), "at least 2 classes"),
])
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_r_at_1_and_map_at_r_agree_with_pytorch_metric_learning_on_real_photos(cub_mini, pretrained_onnx,
                                                                               tmp_path):
    """The field's reference (PML's AccuracyCalculator: precision_at_1, MAP@R) on the default
    embedder's vectors of 8 bird species, one of them cut to a single photo (a lone query both
    leave out). Ours is hand-written because `indexer eval` and the app must not import torch.
    PML runs in its own process: importing it patches faiss's search (faiss.contrib.torch_utils),
    which then refuses ``params=`` in every later test of this worker."""
    import json
    import subprocess
    import sys

    from embedder import OnnxEmbedder

    files = sorted(p for p in cub_mini.rglob("*") if p.is_file())
    lone = files[0].parent.name
    files = [f for f in files if f.parent.name != lone or f == files[0]]
    x = OnnxEmbedder(pretrained_onnx, device="cpu").embed(files)
    y = np.array([f.parent.name for f in files])
    _, first = np.unique(x.round(5), axis=0, return_index=True)    # identical photos: their order is a tie
    x, y = x[np.sort(first)], y[np.sort(first)]
    ours = evaluate(x, y, [1], clustering=False)
    np.savez(tmp_path / "v.npz", x=x, y=np.unique(y, return_inverse=True)[1])
    code = ("import json, sys, numpy as np, torch\n"
            "from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator\n"
            "v = np.load(sys.argv[1])\n"
            "calc = AccuracyCalculator(include=('precision_at_1', 'mean_average_precision_at_r'),\n"
            "                          k='max_bin_count', device=torch.device('cpu'))\n"
            "print(json.dumps(calc.get_accuracy(torch.from_numpy(v['x']), torch.from_numpy(v['y']))))\n")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "v.npz")], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    pml = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(x) > 80 and (y == lone).sum() == 1
    assert 0.5 < ours["R@1"] < 1.0 and 0.2 < ours["MAP@R"] < 1.0          # not a degenerate set
    # Two kNN codes may order two neighbours of nearly equal similarity either way (float32 sums
    # differ by CPU): only queries with such a near-tie between a same-label and another-label
    # neighbour within their first R + 1 may differ, each by at most 1 / n (here: none or one).
    sim = x.astype(np.float64) @ x.astype(np.float64).T
    np.fill_diagonal(sim, -np.inf)
    order = np.argsort(-sim, axis=1)[:, :int(np.bincount(np.unique(y, return_inverse=True)[1]).max())]
    near, rel = np.take_along_axis(sim, order, 1), y[order] == y[:, None]
    tied = int((((near[:, :-1] - near[:, 1:]) < 1e-5) & (rel[:, :-1] != rel[:, 1:])).any(axis=1).sum())
    n = len(x) - 1                                   # the lone query is none of either
    assert tied <= 3
    assert abs(ours["R@1"] - pml["precision_at_1"]) <= tied / n + 1e-6
    assert abs(ours["MAP@R"] - pml["mean_average_precision_at_r"]) <= tied / n + 1e-6
