"""The frozen stages' activations, computed once per image and per augmented view, on disk: with
``trainable = "last:N"`` or ``"head"`` the frozen prefix (training/stages.py) is a fixed function of
the image and, on a CPU, most of a step's cost, so an epoch runs only the trainable stages on one
stored view per image. Crops are drawn from a generator seeded per (seed, image): independent of
batch order and threads. The key hashes the prefix's weights, the trainable spec, preprocessing,
views, seed, and every image's real path (the same photos through another spelling of the root,
working directory or link are a hit), size and mtime; a file is written under a temporary name and
renamed (never half a cache). An undecodable image leaves zero rows, recorded as ``"failed"``
beside it; a hit is never re-checked, since a fixed file has a new mtime and so a new key.
"""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from embedder.files import atomic_target
from embedder.images import ImageLoadError

from .data import ImageDataset

__all__ = ["CachedViews", "cache_key", "trunk_activations"]


def _default_dir() -> Path:
    from embedder.pretrained import cache_dir

    return cache_dir() / "trunk_cache"


def cache_key(prefix: nn.Module, what: str, preprocessing, views: int, seed: int,
              paths: list[Path], decode_side: int | None = None) -> str:
    """Hash of everything the cached activations depend on (see the module docstring);
    ``decode_side``: the size photos were decoded at (caches of whole decodes are not reused)."""
    h = hashlib.sha256(f"{what}\0{preprocessing!r}\0views={views}\0seed={seed}\0decode={decode_side}\n".encode())
    for name, t in prefix.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    for p in map(os.path.realpath, paths):
        try:
            st = os.stat(p)
            h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        except OSError:             # missing / unreadable: the decode reports it, row skipped
            h.update(f"{p}\0missing\n".encode())
    return h.hexdigest()[:20]


def _decode(dataset, i: int):
    """The image, or the decode error (recorded, not raised: one bad file is not fatal)."""
    try:
        return dataset.image(i)
    except ImageLoadError as e:
        return e


def _failures(meta: Path, paths: list[Path], failed: dict[int, str] | None) -> None:
    """Hand the cache's failed rows to the caller; without ``failed=`` the first one is raised
    (a caller that cannot leave rows out must not read their zeros)."""
    rows = {int(r): why for r, why in json.loads(meta.read_text()).get("failed", {}).items()}
    if failed is not None:
        failed.update(rows)
    elif rows:
        r = min(rows)
        raise ImageLoadError(str(paths[r]), rows[r])


@torch.no_grad()
def trunk_activations(prefix: nn.Module, dataset: ImageDataset, preprocessing, *, what: str, views: int = 0,
                      seed: int = 0,
                      cache_dir: str | os.PathLike | None = None, batch_size: int = 32,
                      threads: int = 2, progress: bool = True,
                      dtype: type = np.float16,
                      failed: dict[int, str] | None = None) -> np.ndarray:
    """A read-only memmap (1 + views, N, *shape) of `prefix`'s activations of every image of
    `dataset` (view 0 the eval centre crop, views 1.. random training crops), stored as `dtype`.
    Undecodable images go into `failed` ({row: reason}); without it, the first raises."""
    from tqdm.auto import tqdm

    pre = preprocessing
    dtype = np.dtype(dtype)
    if dtype != np.float16:       # fp16 files keep the names and keys they had
        what = f"{what}-{dtype.name}"
    paths = [Path(p) for p in dataset.split.paths]
    key = cache_key(prefix, what, pre, views, seed, paths, dataset.min_side)
    out_dir = Path(cache_dir) if cache_dir else _default_dir()
    out = out_dir / f"{what.replace(':', '')}-{len(paths)}x{1 + views}-{key}.npy"
    meta = out_dir / f"{out.stem}.json"
    if out.is_file() and meta.is_file():
        _failures(meta, paths, failed)
        return np.load(out, mmap_mode="r")
    eval_t, train_t = pre.eval_transform(), pre.train_transform()
    prefix.eval()
    device = next(iter(prefix.parameters())).device
    out_dir.mkdir(parents=True, exist_ok=True)
    arr, bad = None, {}
    with atomic_target(out) as tmp, ThreadPoolExecutor(max_workers=max(1, threads)) as pool, \
            torch.random.fork_rng(devices=[]):          # the crops never move the run's RNG
        bar = tqdm(total=len(paths), desc=f"caching {what} activations ({1 + views} views)",
                   disable=not progress)
        for s in range(0, len(paths), batch_size):
            idx = list(range(s, min(s + batch_size, len(paths))))
            imgs = list(pool.map(lambda i: _decode(dataset, i), idx))
            bad.update({i: e.reason for i, e in zip(idx, imgs) if isinstance(e, ImageLoadError)})
            good = [(i, img) for i, img in zip(idx, imgs) if i not in bad]
            bar.update(len(idx))
            if not good:
                continue
            xs = []
            for i, img in good:
                xs.append(eval_t(img))
                torch.manual_seed(seed * 1_000_003 + i)
                xs += [train_t(img) for _ in range(views)]
            a = prefix(torch.stack(xs).to(device)).float().cpu()
            a = a.reshape(len(good), 1 + views, *a.shape[1:]).transpose(0, 1)
            if arr is None:     # a new file reads as zeros where nothing is written
                arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype,
                                                shape=(1 + views, len(paths), *a.shape[2:]))
            arr[:, [i for i, _ in good]] = a.numpy().astype(dtype)
        bar.close()
        if arr is None:
            r = min(bad)
            raise ImageLoadError(str(paths[r]), f"{bad[r]} (and every other image of the "
                                 f"{len(paths)} to cache is unreadable too)")
        arr.flush()
        del arr
        meta.write_text(json.dumps(
            {"what": what, "views": views, "seed": seed, "images": len(paths),
             "preprocessing": repr(pre), "failed": {str(r): why for r, why in sorted(bad.items())}}))
    _failures(meta, paths, failed)
    return np.load(out, mmap_mode="r")


class CachedViews(Dataset):
    """(activation, label) pairs from a cache: in training a random stored view per image and
    epoch, a pure function of (seed, e, i) (a resumed run sees the same views); view 0 else."""

    def __init__(self, acts: np.ndarray, labels: np.ndarray, *, train: bool, seed: int = 0,
                 rows: np.ndarray | None = None) -> None:
        self.acts, self.train, self.seed = acts, train, int(seed)
        self.rows = np.arange(acts.shape[1]) if rows is None else np.asarray(rows)
        self._labels = np.asarray(labels)
        if len(self._labels) != len(self.rows):
            raise ValueError(f"{len(self._labels)} labels for {len(self.rows)} cached rows")
        self._view = np.zeros(len(self.rows), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def labels(self) -> np.ndarray:
        return self._labels

    def set_epoch(self, epoch: int) -> None:
        if self.train and self.acts.shape[0] > 1:
            rng = np.random.default_rng([self.seed, int(epoch)])
            self._view = rng.integers(0, self.acts.shape[0], len(self.rows))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        a = np.array(self.acts[self._view[i], self.rows[i]], dtype=np.float32)   # a copy: writable
        return torch.from_numpy(a), int(self._labels[i])
