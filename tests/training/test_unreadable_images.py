"""A training set with unreadable images (truncated JPEG, zero bytes, text named .jpg): the run
skips and reports them and trains on the rest, through the trunk cache and through the plain
image DataLoader; too few readable classes is a one-line error. Real photos (caltech101-dev,
copied to a temporary folder), real decoding, the real CLI entry point."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from knn_asserts import recall_bounds

CLASSES = ["accordion", "anchor", "ant", "barrel", "bass", "beaver"]   # c1-c3 train, c4-c6 test
PER_CLASS = 5


@pytest.fixture()
def dataset(tmp_path, caltech_root) -> dict:
    """root/c1..c6 with 5 real photos each, plus four unreadable files: a truncated JPEG in c1
    (train), an empty .jpg and a camera's raw photo (a format not decoded here) in c2 (train) and
    a text file named .jpg in c4 (test, sorted first, so the ONNX parity check picks it)."""
    root = tmp_path / "data"
    for k, name in enumerate(CLASSES, 1):
        d = root / f"c{k}"
        d.mkdir(parents=True)
        for src in sorted((caltech_root / name).glob("*.jpg"))[:PER_CLASS]:
            shutil.copy(src, d / src.name)
    whole = (root / "c1" / "image_0001.jpg").read_bytes()
    bad = {"truncated": root / "c1" / "x_truncated.jpg", "empty": root / "c2" / "x_empty.jpg",
           "text": root / "c4" / "0_notes.jpg", "raw": root / "c2" / "IMG_0001.CR2"}
    bad["truncated"].write_bytes(whole[: len(whole) // 3])
    bad["empty"].write_bytes(b"")
    bad["text"].write_text("not a photo, a note someone saved with the wrong name\n")
    bad["raw"].write_bytes(b"II*\x00" + b"\x00" * 200)
    return {"root": root, "bad": bad, "whole": whole, "cache": tmp_path / "cache"}


REASONS = {"truncated": "truncated or corrupt image data", "empty": "empty file (0 bytes)",
           "text": "not an image (unrecognised format)", "raw": "a camera raw file, not decoded here"}


def _run(data: dict, out: Path, capsys, *, cached: bool, **extra) -> tuple[int, str, str]:
    from training.__main__ import main

    opts = dict(dataset="folder", root=str(data["root"]), backbone="small_cnn", pretrained="false",
                dim=8, loss="margin", miner="distance", das="false", epochs=1, lr=1e-3,
                batch_size=4, per_class=2, eval_clustering="false", eval_ks="[1]",
                tensorboard="false", progress="false", seed=1, device="cpu", amp="off",
                threads=1, out=str(out), export_onnx="false", head_init="pca")
    if cached:
        opts.update(trainable="head", trunk_cache="true", trunk_views=1,
                    cache_dir=str(data["cache"]))
    opts.update(extra)
    argv = [a for k, v in opts.items() for a in (f"--{k}", str(v))]
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _check_skipped(out: Path, stdout: str, data: dict, which=("truncated", "empty", "text", "raw")):
    listed = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert sorted(d["path"] for d in listed) == sorted(str(data["bad"][k]) for k in which)
    reasons = {d["path"]: d["reason"] for d in listed}
    assert all(reasons[str(data["bad"][k])].startswith(REASONS[k]) for k in which), reasons
    for k in which:
        assert f"skipped {data['bad'][k]}: {REASONS[k]}" in stdout
    assert f"{len(which)} unreadable image(s) skipped" in stdout
    report = json.loads((out / "metrics.json").read_text())
    assert report["skipped"] == len(which)
    return report


def _readable_r1(checkpoint: Path, data: dict) -> tuple[float, float]:
    """R@1 of the checkpoint on the test classes' readable photos, computed here: (lowest,
    highest) over the ways float ties at rank 1 break (the run embedded them in other batches)."""
    from embedder import load_checkpoint
    from embedder.metrics import evaluate
    from training.data import ImageDataset, folder_splits
    from training.config import TrainConfig

    _, test = folder_splits(data["root"])
    keep = [i for i, p in enumerate(test.paths) if p not in data["bad"].values()]
    pre = TrainConfig(backbone="small_cnn").preprocessing()
    ds = ImageDataset(test, pre.eval_transform(), pre.mode, min_side=pre.decode_side)   # as the run decodes
    model, _ = load_checkpoint(checkpoint)
    with torch.no_grad():
        emb = model(torch.stack([ds[i][0] for i in keep])).numpy()
    r1 = evaluate(emb, test.labels[keep], ks=(1,), clustering=False, map_r=False)["R@1"]
    lo, hi = recall_bounds(emb, test.labels[keep], 1, atol=1e-6)
    assert lo - 1e-9 <= r1 <= hi + 1e-9
    return lo, hi


def test_plain_loader_skips_unreadable_images_and_trains_on_the_rest(tmp_path, dataset, capsys):
    out = tmp_path / "run"
    rc, stdout, stderr = _run(dataset, out, capsys, cached=False, export_onnx="true",
                              parity_images=3, das="true", epochs=2)   # DAS on shorter batches
    assert rc == 0, stderr
    report = _check_skipped(out, stdout, dataset)
    ck = torch.load(out / "last.pt", weights_only=True)
    assert ck["global_step"] >= 1 and np.isfinite(report["history"][-1]["loss"])
    # evaluation saw exactly the readable test photos, with their own labels
    lo, hi = _readable_r1(out / "best.pt", dataset)
    assert lo - 1e-6 <= report["best"]["R@1"] <= hi + 1e-6
    assert (out / "model.onnx").stat().st_size > 0      # parity check ran on readable images


def test_trunk_cache_records_failed_rows_and_a_fixed_file_rebuilds_it(tmp_path, dataset, capsys):
    out = tmp_path / "run"
    rc, stdout, stderr = _run(dataset, out, capsys, cached=True)
    assert rc == 0, stderr
    report = _check_skipped(out, stdout, dataset)
    assert report["history"][-1]["steps"] >= 1 and np.isfinite(report["history"][-1]["loss"])
    lo, hi = _readable_r1(out / "best.pt", dataset)
    assert lo - 1e-5 <= report["best"]["R@1"] <= hi + 1e-5
    metas = sorted(dataset["cache"].glob("*.json"))
    failed = [json.loads(m.read_text())["failed"] for m in metas]
    assert sorted(len(f) for f in failed) == [1, 3]          # test: the text file; train: three

    # Same files: the cache is reused (no new file) and still reports the same failures.
    rc, stdout, _ = _run(dataset, tmp_path / "again", capsys, cached=True)
    assert rc == 0 and sorted(dataset["cache"].glob("*.npy")) == \
        sorted(m.with_suffix(".npy") for m in metas)
    _check_skipped(tmp_path / "again", stdout, dataset)

    # The truncated file is fixed: a new training cache (its key has every size and mtime), and
    # the photo is no longer skipped: no stale zero row is reused.
    dataset["bad"]["truncated"].write_bytes(dataset["whole"])
    rc, stdout, stderr = _run(dataset, tmp_path / "fixed", capsys, cached=True)
    assert rc == 0, stderr
    assert len(list(dataset["cache"].glob("*.npy"))) == len(metas) + 1
    _check_skipped(tmp_path / "fixed", stdout, dataset, which=("empty", "text", "raw"))


@pytest.mark.parametrize("cached", [True, False], ids=["trunk_cache", "plain"])
def test_a_class_with_no_readable_image_is_dropped(tmp_path, dataset, capsys, cached):
    for p in (dataset["root"] / "c3").iterdir():
        p.write_bytes(b"")
    out = tmp_path / "run"
    rc, stdout, stderr = _run(dataset, out, capsys, cached=cached, epochs=2)
    assert rc == 0, stderr
    assert f"class 'c3' (train): all {PER_CLASS} images unreadable; dropped" in stdout
    listed = (out / "skipped.jsonl").read_text().splitlines()
    assert len(listed) == 4 + PER_CLASS
    ck = torch.load(out / "last.pt", weights_only=True)
    assert ck["global_step"] >= 1


@pytest.mark.parametrize("cached", [True, False], ids=["trunk_cache", "plain"])
def test_fewer_than_two_readable_classes_is_a_one_line_error(tmp_path, dataset, capsys, cached):
    for c in ("c2", "c3"):
        for p in (dataset["root"] / c).iterdir():
            p.write_bytes(b"")
    rc, _, stderr = _run(dataset, tmp_path / "run", capsys, cached=cached, head_init="random")
    assert rc == 1
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m training: error: ")
    assert "at least 2" in lines[0] and "unreadable" in lines[0]


def test_a_root_without_class_folders_leaves_no_run_folder(tmp_path, capsys):
    """A missing root or one with no class folders: one line, exit 1, and --out not created (no
    config.json of a run that never started)."""
    (tmp_path / "empty" / "notes").mkdir(parents=True)
    for root, why in ((tmp_path / "nope", "not a directory"), (tmp_path / "empty", "at least 2 class")):
        rc, _, stderr = _run({"root": root}, tmp_path / "run", capsys, cached=False)
        lines = stderr.strip().splitlines()
        assert rc == 1 and len(lines) == 1 and why in lines[0] and str(root) in lines[0], stderr
        assert not (tmp_path / "run").exists()


def test_trunk_activations_without_failed_raises_the_first_unreadable_image(tmp_path, dataset):
    """A caller that cannot leave rows out (no ``failed=``) must never read the zero rows."""
    from embedder import ImageLoadError
    from training.config import TrainConfig
    from training.data import folder_splits
    from training.run_state import build_datasets, build_model
    from training.stages import split_stages
    from training.trunk_cache import trunk_activations

    cfg = TrainConfig(dataset="folder", root=str(dataset["root"]), backbone="small_cnn",
                      pretrained=False, dim=8)
    train, _ = build_datasets(cfg, *folder_splits(dataset["root"]))
    split = split_stages(build_model(cfg), "head")
    kw = dict(what="t", cache_dir=tmp_path / "c", progress=False)
    failed: dict[int, str] = {}
    acts = trunk_activations(split.prefix, train, cfg.preprocessing(), failed=failed, **kw)
    rows = {train.split.paths[r] for r in failed}
    assert rows == {dataset["bad"]["truncated"], dataset["bad"]["empty"], dataset["bad"]["raw"]}
    assert not np.asarray(acts[0, sorted(failed)]).any()          # zero rows, left out
    assert np.asarray(acts[0, [r for r in range(len(train)) if r not in failed]]).any(axis=1).all()
    with pytest.raises(ImageLoadError, match="x_truncated.jpg: truncated or corrupt"):
        trunk_activations(split.prefix, train, cfg.preprocessing(), **kw)
