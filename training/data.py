"""Dataset splits for the paper's benchmarks, Omniglot and any folder of class folders: every
parser returns two `Split`s (train, test) of paths with contiguous integer labels; `ImageDataset`
decodes through embedder's `load_image` and a `Preprocessing` transform.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from embedder.folders import walk_gallery
from embedder.images import is_listed, load_image


class DatasetLayoutError(FileNotFoundError):
    """The dataset root does not have the layout its parser expects."""


@dataclass
class Split:
    """Image paths with labels 0..C-1 and the class name of each label."""

    paths: list[Path]
    labels: np.ndarray  # int64, one per path
    classes: list[str]

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[Path, str]], class_order: Sequence[str]) -> "Split":
        index = {c: i for i, c in enumerate(class_order)}
        pairs = [p for p in pairs if p[1] in index]
        return cls([Path(p) for p, _ in pairs],
                   np.asarray([index[c] for _, c in pairs], dtype=np.int64), list(class_order))

    def first_classes(self, n: int) -> "Split":
        """Keep the first n classes (by label); n <= 0 keeps everything."""
        return self if n <= 0 or n >= self.num_classes else self.class_range(0, n)

    def class_range(self, start: int, n: int) -> "Split":
        """Classes start .. start+n-1, relabelled 0..n-1 (e.g. a second held-out test set)."""
        if start < 0 or n < 1 or start + n > self.num_classes:
            raise ValueError(f"classes {start}..{start + n - 1}: the split has {self.num_classes}")
        keep = (self.labels >= start) & (self.labels < start + n)
        return Split([p for p, k in zip(self.paths, keep) if k], self.labels[keep] - start,
                     self.classes[start:start + n])


def _natural_key(s: str) -> list:
    return [int(t) if t.isdigit() else t.lower() for t in re.split(r"(\d+)", s)]


def _require(root: Path, what: str, names: Sequence[str]) -> None:
    if not root.is_dir():
        raise DatasetLayoutError(f"{what} root {root}: not a directory (expected {', '.join(names)} in it)")
    missing = [n for n in names if not (root / n).exists()]
    if missing:
        raise DatasetLayoutError(
            f"{what} root {root}: expected {', '.join(names)}; missing {', '.join(missing)}")


def _halves(pairs: Sequence[tuple[Path, str]], classes: Sequence[str]) -> tuple[Split, Split]:
    """The first half of ``classes`` trains, the second half tests (the benchmarks' protocol)."""
    half = len(classes) // 2
    return Split.from_pairs(pairs, classes[:half]), Split.from_pairs(pairs, classes[half:])


def _read_table(path: Path, ncols: int) -> list[list[str]]:
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split(maxsplit=ncols - 1)
        if len(parts) != ncols:
            raise DatasetLayoutError(f"{path}:{lineno}: expected {ncols} columns, got {line!r}")
        rows.append(parts)
    return rows


def cub_splits(root: str | Path) -> tuple[Split, Split]:
    """CUB-200-2011 official layout: classes 1-100 train, 101-200 test."""
    root = Path(root)
    _require(root, "CUB-200-2011", ["images", "images.txt", "image_class_labels.txt", "classes.txt"])
    images = {i: p for i, p in _read_table(root / "images.txt", 2)}
    labels = {i: int(c) for i, c in _read_table(root / "image_class_labels.txt", 2)}
    names = {int(c): n for c, n in _read_table(root / "classes.txt", 2)}
    pairs = []
    for img_id, rel in images.items():
        if img_id not in labels:
            raise DatasetLayoutError(f"{root / 'image_class_labels.txt'}: no label for image id {img_id}")
        pairs.append((root / "images" / rel, names[labels[img_id]]))
    pairs.sort(key=lambda p: str(p[0]))
    return _halves(pairs, [names[i] for i in sorted(names)])


def _mat_scalar(x):
    """scipy.io.loadmat wraps every struct field in nested 1x1 arrays; unwrap to a Python value."""
    while isinstance(x, np.ndarray):
        if x.size != 1:
            raise ValueError(f"expected a scalar, got an array of shape {x.shape}")
        x = x.reshape(-1)[0]
    return x.item() if isinstance(x, np.generic) else x


def cars_splits(root: str | Path) -> tuple[Split, Split]:
    """CARS196: official `cars_annos.mat` + `car_ims/`, or `images/<class>/`; 98 / 98 classes."""
    root = Path(root)
    if (root / "cars_annos.mat").is_file():
        import scipy.io

        mat = scipy.io.loadmat(str(root / "cars_annos.mat"))
        if "annotations" not in mat:
            raise DatasetLayoutError(f"{root / 'cars_annos.mat'}: no 'annotations' variable")
        ann = mat["annotations"].reshape(-1)
        names_arr = mat.get("class_names")
        class_names = ([str(_mat_scalar(n)) for n in names_arr.reshape(-1)]
                       if names_arr is not None else [])
        pairs = []
        for rec in ann:
            rel = str(_mat_scalar(rec["relative_im_path"]))
            cls = int(_mat_scalar(rec["class"]))
            name = class_names[cls - 1] if cls - 1 < len(class_names) else f"{cls:03d}"
            pairs.append((root / rel, name))
        return _halves(pairs, sorted({c for _, c in pairs},
                                     key=lambda n: class_names.index(n) if n in class_names else int(n)))
    if (root / "images").is_dir():
        classes = sorted((d.name for d in (root / "images").iterdir() if d.is_dir()), key=_natural_key)
        return _halves(_folder_pairs(root / "images", classes), classes)
    raise DatasetLayoutError(
        f"CARS196 root {root}: expected cars_annos.mat with car_ims/, or images/<class>/ folders")


def sop_splits(root: str | Path) -> tuple[Split, Split]:
    """Stanford Online Products: the official Ebay_train.txt / Ebay_test.txt."""
    root = Path(root)
    _require(root, "Stanford Online Products", ["Ebay_train.txt", "Ebay_test.txt"])
    out = []
    for name in ("Ebay_train.txt", "Ebay_test.txt"):
        rows = _read_table(root / name, 4)
        if rows and not rows[0][0].isdigit():  # header: image_id class_id super_class_id path
            rows = rows[1:]
        pairs = [(root / r[3], r[1]) for r in rows]
        out.append(Split.from_pairs(pairs, sorted({c for _, c in pairs}, key=int)))
    return out[0], out[1]


def _folder_pairs(base: Path, classes: Sequence[str]) -> list[tuple[Path, str]]:
    """Image files of each class folder; photos in a format the decoder does not open (HEIC, raw)
    are listed too, so that their decode error puts them in the run's skipped.jsonl by name."""
    return [(p, c) for c in classes for p in sorted(
        p for p in (base / c).iterdir() if p.is_file() and is_listed(p.name))]


def _omniglot_classes(base: Path) -> list[str]:
    return [f"{a.name}/{c.name}" for a in sorted(p for p in base.iterdir() if p.is_dir())
            for c in sorted(p for p in a.iterdir() if p.is_dir())]


def omniglot_splits(root: str | Path, holdout_alphabets: int = 10) -> tuple[Split, Split]:
    """images_background/ train and images_evaluation/ test; with only the former, the last
    `holdout_alphabets` alphabets (sorted) are the test classes. A class is alphabet/character."""
    root = Path(root)
    _require(root, "Omniglot", ["images_background"])
    bg = root / "images_background"
    if (root / "images_evaluation").is_dir():
        ev = root / "images_evaluation"
        train_cls, test_cls = _omniglot_classes(bg), _omniglot_classes(ev)
        return (Split.from_pairs(_folder_pairs(bg, train_cls), train_cls),
                Split.from_pairs(_folder_pairs(ev, test_cls), test_cls))
    alphabets = sorted(p.name for p in bg.iterdir() if p.is_dir())
    if not 0 < holdout_alphabets < len(alphabets):
        raise DatasetLayoutError(
            f"Omniglot root {root}: holdout_alphabets={holdout_alphabets} must be between 1 and "
            f"{len(alphabets) - 1} ({len(alphabets)} alphabets in images_background/)")
    test_alpha = set(alphabets[-holdout_alphabets:])
    classes = _omniglot_classes(bg)
    pairs = _folder_pairs(bg, classes)
    train_cls = [c for c in classes if c.split("/")[0] not in test_alpha]
    test_cls = [c for c in classes if c.split("/")[0] in test_alpha]
    return Split.from_pairs(pairs, train_cls), Split.from_pairs(pairs, test_cls)


def _tree_pairs(root: Path) -> tuple[list[tuple[Path, str]], list[str]]:
    """Every image under ``root`` with the label ``indexer build`` gives it, by the same walk
    (``embedder.folders``: its folder relative to ``root``, "dogs/beagle" when nested; hidden
    entries and files at the root left out), so that a folder trains and indexes as the same
    classes; classes in natural order, files sorted in each."""
    by_label: dict[str, list[Path]] = {}
    for f in walk_gallery(root):
        if f.problem is None and f.label is not None:
            by_label.setdefault(f.label, []).append(f.abspath)
    classes = sorted(by_label, key=_natural_key)
    return [(p, c) for c in classes for p in sorted(by_label[c])], classes


def folder_splits(root: str | Path, test_classes: Sequence[str] = (), test_images: float = 0.0
                  ) -> tuple[Split, Split]:
    """root/<class>/*.jpg (nested: root/<a>/<b>/*.jpg is class "a/b"): sorted classes, first half
    train; or an explicit list of test classes; or, ``test_images`` > 0, every class in both, that
    share of its photos testing (:func:`image_holdout`)."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetLayoutError(f"image folder root {root}: not a directory (expected <class>/ sub-folders)")
    pairs, classes = _tree_pairs(root)
    if len(classes) < 2:
        raise DatasetLayoutError(f"image folder root {root}: expected at least 2 class sub-folders holding "
                                 f"images, found {len(classes)}")
    unknown = sorted(set(test_classes) - set(classes))
    if unknown:
        raise DatasetLayoutError(f"image folder root {root}: test classes not found: {', '.join(unknown)}")
    if test_images:
        return image_holdout(pairs, classes, test_images)
    if not test_classes:
        return _halves(pairs, classes)
    return (Split.from_pairs(pairs, [c for c in classes if c not in set(test_classes)]),
            Split.from_pairs(pairs, [c for c in classes if c in set(test_classes)]))


def image_holdout(pairs: Sequence[tuple[Path, str]], classes: Sequence[str], share: float) -> tuple[Split, Split]:
    """Every class trains and tests: of its photos in name order, those where ``floor((j + 1) *
    share)`` steps test (spread over the folder, the same on every run, floor(n * share) of n; a
    class of under 1 / share photos only trains). The retrieval a team with one labelled gallery
    asks for: new photos of its own classes. Its test figures are not the open-set benchmarks'."""
    seen: dict[str, int] = {}
    train, test = [], []
    for p, c in pairs:
        j = seen[c] = seen.get(c, -1) + 1
        (test if math.floor((j + 1) * share) > math.floor(j * share) else train).append((p, c))
    return Split.from_pairs(train, classes), Split.from_pairs(test, classes)


def load_splits(dataset: str, root: str | Path, *, max_classes: int = 0, test_classes=(),
                test_images: float = 0.0, holdout_alphabets: int = 10) -> tuple[Split, Split]:
    """(train, test) for a dataset name; `max_classes` keeps the first N classes of each split."""
    if not root:
        raise DatasetLayoutError(f"dataset {dataset!r}: no root given (set root=<folder>)")
    parsers: dict[str, Callable[[], tuple[Split, Split]]] = {
        "cub": lambda: cub_splits(root), "cars": lambda: cars_splits(root), "sop": lambda: sop_splits(root),
        "omniglot": lambda: omniglot_splits(root, holdout_alphabets),
        "folder": lambda: folder_splits(root, test_classes, test_images)}
    if dataset not in parsers:
        raise ValueError(f"dataset={dataset!r}: expected cub, cars, sop, omniglot or folder")
    train, test = (split.first_classes(max_classes) for split in parsers[dataset]())
    for name, split in (("train", train), ("test", test)):
        if len(split) == 0:
            raise DatasetLayoutError(f"{dataset} root {root}: the {name} split has no images")
    return train, test


class ImageDataset(Dataset):
    """A split as (tensor, label) pairs, decoded by embedder's `load_image`; ``cache=True`` keeps
    decoded uint8 images in memory (small datasets such as Omniglot). ``min_side``: decode smaller
    where a photo is larger than the transform needs (``Preprocessing.train_decode_side`` /
    ``decode_side``: the latter is how ``indexer build`` decodes, so a run's test figures are the
    gallery's); None: full size."""

    def __init__(self, split: Split, transform: Callable[[Image.Image], torch.Tensor],
                 mode: str = "RGB", cache: bool = False, min_side: int | None = None):
        self.split, self.transform, self.mode, self.cache = split, transform, mode, cache
        self.min_side = min_side
        self._cache: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.split)

    @property
    def labels(self) -> np.ndarray:
        return self.split.labels

    def image(self, i: int) -> Image.Image:
        if self.cache:
            if i not in self._cache:
                self._cache[i] = np.asarray(load_image(self.split.paths[i], mode=self.mode,
                                                       min_side=self.min_side))
            return Image.fromarray(self._cache[i])
        return load_image(self.split.paths[i], mode=self.mode, min_side=self.min_side)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.image(i)), int(self.split.labels[i])
