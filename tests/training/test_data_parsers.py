"""Dataset parsers on real images: Omniglot from the shared data, and tiny CUB / CARS / SOP /
folder layouts built in tmp_path from real Omniglot and scikit-image files."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from training.data import (DatasetLayoutError, ImageDataset, cars_splits, cub_splits,
                           folder_splits, load_splits, omniglot_splits, sop_splits)


def _copy(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    return dst


@pytest.fixture()
def four_class_images(omniglot_paths, photo_paths) -> list[list[Path]]:
    """Four 'classes' of two real images each (Omniglot drawings and colour photos)."""
    return [omniglot_paths[0:2], omniglot_paths[4:6], photo_paths[0:2], photo_paths[2:4]]


def test_omniglot_background_only_holds_out_last_alphabets(omniglot_root):
    train, test = omniglot_splits(omniglot_root, holdout_alphabets=10)
    alphabets = sorted(p.name for p in (omniglot_root / "images_background").iterdir() if p.is_dir())
    test_alpha = {c.split("/")[0] for c in test.classes}
    train_alpha = {c.split("/")[0] for c in train.classes}
    assert test_alpha == set(alphabets[-10:])
    assert train_alpha == set(alphabets[:-10])
    assert not set(train.classes) & set(test.classes)
    assert train.num_classes + test.num_classes == 964
    # every class is alphabet/character and owns its 20 drawings
    assert np.bincount(train.labels).tolist() == [20] * train.num_classes
    for path, label in zip(test.paths[:50], test.labels[:50]):
        assert f"{path.parent.parent.name}/{path.parent.name}" == test.classes[label]


def test_omniglot_max_classes_keeps_first_classes_of_each_split(omniglot_root):
    full_train, full_test = omniglot_splits(omniglot_root)
    train, test = load_splits("omniglot", omniglot_root, max_classes=5)
    assert train.classes == full_train.classes[:5] and test.classes == full_test.classes[:5]
    assert len(train) == 100 and set(train.labels.tolist()) == set(range(5))


def test_omniglot_uses_images_evaluation_when_present(tmp_path, omniglot_root):
    bg = omniglot_root / "images_background"
    alphas = sorted(p for p in bg.iterdir() if p.is_dir())
    (tmp_path / "images_background").mkdir()
    (tmp_path / "images_evaluation").mkdir()
    (tmp_path / "images_background" / alphas[0].name).symlink_to(alphas[0])
    (tmp_path / "images_evaluation" / alphas[1].name).symlink_to(alphas[1])
    train, test = omniglot_splits(tmp_path)
    assert {c.split("/")[0] for c in train.classes} == {alphas[0].name}
    assert {c.split("/")[0] for c in test.classes} == {alphas[1].name}


def test_cub_official_layout(tmp_path, four_class_images):
    root = tmp_path / "CUB_200_2011"
    names = ["001.Black_footed_Albatross", "002.Laysan_Albatross", "003.Sooty_Albatross",
             "004.Groove_billed_Ani"]
    images, labels, n = [], [], 0
    for ci, (name, srcs) in enumerate(zip(names, four_class_images), 1):
        for j, src in enumerate(srcs):
            n += 1
            rel = f"{name}/{name}_{j}{src.suffix}"
            _copy(src, root / "images" / rel)
            images.append(f"{n} {rel}")
            labels.append(f"{n} {ci}")
    (root / "images.txt").write_text("\n".join(images) + "\n")
    (root / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    (root / "classes.txt").write_text("\n".join(f"{i} {c}" for i, c in enumerate(names, 1)) + "\n")
    train, test = cub_splits(root)
    assert train.classes == names[:2] and test.classes == names[2:]
    assert len(train) == 4 and len(test) == 4
    assert all(p.is_file() for p in train.paths + test.paths)
    assert all(train.classes[l] in str(p) for p, l in zip(train.paths, train.labels))


def test_cars_official_mat_and_folder_layouts(tmp_path, four_class_images):
    import scipy.io

    root = tmp_path / "cars"
    dt = np.dtype([("relative_im_path", "O"), ("bbox_x1", "O"), ("class", "O"), ("test", "O")])
    recs, n = [], 0
    for cls, srcs in enumerate(four_class_images, 1):
        for src in srcs:
            n += 1
            rel = f"car_ims/{n:06d}.png"
            _copy(src, root / rel)
            recs.append((rel, np.array([[1]]), np.array([[cls]], dtype=np.uint8), np.array([[0]])))
    ann = np.array(recs, dtype=dt).reshape(1, -1)
    class_names = np.array(["AM General Hummer", "Acura RL", "Acura TL", "Acura TSX"],
                           dtype=object).reshape(1, -1)
    scipy.io.savemat(root / "cars_annos.mat", {"annotations": ann, "class_names": class_names})
    train, test = cars_splits(root)
    assert train.classes == ["AM General Hummer", "Acura RL"]
    assert test.classes == ["Acura TL", "Acura TSX"]
    assert [p.name for p in train.paths] == ["000001.png", "000002.png", "000003.png", "000004.png"]
    assert train.labels.tolist() == [0, 0, 1, 1]

    root2 = tmp_path / "cars_folders"
    for cls, srcs in zip(["c10", "c2", "c3", "c1"], four_class_images):
        for j, src in enumerate(srcs):
            _copy(src, root2 / "images" / cls / f"{j}{src.suffix}")
    train, test = cars_splits(root2)
    assert train.classes == ["c1", "c2"] and test.classes == ["c3", "c10"]  # natural sort


def test_sop_text_files(tmp_path, four_class_images):
    root = tmp_path / "Stanford_Online_Products"
    rows = {"Ebay_train.txt": [], "Ebay_test.txt": []}
    n = 0
    for cls, srcs in enumerate(four_class_images, 1):
        split = "Ebay_train.txt" if cls <= 2 else "Ebay_test.txt"
        for j, src in enumerate(srcs):
            n += 1
            rel = f"bicycle_final/{cls}_{j}{src.suffix}"
            _copy(src, root / rel)
            rows[split].append(f"{n} {cls} 1 {rel}")
    for name, lines in rows.items():
        (root / name).write_text("image_id class_id super_class_id path\n" + "\n".join(lines) + "\n")
    train, test = sop_splits(root)
    assert train.classes == ["1", "2"] and test.classes == ["3", "4"]
    assert len(train) == 4 and all(p.is_file() for p in test.paths)


def test_folder_split_by_half_or_explicit_list(tmp_path, four_class_images):
    for cls, srcs in zip(["dog", "cat", "owl", "ant"], four_class_images):
        for j, src in enumerate(srcs):
            _copy(src, tmp_path / cls / f"{j}{src.suffix}")
    (tmp_path / "notes.txt").write_text("not a class")
    train, test = folder_splits(tmp_path)
    assert train.classes == ["ant", "cat"] and test.classes == ["dog", "owl"]
    train, test = folder_splits(tmp_path, ["cat"])
    assert test.classes == ["cat"] and train.classes == ["ant", "dog", "owl"]
    with pytest.raises(DatasetLayoutError, match="test classes not found: zebra"):
        folder_splits(tmp_path, ["zebra"])


def test_test_images_holds_out_a_share_of_every_class_and_trains_on_all(cub_mini, tmp_path):
    """``test_images``: a team's one labelled gallery, every class in training, a fifth of each
    class's photos (every fifth by name) held out to test: disjoint, the same on every run, and a
    class of under five photos only trains."""
    train, test = load_splits("folder", cub_mini, test_images=0.2)
    assert train.classes == test.classes and len(train.classes) == 8
    assert not set(train.paths) & set(test.paths) and len(train) + len(test) == 8 * 12
    assert np.bincount(test.labels).tolist() == [2] * 8                 # floor(12 * 0.2) of 12 each
    names = sorted(p.name for p, y in zip(test.paths, test.labels) if y == 0)
    first = sorted(p.name for p in (cub_mini / train.classes[0]).iterdir())
    assert names == [first[4], first[9]]                                 # the 5th and the 10th
    again = load_splits("folder", cub_mini, test_images=0.2)[1]
    assert again.paths == test.paths
    for c, n in (("big", 12), ("small", 4)):                              # under 1 / 0.2 photos: trains only
        (tmp_path / c).mkdir()
        for f in sorted((cub_mini / train.classes[0]).iterdir())[:n]:
            (tmp_path / c / f.name).symlink_to(f.resolve())
    train, test = folder_splits(tmp_path, test_images=0.2)
    assert np.bincount(test.labels, minlength=2).tolist() == [2, 0] and np.bincount(train.labels).tolist() == [10, 4]


def test_nested_folders_are_the_classes_indexer_build_labels(tmp_path, four_class_images):
    """A folder trains with the labels `indexer build` gives it: an image's folder relative to the
    root ("dogs/beagle" when nested); images at the root are unlabelled, empty folders no class,
    hidden entries (a Jupyter checkpoint folder, macOS's ``._`` copies) not walked. Until
    2026-11-30 training took the top folders' own files only ("dogs" held none), and until
    2026-11-30 a hidden folder was a class of both."""
    from embedder.folders import walk_gallery

    for rel, src in [("dogs/beagle/0", 0), ("dogs/beagle/1", 0), ("dogs/pug/0", 1), ("cat/0", 2),
                     ("cat/kittens/0", 3), ("top", 3), (".ipynb_checkpoints/0", 1),
                     ("cat/._0", 2), ("dogs/.thumbnails/0", 0)]:
        img = four_class_images[src][0]
        _copy(img, tmp_path / f"{rel}{img.suffix}")
    (tmp_path / "empty" / "deeper").mkdir(parents=True)
    (tmp_path / "dogs" / "loop").symlink_to(tmp_path)                 # a link back up: walked once
    train, test = folder_splits(tmp_path)
    assert train.classes + test.classes == ["cat", "cat/kittens", "dogs/beagle", "dogs/pug"]
    labelled = {str(f.abspath): f.label for f in walk_gallery(tmp_path) if f.problem is None and f.label}
    got = {str(p): s.classes[y] for s in (train, test) for p, y in zip(s.paths, s.labels)}
    assert got == labelled and len(got) == 5


@pytest.mark.parametrize("dataset,expected", [
    ("cub", "images.txt"), ("cars", "cars_annos.mat"), ("sop", "Ebay_train.txt"),
    ("omniglot", "images_background"), ("folder", "class sub-folders")])
def test_wrong_root_names_what_and_where(tmp_path, dataset, expected):
    with pytest.raises(DatasetLayoutError) as info:
        load_splits(dataset, tmp_path)
    assert expected in str(info.value) and str(tmp_path) in str(info.value)


def test_image_dataset_decodes_through_embedder_preprocessing(omniglot_root):
    from embedder.preprocess import preprocessing_for

    pre = preprocessing_for("small_cnn")
    train, _ = load_splits("omniglot", omniglot_root, max_classes=2)
    plain = ImageDataset(train, pre.eval_transform(), pre.mode)
    cached = ImageDataset(train, pre.eval_transform(), pre.mode, cache=True)
    x, y = plain[3]
    assert x.shape == (1, pre.input_size, pre.input_size) and x.dtype == torch.float32
    assert y == int(train.labels[3])
    assert torch.equal(cached[3][0], x) and torch.equal(cached[3][0], x)  # second hit: from cache
    aug = ImageDataset(train, pre.train_transform(), pre.mode, cache=True)
    assert aug[0][0].shape == x.shape


def test_class_range_relabels_a_window_of_classes_and_refuses_one_past_the_end():
    from training.data import Split

    s = Split([Path(f"{c}/{i}.png") for c in "abcd" for i in range(2)],
              np.repeat(np.arange(4), 2).astype(np.int64), list("abcd"))
    w = s.class_range(1, 2)
    assert w.classes == ["b", "c"] and w.labels.tolist() == [0, 0, 1, 1]
    assert [p.parent.name for p in w.paths] == ["b", "b", "c", "c"]
    assert s.first_classes(2).paths == s.class_range(0, 2).paths
    with pytest.raises(ValueError, match="the split has 4"):
        s.class_range(3, 2)


def test_a_phone_photo_is_decoded_as_small_as_training_and_its_evaluation_need(tmp_path, cub_root):
    """A 12 MP photo was decoded whole for every training sample (130 ms for a 224 px crop). The
    training decode keeps the smallest random crop >= input_size pixels (1/2 here, 5x faster);
    the test decode is `indexer build`'s (``decode_side``): the run's test figures and the
    gallery's embeddings read the same pixels."""
    from PIL import Image

    from embedder import load_image
    from training.config import TrainConfig
    from training.data import Split
    from training.run_state import build_datasets

    src = sorted(p for p in (cub_root / sorted(d.name for d in cub_root.iterdir())[0]).iterdir())[0]
    photo = tmp_path / "a" / "phone.jpg"
    photo.parent.mkdir()
    Image.open(src).convert("RGB").resize((4032, 3024), Image.BICUBIC).save(photo, quality=90)
    split = Split([photo], np.zeros(1, np.int64), ["a"])
    cfg = TrainConfig(backbone="efficientnet_lite1", pretrained=False, input_size=224, resize=256)
    pre = cfg.preprocessing()
    train, test = build_datasets(cfg, split, split)
    assert pre.train_decode_side == 915 and train.image(0).size == (2016, 1512)
    assert test.image(0).size == (1008, 756)                        # decode_side 512: 1/4
    assert train[0][0].shape == test[0][0].shape == (3, 224, 224)
    x = test[0][0].numpy()
    assert np.array_equal(x, pre.eval_array(load_image(photo, min_side=pre.decode_side)))
    assert not np.array_equal(x, pre.eval_array(load_image(photo)))   # the full decode's pixels differ
    pano = tmp_path / "a" / "pano.jpg"                  # 70 MP: over the 64 MP of a whole decode
    Image.new("L", (10000, 7000), 90).save(pano, quality=30)
    train, test = build_datasets(cfg, Split([pano], np.zeros(1, np.int64), ["a"]), split)
    assert train.image(0).size == (2500, 1750) and test.image(0).size == (1008, 756)
