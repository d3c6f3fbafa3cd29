"""A demo gallery from the photos scikit-image ships, so a fresh machine shows the app working:
each photo one class, seeded augmented views under ``gallery/<class>/`` and ``queries/<class>/``.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Sequence

from PIL import Image

# class name -> scikit-image file(s); both motorcycle views are one class.
DEMO_PHOTOS: dict[str, tuple[str, ...]] = {
    "astronaut": ("astronaut.png",), "brick": ("brick.png",), "camera": ("camera.png",),
    "cell": ("cell.png",), "chelsea": ("chelsea.png",), "clock": ("clock_motion.png",),
    "coffee": ("coffee.png",), "coins": ("coins.png",), "color": ("color.png",),
    "grass": ("grass.png",), "gravel": ("gravel.png",), "horse": ("horse.png",),
    "hubble": ("hubble_deep_field.jpg",), "ihc": ("ihc.png",), "logo": ("logo.png",),
    "moon": ("moon.png",), "motorcycle": ("motorcycle_left.png", "motorcycle_right.png"),
    "page": ("page.png",), "retina": ("retina.jpg",), "rocket": ("rocket.jpg",), "text": ("text.png",),
}

DEFAULT_DEMO_DIR = Path("indexes") / "demo"


def skimage_photos(classes: Sequence[str] | None = None) -> dict[str, list[Path]]:
    """Existing scikit-image photo files per demo class (classes whose files are missing are
    dropped, since scikit-image versions differ in what they ship)."""
    from skimage import data_dir

    names = list(classes) if classes is not None else list(DEMO_PHOTOS)
    unknown = [c for c in names if c not in DEMO_PHOTOS]
    if unknown:
        raise ValueError(f"unknown demo classes {unknown}; expected some of {sorted(DEMO_PHOTOS)}")
    found = {c: [Path(data_dir) / f for f in DEMO_PHOTOS[c] if (Path(data_dir) / f).is_file()] for c in names}
    out = {c: files for c, files in found.items() if files}
    if len(out) < 2:
        raise FileNotFoundError(f"{data_dir}: fewer than two scikit-image photos found; "
                                f"is scikit-image installed completely?")
    return out


def _augmenter(size: int) -> Callable[[Image.Image], Image.Image]:
    from torchvision.transforms import v2 as T

    return T.Compose([
        T.RandomResizedCrop(size, scale=(0.35, 1.0), ratio=(0.75, 1.33)),
        T.RandomHorizontalFlip(),
        T.RandomApply([T.RandomRotation(25, fill=(128, 128, 128))], p=0.5),
        T.ColorJitter(0.35, 0.35, 0.35, 0.04),
    ])


def make_demo_gallery(out: str | Path, *, views: int = 8, queries: int = 2, size: int = 256,
                      classes: Sequence[str] | None = None, seed: int = 0,
                      progress: bool = True) -> tuple[Path, Path]:
    """Write and return ``out/gallery/<class>/`` (view 0 the whole photo) and ``out/queries/<class>/``."""
    import torch
    from tqdm import tqdm

    from embedder import load_image

    if views < 2 or queries < 0:
        raise ValueError(f"views >= 2 and queries >= 0 expected, got views={views}, queries={queries}")
    out = Path(out)
    gallery, qdir = out / "gallery", out / "queries"
    photos = skimage_photos(classes)
    torch.manual_seed(seed)
    aug = _augmenter(size)
    total = len(photos) * (views + queries)
    bar = tqdm(total=total, desc="demo gallery: augmenting scikit-image photos", unit="img",
               disable=not progress, file=sys.stderr)
    for cls, files in photos.items():
        srcs = [load_image(f) for f in files]   # transparency composited on white, as indexed
        for split, n, d in (("g", views, gallery), ("q", queries, qdir)):
            if n == 0:
                continue
            (d / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                src = srcs[i % len(srcs)]
                if split == "g" and i < len(srcs):
                    img = src.copy()
                    img.thumbnail((size, size))
                else:
                    img = aug(src)
                img.save(d / cls / f"{cls}_{split}{i:02d}.jpg", quality=90)
                bar.update(1)
    bar.close()
    return gallery, qdir


def ensure_demo_index(root: str | Path = DEFAULT_DEMO_DIR, *, views: int = 8, queries: int = 2,
                      model: str | Path | None = None, progress: bool = True,
                      log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> Path:
    """The demo index ``root/index``, built once with the offline pretrained embedder."""
    from indexer import IndexDir, build_index

    root = Path(root)
    index_dir = root / "index"
    if IndexDir(index_dir).exists():
        return index_dir
    log(f"No index given: building a demo index in {root} from the photos scikit-image ships "
        f"({views} augmented views per photo; one-time, about a minute on 2 cores).")
    gallery, _ = make_demo_gallery(root, views=views, queries=queries, progress=progress)
    if model is None:
        from embedder import default_model_path

        model = default_model_path(on_export=log)       # says so only when it exports
    log(f"Embedding {gallery} and building the faiss index ...")
    build_index(gallery, index_dir, model=model, progress=progress)
    log(f"Demo index ready: {index_dir}")
    return index_dir
