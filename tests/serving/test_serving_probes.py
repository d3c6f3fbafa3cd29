"""Probe maths on numpy: the scaling touches exactly the query's top-K channels, the shift is
r_b times an intra-class difference, and the stability figures count what they claim."""
from __future__ import annotations

import numpy as np
import pytest

from serving import probes as P


def _unit(rng: np.random.Generator, d: int = 32) -> np.ndarray:
    v = rng.standard_normal(d).astype(np.float32)
    return v / np.linalg.norm(v)


def test_topk_channels_are_signed_largest():
    v = np.array([0.1, -0.9, 0.5, 0.3, -0.2], dtype=np.float32)
    # signed, as DFS counts them: -0.9 is the smallest, not the largest
    assert P.topk_channels(v, 2).tolist() == [2, 3]
    with pytest.raises(ValueError, match="k <= 5"):
        P.topk_channels(v, 6)


def test_semantic_scaling_changes_only_topk_channels_before_normalising():
    rng = np.random.default_rng(0)
    v = _unit(rng)
    top = set(P.topk_channels(v, 4).tolist())
    raw, names = P.semantic_scaling(v, topk=4, scales=(0.5, 2.0), normalize=False)
    assert names == ["scale x0.5", "scale x2"]
    for row, s in zip(raw, (0.5, 2.0)):
        changed = set(np.nonzero(~np.isclose(row, v))[0].tolist())
        assert changed == top
        np.testing.assert_allclose(row[list(top)], s * v[list(top)], rtol=1e-6)
    out, _ = P.semantic_scaling(v, topk=4, scales=(0.5, 2.0))
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-5)
    # scaling the strongest channels up moves the probe towards them: cosine to v drops but stays high
    cos = out @ v
    assert np.all(cos < 1.0) and np.all(cos > 0.5)


def test_random_scaling_is_seeded_and_bounded():
    rng = np.random.default_rng(1)
    v = np.abs(_unit(rng)) + 0.01
    a, names = P.semantic_scaling(v, topk=6, scales=None, n_random=3, scale_range=0.3, seed=7, normalize=False)
    b, _ = P.semantic_scaling(v, topk=6, scales=None, n_random=3, scale_range=0.3, seed=7, normalize=False)
    c, _ = P.semantic_scaling(v, topk=6, scales=None, n_random=3, scale_range=0.3, seed=8, normalize=False)
    assert len(names) == 3
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    ratio = a / v
    assert np.all(ratio >= 0.7 - 1e-6) and np.all(ratio <= 1.3 + 1e-6)
    assert np.all((~np.isclose(ratio, 1.0)).sum(axis=1) <= 6)


def test_semantic_shifting_adds_scaled_difference():
    rng = np.random.default_rng(2)
    v, a, b = _unit(rng), _unit(rng), _unit(rng)
    raw, names = P.semantic_shifting(v, a, b, shifts=(0.5, 1.0), normalize=False)
    np.testing.assert_allclose(raw[0], v + 0.5 * (a - b), rtol=1e-6)
    np.testing.assert_allclose(raw[1], v + (a - b), rtol=1e-6)
    assert names == ["shift r_b=0.5", "shift r_b=1"]
    with pytest.raises(ValueError, match="dims differ"):
        P.semantic_shifting(v, a[:-1], b[:-1])


def test_bad_inputs_are_named():
    v = np.ones(8, dtype=np.float32)
    with pytest.raises(ValueError, match="scales"):
        P.semantic_scaling(v, scales=(0.5, -1.0))
    with pytest.raises(ValueError, match="NaN"):
        P.semantic_scaling(np.full(8, np.nan), scales=(2.0,))
    with pytest.raises(ValueError, match="at least one scale"):
        P.semantic_scaling(v, scales=(), n_random=0)


def test_overlap_and_precision():
    assert P.overlap_at_k([1, 2, 3, 4], [4, 3, 9, 8], 4) == 0.5
    assert P.overlap_at_k([1, 2, 3], [1, 2, 3], 3) == 1.0
    assert P.overlap_at_k([1, -1], [-1, 5], 2) == 0.0          # faiss padding never matches
    assert P.precision_at_k(["a", "b", "a", None], "a", 4) == 0.5
    assert P.precision_at_k(["a"], "a", 4) == 0.25              # missing results are misses
    rows = P.stability_rows([1, 2, 3], [0.9, 0.8, 0.7], ["a", "a", "b"],
                            [("p", "scaling", [3, 2, 7], [0.9, 0.8, 0.1], ["b", "a", "c"])], 3, "a")
    assert [r.name for r in rows] == ["original", "p"]
    assert rows[0].overlap == 1.0 and rows[0].precision == pytest.approx(2 / 3)
    assert rows[1].overlap == pytest.approx(2 / 3) and rows[1].precision == pytest.approx(1 / 3)
    assert P.stability_rows([1], [1.0], ["a"], [], 1, None)[0].precision is None
