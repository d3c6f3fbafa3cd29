"""(a) Near-duplicate groups: kNN-graph pairs whose similarity stands out, grouped by
union-find (a copy of a copy is one group), best pair first. Identical bytes are one item
already (ids are content hashes): found here are resized, re-encoded, cropped copies.

Score ``2 * cos(i, j) - max(d_i, d_j)``, ``d_i`` the mean cosine of i's 3rd..k-th neighbours (the
first two left out: a group of three copies does not raise its own baseline). Why not the cosine
alone: a category-trained embedder puts two photos of one crowded species as close (0.91 on
cub-dev) as a photo and its crop (0.90); only the copy stands out of its neighbourhood (cosine:
recall 0.67 at precision 0.95, this score 0.93 at 1.0; threshold 1.0: docs/benchmarks/audit.md).

Below the threshold the score cannot tell a crop from another photo of the species; the pixels
can. :func:`candidates` (an uncertain band) go to :func:`verify_pairs`: ORB keypoints (grayscale,
longest side ``SIDE``, so a resized copy looks like its original), descriptors matched both ways
with a ratio test, one similarity fitted by RANSAC; with ``MIN_INLIERS`` inliers b is mapped onto
a and compared pixel by pixel (:func:`disagreement`): frames from one tripod share a rigid
background (30-76 inliers) but differ on 6-27% of their overlap, a copy on under 0.4%. The RANSAC
is written here: scikit-image's fits one model per trial in Python (~130 ms a pair); a similarity
from two points is one complex division, so all trials are fitted at once in numpy (:func:`fit`).

Above the threshold the score also joins what is not one picture: frames of a render turning, a
plane taxiing, two off-domain photos far from everything else (their baselines low). Those pairs
are checked too (:func:`verify_scored`) and dropped below ``MIN_INLIERS`` inliers, with no pixel
comparison unless both are on a backdrop (an edit is what lowers a picture's score: caltech-val 11
of 74 dropped, all wrong by eye; on backdrops 5 more, and one edited render).
"""
from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
from tqdm.auto import tqdm

from .graph import KnnGraph, pairs_above

#: pair score (above) from which two images are near-duplicates (chosen on validation classes)
DEFAULT_THRESHOLD = 1.0
#: the uncertain band verified by pixels: pairs among each other's VERIFY_TOP nearest neighbours
#: scoring >= VERIFY_LOWER (and below the threshold); chosen on validation
VERIFY_TOP = 2
VERIFY_LOWER = 0.8
#: and each image's nearest neighbour scoring >= NEAREST_LOWER: a copy turned 90 degrees is mostly
#: its original's nearest (27 of 30 on cub-val) at scores 0.5-0.99, and ORB + RANSAC turn with it
#: (turned copies grouped on cub-val 15 -> 28 of 30, caltech-val 14 -> 22; no other pair confirmed)
NEAREST_LOWER = 0.5
# the pixel check (chosen on validation: docs/benchmarks/audit.md)
SIDE = 160              # pixels, longest side the images are scaled to (chosen on validation)
N_KEYPOINTS = 200       # ORB keypoints per image
N_SCALES = 2            # ORB pyramid levels (downscale 1.2 each: a crop to 85% is one level)
MIN_INLIERS = 30        # RANSAC inliers from which a pair is the same picture (chosen on validation)
RESIDUAL = 2.0          # pixels (at SIDE), an inlier's largest reprojection error
TRIALS = 256            # RANSAC trials (two-point samples) per pair
MAX_SCALE = 2.5         # a copy's largest scale factor either way (a crop to 40% of a side)
MAX_RATIO = 0.9         # match_descriptors' ratio test (Lowe's), on Hamming distances
MIN_OVERLAP = 0.5       # share of image a that b must cover once aligned (a crop to 85%: 0.72)
MAX_DIFFER = 0.05       # share of that overlap allowed to differ (chosen on validation, below)
# A backdrop (studio, catalogue: white around the object) agrees in any two such photos; it is left
# out of the share that differs when both borders are one flat level (not tuned: JPEG noise on
# white is 2-5 levels of 255; a photo's border is rarely 80% within 8 levels of one value, a clear
# sky's can be: then the sky, which agrees as trivially, is left out too).
BACKDROP_SHARE = 0.8    # share of an image's border pixels within BACKDROP_TOL of their median
BACKDROP_TOL = 8 / 255
CONTENT_TOL = 12 / 255  # a pixel is the object's where either image departs this far from its backdrop
CHUNK = 256             # pairs whose images are read, described and checked together
DEEP_SCALES = 6         # ORB pyramid levels of verify_scored's second try (1.2 ** 5 = 2.5 = MAX_SCALE)
DEEP_KEYPOINTS = 300    # its keypoints per image (spread over more levels)


