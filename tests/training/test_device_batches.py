"""``device_batches = true`` (training/device_batches.py): images decoded once into device memory
and augmented there. Checked on the CPU, whose code path is the GPU's: crops drawn as
torchvision's RandomResizedCrop draws them, evaluation inputs bit-identical to the DataLoader's,
exact resume, and an unreadable photo skipped and reported."""
from __future__ import annotations

import shutil

import numpy as np
import torch
from PIL import Image

from training.device_batches import DeviceEvalSet, DeviceImages, crop_boxes
from training.skips import SkipLog


def test_crops_follow_torchvision_random_resized_crop():
    from torchvision.transforms import RandomResizedCrop

    h, w, scale, ratio = 375, 500, (0.08, 1.0), (3 / 4, 4 / 3)
    boxes = crop_boxes(torch.tensor([[h, w]] * 4000), scale, torch.Generator().manual_seed(0))
    cw, ch = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= w).all() and (boxes[:, 3] <= h).all()
    area = cw * ch / (h * w)
    # integer rounding of the sides moves the bounds by a pixel or so
    assert area.min() >= scale[0] * 0.95 and area.max() <= 1.0
    assert (cw / ch).min() >= ratio[0] * 0.98 and (cw / ch).max() <= ratio[1] * 1.02
    torch.manual_seed(0)
    ref = torch.tensor([RandomResizedCrop.get_params(Image.new("RGB", (w, h)), list(scale),
                                                     list(ratio))[2:] for _ in range(4000)])
    # same distribution: mean crop sides within 2% (4,000 draws each: ~0.7% standard error)
    assert abs(cw.mean() / ref[:, 1].float().mean() - 1) < 0.02
    assert abs(ch.mean() / ref[:, 0].float().mean() - 1) < 0.02
    # no try fits a 10 px high strip: torchvision's fallback, the centre crop clamped to 4:3
    strip = crop_boxes(torch.tensor([[10, 1000]]), scale, torch.Generator().manual_seed(0))
    top, left, th, tw = RandomResizedCrop.get_params(Image.new("RGB", (1000, 10)), list(scale),
                                                     list(ratio))
    assert strip[0].tolist() == [left, top, left + tw, top + th]


def test_evaluation_inputs_are_the_dataloaders_bit_for_bit(cub_mini):
    from training.data import ImageDataset, load_splits
    from training.config import TrainConfig

    pre = TrainConfig(backbone="efficientnet_lite0", input_size=64, resize=72).preprocessing()
    _, test = load_splits("folder", cub_mini)
    on_device = DeviceEvalSet(test, pre, torch.device("cpu"), SkipLog(), threads=2)
    x, y = next(on_device.batches(len(test)))
    cpu = ImageDataset(test, pre.eval_transform(), pre.mode, min_side=pre.decode_side)   # as a run builds it
    assert torch.equal(x, torch.stack([cpu[i][0] for i in range(len(test))]))
    assert np.array_equal(y, test.labels)


def test_training_crops_are_photos_of_the_size_asked(cub_mini):
    """Batches of real photos: input-sized, normalised, not blank (the canvas' padding never
    enters a crop), and drawn again the same from the same generator seed."""
    from training.data import load_splits
    from training.config import TrainConfig

    pre = TrainConfig(backbone="efficientnet_lite0", input_size=64, resize=72).preprocessing()
    train, _ = load_splits("folder", cub_mini)
    images = DeviceImages(train, pre, torch.device("cpu"), SkipLog(), threads=2)
    assert images.canvas.shape[1:] == (3, 128, 128) and images.ok.all()
    rows = np.arange(0, len(train), 3)
    x = images.batch(rows, torch.Generator().manual_seed(5))
    assert x.shape == (len(rows), 3, 64, 64) and torch.isfinite(x).all()
    pad = ((0 - torch.tensor(pre.mean)) / torch.tensor(pre.std)).view(1, 3, 1, 1)
    assert ((x - pad).abs().amax(dim=(1, 2, 3)) > 0.5).all()      # no all-padding crop
    assert torch.equal(x, images.batch(rows, torch.Generator().manual_seed(5)))
    assert not torch.equal(x, images.batch(rows, torch.Generator().manual_seed(6)))


def _tiny_cfg(root, out, **kw):
    from training.config import TrainConfig

    base = dict(dataset="omniglot", root=str(root), max_classes=8, backbone="small_cnn",
                pretrained=False, dim=32, loss="margin", miner="distance", das=True, epochs=2,
                lr=1e-3, lr_milestones=[1], batch_size=32, per_class=4, steps_per_epoch=3,
                eval_every=1, eval_clustering=False, export_onnx=False, tensorboard=False,
                progress=False, seed=3, device="cpu", amp="off", device_batches=True,
                out=str(out))
    base.update(kw)
    return TrainConfig(**base)


def test_resume_equals_uninterrupted_run_on_device_batches(tmp_path, omniglot_root):
    """Grey Omniglot strokes (one channel): a run stopped after 1 epoch and resumed ends with the
    weights of the run that never stopped."""
    from training import train

    straight = train(_tiny_cfg(omniglot_root, tmp_path / "a"))
    train(_tiny_cfg(omniglot_root, tmp_path / "b", epochs=1))
    resumed = train(_tiny_cfg(omniglot_root, tmp_path / "b", resume=True))
    strip = lambda h: [{k: v for k, v in r.items() if k != "seconds"} for r in h]  # noqa: E731
    assert strip(resumed.history) == strip(straight.history) and len(straight.history) == 3
    a = torch.load(tmp_path / "a" / "last.pt", weights_only=True)["state_dict"]
    b = torch.load(tmp_path / "b" / "last.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_unreadable_photo_is_left_out_and_reported(cub_mini, tmp_path):
    from training import train

    root = tmp_path / "photos"
    shutil.copytree(cub_mini, root, symlinks=True)
    first = sorted(p for p in root.iterdir() if p.is_dir())[0]
    (first / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a photo")
    res = train(_tiny_cfg(root, tmp_path / "run", dataset="folder", max_classes=0,
                          backbone="efficientnet_lite0", pretrained=False, input_size=32,
                          resize=36, dim=16, epochs=1, batch_size=8, per_class=2,
                          steps_per_epoch=2, das=False))
    assert list(res.skipped) == [str(first / "broken.jpg")]
    assert "broken.jpg" in res.skipped_file.read_text()
    assert res.history[-1]["steps"] == 2 and np.isfinite(res.history[-1]["loss"])
