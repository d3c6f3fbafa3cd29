"""Large images are decoded at reduced size (what the model needs), and that changes nothing a
user could notice: normal-size images decode bit for bit as before, a large real photo embeds
to (almost) the same vector as its full-size decode."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from embedder.images import load_image


@pytest.fixture(scope="module")
def retina() -> Path:
    """scikit-image's retina.jpg: a real 1411 x 1411 JPEG photo (the largest it ships)."""
    from skimage import data_dir

    return Path(data_dir) / "retina.jpg"


@pytest.fixture(scope="module")
def huge_jpeg(tmp_path_factory, photo_paths) -> Path:
    """A 36-megapixel JPEG (7360 x 4912, a camera's size) made from a real photo."""
    src = next(p for p in photo_paths if p.name == "hubble_deep_field.jpg")
    out = tmp_path_factory.mktemp("huge") / "huge.jpg"
    Image.open(src).convert("RGB").resize((7360, 4912), Image.BICUBIC).save(out, quality=90)
    return out


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_normal_size_images_decode_bit_identical(photo_paths, omniglot_paths):
    """Shorter side below 2 * min_side: the reduced path returns the very same pixels."""
    for p in [*photo_paths, *omniglot_paths[:4]]:
        for mode, side in (("RGB", 512), ("L", 64)):
            full = load_image(p, mode=mode)
            if min(full.size) >= 2 * side:
                continue
            red = load_image(p, mode=mode, min_side=side)
            assert red.size == full.size and np.array_equal(np.asarray(red), np.asarray(full)), p


def test_large_images_decode_at_reduced_size(huge_jpeg, retina, tmp_path):
    img = load_image(huge_jpeg, min_side=512)
    assert 512 <= min(img.size) < 1024 and img.size[0] > img.size[1]        # 1/8 scale, orientation kept
    assert load_image(huge_jpeg).size == (7360, 4912)                       # None: full size
    assert 512 <= min(load_image(retina, min_side=512).size) < 1024
    png = tmp_path / "big.png"                                              # no DCT scaling: reduce()
    Image.open(retina).save(png)
    assert 512 <= min(load_image(png, min_side=512).size) < 1024
    # already decoded PIL images are reduced the same way
    assert 512 <= min(load_image(Image.open(png), min_side=512).size) < 1024


def test_reduced_decode_keeps_embeddings(pretrained_onnx, retina, huge_jpeg):
    """Full decode vs reduced decode of large real photos, through the pretrained embedder."""
    from embedder import OnnxEmbedder

    emb = OnnxEmbedder(pretrained_onnx, device="cpu")
    pre = emb.preprocessing
    for path in (retina, huge_jpeg):
        full = emb.embed_arrays(pre.eval_array(load_image(path, mode=pre.mode))[None])[0]
        reduced = emb.embed([path])[0]                  # prepare() decodes at pre.decode_side
        assert load_image(path, min_side=pre.decode_side).size != load_image(path).size   # it did reduce
        assert _cos(full, reduced) >= 0.99, (path.name, _cos(full, reduced))


def test_serving_decodes_uploads_at_reduced_size(huge_jpeg):
    from serving.uploads import decode_upload

    data = huge_jpeg.read_bytes()
    img = decode_upload(data, "huge.jpg", max_bytes=len(data), min_side=512)
    assert max(img.size) < 2000 and min(img.size) >= 512
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    assert Image.open(buf).size == img.size
