"""Preprocessing: numpy eval path == torchvision's, and it round-trips as plain data."""
from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch
from torchvision import transforms as T

from embedder.images import load_image
from embedder.preprocess import TF_MEAN, TF_STD, Preprocessing, preprocessing_for


@pytest.mark.parametrize("backbone,size", [("resnet50", 224), ("efficientnet_lite0", 224),
                                           ("efficientnet_lite1", 240), ("efficientnet_lite2", 260)])
def test_eval_array_matches_torchvision(photo_paths, backbone, size):
    pre = preprocessing_for(backbone)
    ref = T.Compose([T.Resize(pre.resize), T.CenterCrop(pre.input_size), T.ToTensor(),
                     T.Normalize(pre.mean, pre.std)])
    for p in photo_paths[:4]:  # square and non-square photos, portrait and landscape
        img = load_image(p)
        ours = pre.eval_array(img)
        assert ours.dtype == np.float32 and ours.shape == (3, size, size)
        np.testing.assert_allclose(ours, ref(img).numpy(), atol=1e-5)


@pytest.mark.parametrize("backbone", ["efficientnet_lite1", "resnet50", "small_cnn"])
def test_eval_array_is_bit_identical_to_totensor_normalize(photo_paths, backbone):
    """The float conversion and normalisation give exactly torchvision's bits (same float32
    operations: / 255, - mean, / std) on the same crop: a faster form must not move embeddings,
    int8 calibrations or near-tie orders (it did once, by 5e-7, and three tests saw it)."""
    pre = preprocessing_for(backbone)
    to_tensor = T.Compose([T.ToTensor(), T.Normalize(pre.mean, pre.std)])
    for p in photo_paths[:4]:
        img = load_image(p, mode=pre.mode)
        np.testing.assert_array_equal(pre.eval_array(img), to_tensor(pre.eval_image(img)).numpy())


def test_small_cnn_grayscale_matches_torchvision(omniglot_paths):
    pre = preprocessing_for("small_cnn")
    assert (pre.mode, pre.input_size, pre.resize, pre.channels()) == ("L", 28, 32, 1)
    ref = T.Compose([T.Resize(32), T.CenterCrop(28), T.ToTensor(), T.Normalize(pre.mean, pre.std)])
    img = load_image(omniglot_paths[0], mode="L")
    ours = pre.eval_array(img)
    assert ours.shape == (1, 28, 28)
    np.testing.assert_allclose(ours, ref(img).numpy(), atol=1e-5)
    # an RGB photo handed to a grayscale pipeline is converted, not rejected
    assert pre.eval_array(load_image(omniglot_paths[0])).shape == (1, 28, 28)


def test_tf_normalisation_is_x_minus_127_over_128(photo_paths):
    pre = preprocessing_for("efficientnet_lite0")
    assert pre.mean == TF_MEAN and pre.std == TF_STD
    img = load_image(photo_paths[0])
    crop = np.asarray(pre.eval_image(img), np.float32).transpose(2, 0, 1)
    np.testing.assert_allclose(pre.eval_array(img), (crop - 127.0) / 128.0, atol=1e-5)


def test_round_trip_and_validation():
    pre = Preprocessing(input_size=56, resize=64, mean=(0.3,), std=(0.2,), mode="L",
                        train_scale=(0.5, 1.0), hflip=False)
    d = json.loads(json.dumps(pre.to_dict()))
    assert Preprocessing.from_dict(d) == pre
    assert Preprocessing.from_dict(pre.to_json()) == pre
    with pytest.raises(ValueError, match="unknown preprocessing keys"):
        Preprocessing.from_dict({**d, "interp": "nearest"})
    with pytest.raises(ValueError, match="needs 3 mean/std values"):
        Preprocessing(mean=(0.5,))
    with pytest.raises(ValueError, match="input_size <= resize"):
        Preprocessing(input_size=300, resize=256)
    with pytest.raises(ValueError, match="mode must be one of"):
        Preprocessing(mode="CMYK")


def test_transforms(photo_paths):
    pre = preprocessing_for("resnet18")
    img = load_image(photo_paths[2])
    ev = pre.eval_transform()
    t = ev(img)
    assert isinstance(t, torch.Tensor) and t.shape == (3, 224, 224)
    assert torch.equal(pickle.loads(pickle.dumps(ev))(img), t)  # DataLoader workers pickle it
    torch.manual_seed(0)
    tr = pickle.loads(pickle.dumps(pre.train_transform()))
    a, b = tr(img), tr(img)
    assert a.shape == (3, 224, 224) and not torch.equal(a, b)  # random crops differ
    # same normalisation as eval: a white image maps to (1 - mean) / std in both pipelines
    from PIL import Image

    white = Image.new("RGB", (300, 260), (255, 255, 255))
    expect = (1 - torch.tensor(pre.mean)) / torch.tensor(pre.std)
    torch.testing.assert_close(tr(white)[:, 5, 5], expect)
    torch.testing.assert_close(ev(white)[:, 5, 5], expect)
