"""``device_batches = true``: every image decoded once into device memory, augmented there.

Why: a GPU trains a Lite1 on photos faster than DataLoader workers decode and crop them (the
H200 device suite's runs were bound by their 2 workers each, and ``cache_images`` cannot help
there: non-persistent workers drop their caches every epoch). Here each training image is decoded
once, fitted (aspect kept) into a ``2 x input_size`` square canvas of uint8 on the run's device,
and every batch is cut from it with torchvision's RandomResizedCrop parameters, resampled by
``roi_align`` (bilinear, averaged over the bins' samples as an antialiased resize), flipped and
normalised on the device. The evaluation images go through the exact CPU eval transform once and
stay on the device as uint8 crops, normalised per batch as ``eval_array`` does. torchvision's
``transforms.v2`` works on one image (or one crop for a whole batch) per call; kornia's batched
RandomResizedCrop would be a new dependency for this one loop, hence the ~100 lines here.

Exact resume holds: a batch's crops are drawn from a generator seeded by (seed, epoch, step).
Images that do not decode are left out up front (the sampler is rebuilt without them, as the
trunk cache does) and reported in the run's skip log.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np
import torch
from PIL import Image

from embedder.images import ImageLoadError
from embedder.preprocess import Preprocessing

from .data import Split
from .skips import SkipLog

__all__ = ["DeviceImages", "DeviceBatches", "DeviceEvalSet", "crop_boxes"]


def _decode_all(split: Split, mode: str, fn, threads: int, skips: SkipLog, desc: str, min_side: int) -> list:
    """``fn(image)`` of every path decoded with ``min_side`` (None where it does not decode; the
    reason goes to `skips`), in threads (PIL's decode and resize release the GIL), with a progress bar."""
    from tqdm.auto import tqdm

    from embedder import load_image

    def one(i: int):
        try:
            return fn(load_image(split.paths[i], mode=mode, min_side=min_side))
        except ImageLoadError as e:
            skips.add(e.path, e.reason)
            return None

    with ThreadPoolExecutor(max(1, threads)) as ex:
        return list(tqdm(ex.map(one, range(len(split))), total=len(split), desc=desc,
                         leave=False))


def _chw(img: Image.Image) -> np.ndarray:
    a = np.asarray(img)
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


class DeviceImages:
    """A split's images fitted into ``side x side`` uint8 canvases on ``device`` (top-left,
    aspect kept, only ever shrunk), with each image's size and whether it decoded."""

    def __init__(self, split: Split, pre: Preprocessing, device: torch.device, skips: SkipLog,
                 side: int | None = None, threads: int = 8) -> None:
        self.side = side = int(side or 2 * pre.input_size)

        def fit(img: Image.Image) -> np.ndarray:
            w, h = img.size
            s = min(1.0, side / max(w, h))
            if s < 1.0:
                img = img.resize((max(1, round(w * s)), max(1, round(h * s))), Image.BILINEAR)
            return _chw(img)

        arrays = _decode_all(split, pre.mode, fit, threads, skips, "decoding once into device memory", side)
        channels = next((a.shape[0] for a in arrays if a is not None), 3)
        canvas = torch.zeros(len(arrays), channels, side, side, dtype=torch.uint8)
        sizes = torch.zeros(len(arrays), 2, dtype=torch.int64)       # (h, w)
        for i, a in enumerate(arrays):
            if a is not None:
                canvas[i, :, :a.shape[1], :a.shape[2]] = torch.tensor(a)
                sizes[i] = torch.tensor(a.shape[1:])
        self.ok = np.asarray([a is not None for a in arrays], dtype=bool)
        self.canvas, self.sizes, self.labels = canvas.to(device), sizes, split.labels
        self.pre, self.device = pre, device
        self.mean = torch.tensor(pre.mean, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(pre.std, device=device).view(1, -1, 1, 1)

    def batch(self, rows: np.ndarray, generator: torch.Generator) -> torch.Tensor:
        """Training inputs (B, C, S, S), float32 and normalised, for canvas `rows`."""
        from torchvision.ops import roi_align

        rows_t = torch.as_tensor(rows, dtype=torch.int64)
        boxes = crop_boxes(self.sizes[rows_t], self.pre.train_scale, generator)
        flip = (torch.rand(len(rows), generator=generator) < 0.5) & bool(self.pre.hflip)
        x = self.canvas[rows_t.to(self.device)].float()
        index = torch.arange(len(rows), dtype=torch.float32).unsqueeze(1)
        rois = torch.cat([index, boxes], dim=1).to(self.device)
        s = self.pre.input_size
        # sampling_ratio=-1: ceil(box / output) samples per bin, averaged (an area-like shrink)
        out = roi_align(x, rois, output_size=(s, s), spatial_scale=1.0, sampling_ratio=-1,
                        aligned=True)
        flip = flip.to(self.device)
        out = torch.where(flip.view(-1, 1, 1, 1), out.flip(-1), out)
        return (out / 255.0 - self.mean) / self.std


def crop_boxes(sizes: torch.Tensor, scale: tuple[float, float], generator: torch.Generator,
               ratio: tuple[float, float] = (3 / 4, 4 / 3), tries: int = 10) -> torch.Tensor:
    """(B, 4) boxes x0, y0, x1, y1 in pixels: torchvision's ``RandomResizedCrop.get_params`` for
    a batch of (h, w) `sizes` at once (10 tries each, then the centre crop clamped to `ratio`)."""
    h, w = sizes[:, 0:1].double(), sizes[:, 1:2].double()
    b = len(sizes)
    area = h * w
    target = area * torch.empty(b, tries, dtype=torch.float64).uniform_(*scale, generator=generator)
    logr = torch.empty(b, tries, dtype=torch.float64).uniform_(math.log(ratio[0]),
                                                              math.log(ratio[1]),
                                                              generator=generator)
    ar = torch.exp(logr)
    cw, ch = torch.sqrt(target * ar).round(), torch.sqrt(target / ar).round()
    ok = (cw > 0) & (cw <= w) & (ch > 0) & (ch <= h)
    first = torch.where(ok.any(1), ok.double().argmax(1), torch.full((b,), -1))
    u = torch.rand(b, 2, generator=generator, dtype=torch.float64)
    boxes = torch.empty(b, 4, dtype=torch.float32)
    for i in range(b):
        hi, wi = float(h[i]), float(w[i])
        t = int(first[i])
        if t >= 0:
            cwi, chi = float(cw[i, t]), float(ch[i, t])
            top = math.floor(u[i, 0].item() * (hi - chi + 1))
            left = math.floor(u[i, 1].item() * (wi - cwi + 1))
        else:                                   # torchvision's fallback: a centre crop
            in_ratio = wi / hi
            if in_ratio < ratio[0]:
                cwi, chi = wi, float(round(wi / ratio[0]))
            elif in_ratio > ratio[1]:
                chi, cwi = hi, float(round(hi * ratio[1]))
            else:
                cwi, chi = wi, hi
            top, left = (hi - chi) // 2, (wi - cwi) // 2
        boxes[i] = torch.tensor([left, top, left + cwi, top + chi])
    return boxes


class DeviceBatches:
    """What the training loop iterates instead of a DataLoader: (inputs, labels, []) per batch of
    `sampler`, made on the device. The sampler draws positions in `rows` (the canvas rows left
    after unreadable images); ``batch_sampler`` is it, as on a DataLoader (the loop sets its
    epoch), and ``dataset`` the images."""

    def __init__(self, images: DeviceImages, sampler, seed: int, rows: np.ndarray) -> None:
        self.dataset, self.batch_sampler, self.seed = images, sampler, int(seed)
        self.rows = np.asarray(rows)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, list]]:
        epoch = self.batch_sampler.epoch
        labels = torch.as_tensor(self.dataset.labels)
        for b, positions in enumerate(self.batch_sampler):
            g = torch.Generator().manual_seed(
                int(np.random.SeedSequence([self.seed, epoch, b]).generate_state(1)[0]))
            rows = self.rows[np.asarray(positions)]
            yield (self.dataset.batch(rows, g),
                   labels[torch.as_tensor(rows)].to(self.dataset.device, non_blocking=True), [])


class DeviceEvalSet:
    """The evaluation images through the CPU eval transform once (uint8 crops on the device),
    normalised per batch exactly as ``Preprocessing.eval_array`` does."""

    def __init__(self, split: Split, pre: Preprocessing, device: torch.device, skips: SkipLog,
                 threads: int = 8) -> None:
        arrays = _decode_all(split, pre.mode, lambda img: _chw(pre.eval_image(img)), threads, skips,
                             "decoding the evaluation images once", pre.decode_side)
        self.ok = np.asarray([a is not None for a in arrays], dtype=bool)
        self.labels = split.labels[self.ok]
        self.crops = torch.from_numpy(np.stack([a for a in arrays if a is not None])).to(device)
        self.mean = torch.tensor(pre.mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(pre.std, dtype=torch.float32, device=device).view(1, -1, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, np.ndarray]]:
        for i in range(0, len(self), batch_size):
            x = self.crops[i:i + batch_size].float() / 255.0
            yield (x - self.mean) / self.std, self.labels[i:i + batch_size]