@dataclass
class DuplicateGroup:
    rows: list[int]                      # ascending
    # the edges that joined it (a, b, cosine, score, RANSAC inliers: None when no pixel check counted them)
    pairs: list[tuple[int, int, float, float, int | None]]

    @property
    def max_sim(self) -> float:
        return max(p[2] for p in self.pairs)

    @property
    def max_score(self) -> float:
        return max(p[3] for p in self.pairs)


def baselines(graph: KnnGraph) -> np.ndarray:
    """Each row's neighbourhood cosine ``d_i``: the mean of its 3rd..k-th neighbours' (the
    last one alone for k <= 3)."""
    lo = min(2, graph.k - 1)
    sim = graph.sim[:, lo:]
    valid = ~np.isnan(sim)
    return (np.where(valid, sim, 0).sum(1) / np.maximum(valid.sum(1), 1)).astype(np.float32)


def candidates(graph: KnnGraph, threshold: float = DEFAULT_THRESHOLD, *, lower: float = VERIFY_LOWER,
               top: int = VERIFY_TOP, nearest_lower: float = NEAREST_LOWER
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(a, b, cos, score) of the pairs to verify by pixels, below ``threshold``: b among a's ``top``
    nearest (or a among b's) scoring >= ``lower``, or a's (b's) nearest scoring >= ``nearest_lower``;
    each unordered pair once (a < b), the likeliest copies first (:func:`band_order`: what
    ``--verify-max`` keeps)."""
    d = baselines(graph)
    top = min(top, graph.k)
    i = np.repeat(np.arange(len(graph), dtype=np.int64), top)
    j = graph.nbr[:, :top].ravel().astype(np.int64)
    cos = graph.sim[:, :top].ravel()
    first = np.tile(np.arange(top) == 0, len(graph))
    ok = j >= 0
    i, j, cos, first = i[ok], j[ok], cos[ok], first[ok]
    score = 2 * cos - np.maximum(d[i], d[j])
    ok = ((score >= lower) | (first & (score >= nearest_lower))) & (score < threshold)
    a, b, cos, score = np.minimum(i, j)[ok], np.maximum(i, j)[ok], cos[ok], score[ok]
    order = np.lexsort((b, a, -score))
    a, b, cos, score = a[order], b[order], cos[order], score[order]
    key = a * len(graph) + b
    _, first = np.unique(key, return_index=True)       # the best-scored direction of each pair
    a, b, cos, score = a[first], b[first], cos[first], score[first]
    order = band_order(graph, a, b, cos, score)
    return a[order], b[order], cos[order].astype(np.float32), score[order].astype(np.float32)


def band_order(graph: KnnGraph, a: np.ndarray, b: np.ndarray, cos: np.ndarray, score: np.ndarray) -> np.ndarray:
    """The band's pairs, likeliest copies first: mutual nearest neighbours first (the larger of
    the two ranks, each in the other's list), then by ``score + gap`` (gap: the pair's cosine
    above the better of the two runners-up, each image's nearest other than the pair), then by
    rows. Why: at 1M the band holds 0.2-0.8M pairs and ``--verify-max`` checks the first 5,000;
    by score alone the copies the score missed lay in the band's best 0-2.3% for 6 of 14 (4
    galleries), this way 9 of 14 (chosen on the validation halves: 0 -> 2 of 4; test halves 6 ->
    7 of 10; docs/benchmarks/audit.md)."""
    k = graph.k
    ab, ba = graph.nbr[a] == b[:, None], graph.nbr[b] == a[:, None]
    ranks = np.where(ab.any(1), ab.argmax(1), k), np.where(ba.any(1), ba.argmax(1), k)
    sim_a = np.where(ab, -np.inf, np.nan_to_num(graph.sim[a], nan=-np.inf)).max(1)
    sim_b = np.where(ba, -np.inf, np.nan_to_num(graph.sim[b], nan=-np.inf)).max(1)
    gap = cos - np.maximum(sim_a, sim_b)
    return np.lexsort((b, a, -(score + gap), np.maximum(*ranks)))


Pairs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list]   # a, b, cos, score, inliers (None: unchecked)


def scored_pairs(graph: KnnGraph, threshold: float = DEFAULT_THRESHOLD) -> Pairs:
    """The pairs scoring >= ``threshold`` (a < b as ``pairs_above`` gives them), inliers None."""
    d = baselines(graph)
    # score >= t needs 2 cos - d >= t, d <= 1: cos >= (t - 1) / 2 + ... ; prefilter by cos >= t - 1
    a, b, cos = pairs_above(graph, max(-1.0, (threshold + float(d.min(initial=1.0))) / 2 - 1e-6))
    score = 2 * cos - np.maximum(d[a], d[b])
    keep = score >= threshold
    return a[keep], b[keep], cos[keep], score[keep], [None] * int(keep.sum())


def near_duplicates(scored: Pairs, extra: Pairs | None = None) -> list[DuplicateGroup]:
    """Groups of rows joined by the ``scored`` pairs (:func:`scored_pairs`, less those the pixels
    refuted) and by the ``extra`` pairs (verified below the threshold), ordered by their best pair
    (then by first row: no order depends on a float tie)."""
    a, b, cos, score, inl = scored
    inl = list(inl)
    if extra is not None and len(extra[0]):
        ea, eb, ec, es, ei = extra
        a, b = np.concatenate([a, np.asarray(ea, np.int64)]), np.concatenate([b, np.asarray(eb, np.int64)])
        cos, score = np.concatenate([cos, ec]), np.concatenate([score, es])
        inl += [int(x) for x in ei]
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        root = x
        while parent.get(root, root) != root:
            root = parent[root]
        while parent.get(x, x) != root:             # path compression
            parent[x], x = root, parent[x]
        return root

    for x, y in zip(a.tolist(), b.tolist()):
        rx, ry = find(x), find(y)
        if rx != ry:
            parent[max(rx, ry)] = min(rx, ry)
    groups: dict[int, DuplicateGroup] = {}
    for x, y, v, sc, n in zip(a.tolist(), b.tolist(), cos.tolist(), score.tolist(), inl):
        grp = groups.setdefault(find(x), DuplicateGroup([], []))
        grp.pairs.append((x, y, float(v), float(sc), n))
    for grp in groups.values():
        grp.rows = sorted({r for p in grp.pairs for r in p[:2]})
        grp.pairs.sort(key=lambda p: (-p[3], p[0], p[1]))
    return sorted(groups.values(), key=lambda g: (-g.max_score, g.rows[0]))


# ---------------------------------------------------------------------------- the pixel check
Features = tuple[np.ndarray, np.ndarray]      # (k, 2) float32 x, y; (k, 32) uint8 packed bits


def gray(data: bytes, side: int = SIDE) -> np.ndarray | None:
    """The image in ``data`` as float32 grayscale in [0, 1], longest side ``side`` (None when it does
    not decode: the pair is not verified). Decoded by the project's one decoder (bounded memory, pixel
    limit: ``embedder.images.load_image``), since the audit also runs in the serving process."""
    from PIL import Image

    from embedder.images import load_image

    try:
        im = load_image(data, mode="L", min_side=side, stored=True)
    except Exception:                               # noqa: BLE001 - any undecodable bytes
        return None
    s = side / max(im.size)
    im = im.resize((max(1, round(im.width * s)), max(1, round(im.height * s))), Image.BILINEAR)
    return np.asarray(im, dtype=np.float32) / 255.0


def features(img: np.ndarray | None, n_keypoints: int = N_KEYPOINTS, n_scales: int = N_SCALES) -> Features:
    """ORB keypoints (x, y) and packed descriptors of an image (none for a flat or tiny image)."""
    from skimage.feature import ORB

    empty = (np.zeros((0, 2), np.float32), np.zeros((0, 32), np.uint8))
    if img is None or min(img.shape) < 32:
        return empty
    orb = ORB(n_keypoints=n_keypoints, n_scales=n_scales, fast_threshold=0.05)
    try:
        orb.detect_and_extract(img)
    except RuntimeError:                            # skimage: no keypoint found
        return empty
    return orb.keypoints[:, ::-1].astype(np.float32), np.packbits(orb.descriptors, axis=1)


def matches(fa: Features, fb: Features, max_ratio: float = MAX_RATIO) -> tuple[np.ndarray, np.ndarray]:
    """Points (complex x + iy) of the descriptor matches of two images: cross-checked nearest
    neighbours passing the ratio test."""
    from skimage.feature import match_descriptors

    (ka, da), (kb, db) = fa, fb
    none = np.zeros(0, np.complex128)
    if len(ka) < 2 or len(kb) < 2:
        return none, none
    m = match_descriptors(np.unpackbits(da, axis=1).astype(bool), np.unpackbits(db, axis=1).astype(bool),
                          metric="hamming", cross_check=True, max_ratio=max_ratio)
    if len(m) < 2:
        return none, none
    pa, pb = ka[m[:, 0]], kb[m[:, 1]]
    return pa[:, 0] + 1j * pa[:, 1], pb[:, 0] + 1j * pb[:, 1]


def inliers(za: np.ndarray, zb: np.ndarray, **kw: float) -> int:
    """The most matches one similarity transform maps onto each other (:func:`fit`)."""
    return fit(za, zb, **kw)[0]


def fit(za: np.ndarray, zb: np.ndarray, *, residual: float = RESIDUAL, trials: int = TRIALS,
        max_scale: float = MAX_SCALE, seed: int = 0) -> tuple[int, complex, complex]:
    """(inliers, alpha, beta): the most matches one similarity ``zb = alpha * za + beta`` maps within
    ``residual`` pixels over ``trials`` two-point samples fitted at once, refitted by least squares on
    the best sample's inliers and counted again (plain RANSAC, vectorised)."""
    n = len(za)
    if n < 2:
        return 0, 0j, 0j
    rng = np.random.default_rng(seed)
    if n * (n - 1) // 2 <= trials:                  # few matches: every pair of them
        i, j = np.triu_indices(n, 1)
    else:
        i = rng.integers(0, n, trials)
        j = (i + rng.integers(1, n, trials)) % n    # j != i
    dz = za[j] - za[i]
    ok = np.abs(dz) > 1e-6
    alpha = np.where(ok, (zb[j] - zb[i]) / np.where(ok, dz, 1), 0)
    scale = np.abs(alpha)
    ok &= (scale <= max_scale) & (scale >= 1 / max_scale)
    if not ok.any():
        return 0, 0j, 0j
    alpha, beta = alpha[ok], zb[i[ok]] - alpha[ok] * za[i[ok]]
    err = np.abs(alpha[:, None] * za[None, :] + beta[:, None] - zb[None, :])   # (trials, n)
    count = (err <= residual).sum(1)
    best = int(np.argmax(count))
    keep = err[best] <= residual
    if keep.sum() >= 3:                             # least-squares refit on the inliers
        a, b = za[keep], zb[keep]
        ma, mb = a.mean(), b.mean()
        den = np.sum(np.abs(a - ma) ** 2)
        if den > 1e-9:
            al = np.sum(np.conj(a - ma) * (b - mb)) / den
            if 1 / max_scale <= abs(al) <= max_scale:
                refit = int((np.abs(al * za + (mb - al * ma) - zb) <= residual).sum())
                if refit >= count[best]:
                    return refit, complex(al), complex(mb - al * ma)
    return int(count[best]), complex(alpha[best]), complex(beta[best])


def backdrop(img: np.ndarray) -> float | None:
    """The level of a flat border (a studio or catalogue backdrop), None for a photo's border."""
    border = np.concatenate([img[0], img[-1], img[:, 0], img[:, -1]])
    level = float(np.median(border))
    return level if (np.abs(border - level) <= BACKDROP_TOL).mean() >= BACKDROP_SHARE else None


def disagreement(ga: np.ndarray, gb: np.ndarray, alpha: complex, beta: complex,
                 la: float | None, lb: float | None) -> tuple[float, float]:
    """(share of ``ga`` that ``gb`` covers, share of that overlap where they differ): ``gb``
    mapped onto ``ga`` by the fitted transform, both blurred and normalised to zero mean and unit
    deviation over the overlap; a pixel differs where they are more than one deviation apart.
    Two images on backdrops (``la``, ``lb``: their :func:`backdrop` levels) are compared on the
    object only: two motorbikes of one model in two colours, shot alike on white, differ on
    2.2-4.9% of the frame, 4.7-12% of the object."""
    from scipy.ndimage import gaussian_filter, map_coordinates

    h, w = ga.shape
    y, x = np.mgrid[0:h, 0:w]
    z = alpha * (x + 1j * y) + beta
    bx, by = z.real, z.imag
    inside = (bx >= 0) & (bx <= gb.shape[1] - 1) & (by >= 0) & (by <= gb.shape[0] - 1)
    if inside.sum() < 64:
        return 0.0, 1.0
    ra = gaussian_filter(ga, 1.0)[inside]
    rb = map_coordinates(gaussian_filter(gb, 1.0), [by[inside], bx[inside]], order=1)
    a = (ra - ra.mean()) / max(float(ra.std()), 1e-3)
    b = (rb - rb.mean()) / max(float(rb.std()), 1e-3)
    differs = np.abs(a - b) > 1.0
    if la is not None and lb is not None:
        obj = (np.abs(ra - la) > CONTENT_TOL) | (np.abs(rb - lb) > CONTENT_TOL)
        if obj.sum() >= 64:
            differs = differs[obj]
    return float(inside.mean()), float(differs.mean())


class Described(NamedTuple):
    """What a pair check needs of one image, computed once per image (not per pair)."""

    img: np.ndarray | None      # gray, at most ``side`` px (None: missing or unreadable)
    feats: Features
    level: float | None         # its backdrop's level (:func:`backdrop`), None for a photo


def describe(data: bytes | None, side: int = SIDE) -> Described:
    img = gray(data, side) if data else None
    return Described(img, features(img), None if img is None else backdrop(img))


@dataclass
class Verdicts:
    """Per pair: RANSAC inliers, the share of image a that b covers once aligned, the share of
    that overlap where they differ (NaN: not compared, too few inliers), and the verdict."""

    inliers: np.ndarray         # (n,) int32
    overlap: np.ndarray         # (n,) float32
    differ: np.ndarray          # (n,) float32
    same: np.ndarray            # (n,) bool


def verify_pairs(a: Sequence[int], b: Sequence[int], read: Callable[[int], bytes | None], *,
                 side: int = SIDE, min_inliers: int = MIN_INLIERS, min_overlap: float = MIN_OVERLAP,
                 max_differ: float = MAX_DIFFER, workers: int | None = None, progress: str = "") -> Verdicts:
    """Is each pair ``(a[i], b[i])`` of rows one picture? The images' bytes from ``read(row)``
    (None or KeyError: missing, 0 inliers). Same: >= ``min_inliers`` RANSAC inliers, and once
    aligned by their transform the two agree (:func:`disagreement`) over >= ``min_overlap`` of a
    with <= ``max_differ`` of it differing. Pairs, threads and the ``progress`` bar: :func:`each_pair`."""
    def check(x: Described, y: Described) -> tuple:
        count, alpha, beta = fit(*matches(x.feats, y.feats))
        if count < min_inliers or x.img is None or y.img is None:
            return count, 0.0, float("nan"), False
        cover, differ = disagreement(x.img, y.img, alpha, beta, x.level, y.level)
        return count, cover, differ, cover >= min_overlap and differ <= max_differ

    return _verdicts(each_pair(a, b, read, functools.partial(describe, side=side), check, workers, progress))


def _verdicts(res: list[tuple[int, float, float, bool]]) -> Verdicts:
    n = len(res)
    out = Verdicts(np.zeros(n, np.int32), np.zeros(n, np.float32), np.full(n, np.nan, np.float32),
                   np.zeros(n, bool))
    for p, (count, cover, differ, same) in enumerate(res):
        out.inliers[p], out.overlap[p], out.differ[p], out.same[p] = count, cover, differ, same
    return out


def verify_scored(a: Sequence[int], b: Sequence[int], read: Callable[[int], bytes | None], *,
                  min_inliers: int = MIN_INLIERS, max_differ: float = MAX_DIFFER,
                  workers: int | None = None, progress: str = "") -> Verdicts:
    """For pairs the score joined: the most RANSAC inliers one similarity finds between a and b,
    -1 where the pixels cannot tell (either image has fewer than ``min_inliers`` keypoints: a
    flat drawing, a missing file: kept). Below ``min_inliers`` the pair is not one picture: the
    score joins frames of one render or burst, other photos of one object (Caltech's brain renders
    turning, airplanes taxiing: 2-15 inliers; its copies and edits 38-181; validation halves:
    docs/benchmarks/audit.md). A photo's pair is not compared pixel by pixel after the fit: what
    lowers the score of one picture is mostly an edit (recoloured, captioned, background
    replaced), which that would refuse. Two images on backdrops are (:func:`disagreement`, on the
    object): frames of a render turning on black, two cameras of one maker on white differ on
    10-17% of the object with 32-69 inliers, copies on <= 1.3% (caltech-val: 5 such pairs dropped,
    all wrong by eye, and one edited brain render, 5.5%). A pair failing the first fit is tried
    twice more before it counts: with ``DEEP_SCALES`` pyramid levels (a crop to 40% of a side,
    what ``MAX_SCALE`` allows, is 5 levels of 1.2 away: Caltech's Faces_easy crops of Faces 11-24
    inliers with 2, 54-99 with 6) and mirrored (ORB is not mirror-invariant; mirrored copies score
    as copies). ``same``: kept."""
    def check(x: Described, y: Described) -> tuple:
        ga, gb = x.img, y.img
        if ga is None or gb is None:
            return -1, 0.0, float("nan"), True
        best, alpha, beta = fit(*matches(x.feats, y.feats))
        if best >= min_inliers:
            if x.level is None or y.level is None:
                return best, 0.0, float("nan"), True
            cover, differ = disagreement(ga, gb, alpha, beta, x.level, y.level)
            return best, cover, differ, cover < MIN_OVERLAP or differ <= max_differ
        da, db = features(ga, DEEP_KEYPOINTS, DEEP_SCALES), features(gb, DEEP_KEYPOINTS, DEEP_SCALES)
        if min(len(da[0]), len(db[0])) < min_inliers:
            return -1, 0.0, float("nan"), True
        best = max(best, fit(*matches(da, db))[0])
        if best < min_inliers:
            best = max(best, fit(*matches(da, features(gb[:, ::-1].copy(), DEEP_KEYPOINTS, DEEP_SCALES)))[0])
        return best, 0.0, float("nan"), best >= min_inliers

    return _verdicts(each_pair(a, b, read, describe, check, workers, progress))


def each_pair(a: Sequence[int], b: Sequence[int], read: Callable[[int], bytes | None],
              describe: Callable[[bytes | None], Any], check: Callable[[Any, Any], Any],
              workers: int | None = None, progress: str = "") -> list:
    """``check(describe(read(a[i])), describe(read(b[i])))`` for each pair, in order, under a
    tqdm bar named ``progress`` (none when empty: up to ~5 min for 10,000 pairs on 2 cores). Pairs go
    ``CHUNK`` at a time; each image is read and described once and dropped after the chunk of its
    last pair (memory: the images still to be paired, not all of them). ``read`` runs on the
    calling thread only (an LMDB read transaction is one thread's; None or KeyError: missing);
    ``describe`` and ``check`` run on ``workers`` threads (default: the CPUs, at most 8), where
    PIL, scikit-image and scipy mostly release the GIL (a band's check 1.42x faster on 2 cores);
    each pair's result is the one it gets alone."""
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    last: dict[int, int] = {}
    for p, (x, y) in enumerate(zip(a.tolist(), b.tolist())):
        last[x] = last[y] = p
    cache: dict[int, Any] = {}
    out: list = []
    with ThreadPoolExecutor(workers or min(8, os.cpu_count() or 1)) as pool, \
            tqdm(total=len(a), desc=progress, unit="pair", disable=not progress, mininterval=1.0) as bar:
        for start in range(0, len(a), CHUNK):
            stop = min(len(a), start + CHUNK)
            rows = [r for r in dict.fromkeys(np.concatenate([a[start:stop], b[start:stop]]).tolist())
                    if r not in cache]
            blobs = []
            for r in rows:
                try:
                    blobs.append(read(r))
                except KeyError:
                    blobs.append(None)
            cache.update(zip(rows, pool.map(describe, blobs)))
            out += pool.map(lambda p: check(cache[int(a[p])], cache[int(b[p])]), range(start, stop))
            bar.update(stop - start)
            for r in [r for r in cache if last[r] < stop]:
                del cache[r]
    return out


__all__ = ["DuplicateGroup", "Pairs", "near_duplicates", "scored_pairs", "candidates", "verify_pairs", "verify_scored",
           "each_pair", "Verdicts", "gray", "features", "matches", "fit", "inliers", "disagreement",
           "DEFAULT_THRESHOLD", "VERIFY_TOP", "VERIFY_LOWER", "NEAREST_LOWER", "MIN_INLIERS", "MAX_DIFFER",
           "MIN_OVERLAP"]
