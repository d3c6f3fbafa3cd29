"""The demo gallery written from scikit-image photos: real files, one class per photo, seeded."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
from PIL import Image

from serving.demo import DEMO_PHOTOS, make_demo_gallery, skimage_photos


def _digest(d):
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*.jpg"))}


def test_demo_gallery_layout_and_determinism(tmp_path):
    classes = ["astronaut", "motorcycle", "coins"]
    g, q = make_demo_gallery(tmp_path / "a", views=4, queries=1, size=96, classes=classes, progress=False)
    assert sorted(p.name for p in g.iterdir()) == sorted(classes)
    assert sorted(p.name for p in q.iterdir()) == sorted(classes)
    for c in classes:
        files = sorted((g / c).glob("*.jpg"))
        assert len(files) == 4 and len(list((q / c).glob("*.jpg"))) == 1
        arrays = []
        for f in files:
            with Image.open(f) as im:
                assert im.mode == "RGB" and max(im.size) <= 96
                arrays.append(np.asarray(im.resize((48, 48)), dtype=np.float32))
        # augmented views really differ from each other
        assert min(np.abs(a - b).mean() for i, a in enumerate(arrays) for b in arrays[i + 1:]) > 1.0
    # both motorcycle photos feed one class: views 0 and 1 are the two originals
    with Image.open(g / "motorcycle" / "motorcycle_g00.jpg") as a, Image.open(g / "motorcycle" / "motorcycle_g01.jpg") as b:
        assert a.size == b.size and np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).mean() > 1.0
    g2, _ = make_demo_gallery(tmp_path / "b", views=4, queries=1, size=96, classes=classes, progress=False)
    assert _digest(g) == _digest(g2)
    g3, _ = make_demo_gallery(tmp_path / "c", views=4, queries=1, size=96, classes=classes, seed=1, progress=False)
    assert _digest(g) != _digest(g3)


def test_demo_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown demo classes"):
        skimage_photos(["astronaut", "unicorn"])
    with pytest.raises(ValueError, match="views >= 2"):
        make_demo_gallery(tmp_path, views=1, progress=False)
    assert len(skimage_photos()) >= len(DEMO_PHOTOS) - 3
