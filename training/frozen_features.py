"""Frozen features of the offline pretrained embedder, computed once per dataset and cached.

The frozen-feature benchmark (benchmarks/frozen_table2.py) trains only a small embedding head,
so each of its ~100 runs costs seconds instead of hours: the expensive part, running
EfficientNet-Lite0 over every image, is done once here. The features are those of the default
gallery embedder (`embedder.default_model_path()`: ImageNet EfficientNet-Lite0, 1280-d pooled,
L2-normalised), run through onnxruntime with the model's own preprocessing, so they are exactly
what `indexer build` would store for the same images.

Cache: one ``.npz`` per (model, list of files) under ``<cache>/frozen_features/``; the key hashes
the ONNX file's sha256 and every image's relative path, size and mtime, so an added, removed or
rewritten image gives a new key instead of stale features. A corrupt image is skipped and
reported (its row is dropped from the split), never fatal.
"""
from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embedder.files import atomic_target

from .data import Split, load_splits

__all__ = ["FeatureSplit", "frozen_splits", "extract_features", "extract_views"]


@dataclass
class FeatureSplit:
    """Features (N, D) float32 with labels 0..C-1 and class names, as a `Split` has them."""

    features: np.ndarray
    labels: np.ndarray
    classes: list[str]
    #: optional (V, N, D) augmented views of the same rows (training only; see extract_views)
    views: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def subset_classes(self, keep: list[int]) -> "FeatureSplit":
        """Rows of the given class ids, relabelled 0..len(keep)-1 in the given order."""
        remap = np.full(self.num_classes, -1, dtype=np.int64)
        remap[np.asarray(keep, dtype=np.int64)] = np.arange(len(keep))
        new = remap[self.labels]
        rows = new >= 0
        views = None if self.views is None else self.views[:, rows]
        return FeatureSplit(self.features[rows], new[rows], [self.classes[i] for i in keep], views)


def _cache_root(cache: str | os.PathLike | None) -> Path:
    if cache:
        return Path(cache)
    from embedder.pretrained import cache_dir

    return cache_dir() / "frozen_features"


def _key(model_hash: str, root: Path, paths: list[Path]) -> str:
    h = hashlib.sha256(model_hash.encode())
    for p in paths:
        st = p.stat()
        h.update(f"{p.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def extract_features(paths: list[Path], root: Path, *, cache: str | os.PathLike | None = None,
                     threads: int | None = None, progress: bool = True
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(features (N_ok, D), ok (N,) bool) for the images, from the cache when present.

    Images that fail to decode get ``ok = False`` and are reported on stderr.
    """
    from embedder import OnnxEmbedder, default_model_path

    model_path = default_model_path()
    from embedder import file_sha256

    key = _key(file_sha256(model_path), root, paths)
    out_dir = _cache_root(cache)
    out = out_dir / f"{root.name}-{len(paths)}-{key}.npz"
    if out.is_file():
        with np.load(out) as z:
            return z["features"], z["ok"]
    emb = OnnxEmbedder(model_path, device="cpu", threads=threads)
    feats = np.zeros((len(paths), emb.dim), np.float32)
    ok = np.zeros(len(paths), bool)
    for keys, e, failures in emb.embed_iter(enumerate(paths), workers=threads or 2,
                                            progress=progress, total=len(paths)):
        if keys:
            feats[np.asarray(keys)] = e
            ok[np.asarray(keys)] = True
        for k, err in failures:
            print(f"skipped unreadable image {paths[k]}: {err}", file=sys.stderr)
    feats = feats[ok]
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_target(out) as tmp, open(tmp, "wb") as f:   # a concurrent reader never sees half
        np.savez(f, features=feats, ok=ok)
    return feats, ok


def extract_views(paths: list[Path], root: Path, views: int, *, seed: int = 0,
                  cache: str | os.PathLike | None = None, threads: int | None = None,
                  progress: bool = True) -> np.ndarray:
    """(views, N, D) features of `views` random training crops per image (the paper's train
    augmentation: random resized crop 224, horizontal flip), cached like `extract_features`.

    Decoding runs in threads; the crops are drawn in the main thread from a generator seeded
    per (seed, image), so the views do not depend on thread timing. Unreadable images get
    zero rows (callers drop them through extract_features' ``ok`` mask)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from tqdm.auto import tqdm

    from embedder import OnnxEmbedder, default_model_path, file_sha256, load_image

    model_path = default_model_path()
    key = _key(f"{file_sha256(model_path)}-views{views}-seed{seed}", root, paths)
    out_dir = _cache_root(cache)
    out = out_dir / f"{root.name}-{len(paths)}-views-{key}.npy"
    if out.is_file():
        return np.load(out)
    emb = OnnxEmbedder(model_path, device="cpu", threads=threads)
    pre = emb.preprocessing
    augment = pre.train_transform()
    feats = np.zeros((views, len(paths), emb.dim), np.float32)

    def load(i: int):
        try:
            return load_image(paths[i], mode=pre.mode)
        except Exception:  # noqa: BLE001 - reported by extract_features, zero row here
            return None

    chunk = 64
    with ThreadPoolExecutor(max_workers=threads or 2) as pool:
        for s in tqdm(range(0, len(paths), chunk), disable=not progress, desc="views"):
            imgs = list(pool.map(load, range(s, min(s + chunk, len(paths)))))
            batch, where = [], []
            for j, img in enumerate(imgs):
                if img is None:
                    continue
                torch.manual_seed(seed * 1_000_003 + s + j)
                for v in range(views):
                    batch.append(augment(img).numpy())
                    where.append((v, s + j))
            if batch:
                e = emb.embed_arrays(np.stack(batch))
                for (v, i), row in zip(where, e):
                    feats[v, i] = row
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_target(out) as tmp, open(tmp, "wb") as f:
        np.save(f, feats)
    return feats


def _to_features(split: Split, feats: np.ndarray, ok: np.ndarray, offset: int) -> FeatureSplit:
    rows = ok[offset:offset + len(split)]
    first = int(ok[:offset].sum())
    f = feats[first:first + int(rows.sum())]
    return FeatureSplit(f, split.labels[rows], list(split.classes))


def frozen_splits(root: str | os.PathLike, dataset: str = "auto", *, cache=None,
                  threads: int | None = None, progress: bool = True,
                  max_classes: int = 0, views: int = 0) -> tuple[FeatureSplit, FeatureSplit]:
    """(train, test) frozen features of a class-folder dataset or Omniglot.

    ``dataset="auto"`` picks Omniglot when ``root/images_background`` exists (first 20 alphabets
    train, last 10 test), else a folder of class folders (sorted classes, first half train).
    ``views > 0`` adds that many augmented views of each training image (`extract_views`).
    """
    root = Path(root)
    if dataset == "auto":
        dataset = "omniglot" if (root / "images_background").is_dir() else "folder"
    train, test = load_splits(dataset, root, max_classes=max_classes)
    paths = list(train.paths) + list(test.paths)
    base = root / "images_background" if dataset == "omniglot" else root
    feats, ok = extract_features(paths, base, cache=cache, threads=threads, progress=progress)
    tr, te = _to_features(train, feats, ok, 0), _to_features(test, feats, ok, len(train))
    if views > 0:
        v = extract_views(list(train.paths), base, views, cache=cache, threads=threads,
                          progress=progress)
        tr.views = v[:, ok[:len(train)]]
    return tr, te
