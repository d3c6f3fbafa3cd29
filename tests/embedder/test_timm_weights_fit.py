"""A weights file that does not fit the timm backbone is refused in one line naming the file
(issue 39, FAIL 2; before: a random backbone and exit 0, "parity check passed"). timm's tiny
test models, random init saved the way users hand weights over; no download."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from embedder.errors import PretrainedWeightsUnavailable

REPO = Path(__file__).resolve().parents[2]


def _sd(arch: str, seed: int = 3) -> dict:
    import timm

    torch.manual_seed(seed)
    return timm.create_model(arch, pretrained=False).state_dict()


def _net(arch: str, path: Path):
    from embedder.timm_backbone import create_timm_model

    return create_timm_model(f"timm:{arch}", weights=str(path))


@pytest.mark.parametrize("wrap", ["model_state_dict", "model", "module.", "_orig_mod."])
def test_usual_wrappers_are_unwrapped_and_the_weights_are_the_files(tmp_path: Path, wrap: str) -> None:
    sd = _sd("resnet10t")
    obj = ({f"{wrap}{k}": v for k, v in sd.items()} if wrap.endswith(".") else {wrap: sd, "epoch": 3})
    path = tmp_path / "ckpt.pth"
    torch.save(obj, path)
    got = _net("resnet10t", path).state_dict()
    assert set(got) == set(sd) - {"fc.weight", "fc.bias"}
    for k, v in got.items():
        assert torch.equal(v, sd[k]), k


def test_another_models_weights_are_refused_naming_the_file(tmp_path: Path) -> None:
    import safetensors.torch

    path = tmp_path / "vit.safetensors"
    safetensors.torch.save_file(_sd("test_vit"), str(path))
    with pytest.raises(PretrainedWeightsUnavailable, match=rf"{path}: none of its \d+ tensor names"):
        _net("resnet10t", path)
    pth = tmp_path / "vit.pth"
    torch.save(_sd("test_vit"), pth)
    with pytest.raises(PretrainedWeightsUnavailable, match=rf"{pth}: does not fit timm model resnet10t: "
                                                           r"\d+ of the model's \d+ tensors missing \(conv1"):
        _net("resnet10t", pth)


def test_missing_and_misshaped_keys_are_refused(tmp_path: Path) -> None:
    sd = _sd("resnet10t")
    part = {k: v for k, v in sd.items() if not k.startswith("layer4.")}
    path = tmp_path / "part.pth"
    torch.save(part, path)
    with pytest.raises(PretrainedWeightsUnavailable, match=r"part\.pth: .*tensors missing \(layer4\."):
        _net("resnet10t", path)
    wide = dict(sd, **{"conv1.0.weight": torch.zeros(24, 3, 5, 5)})
    torch.save(wide, path)
    with pytest.raises(PretrainedWeightsUnavailable, match=r"part\.pth: .*1 tensor\(s\) of the wrong shape \(conv1\.0\.weight\)"):
        _net("resnet10t", path)
    # a ViT (it has a checkpoint filter of its own): unexpected keys are named too
    vit = dict(_sd("test_vit"), **{"extra.weight": torch.zeros(3)})
    torch.save(vit, path)
    with pytest.raises(PretrainedWeightsUnavailable, match=r"1 unexpected \(extra\.weight\)"):
        _net("test_vit", path)


def test_nan_weights_are_refused_naming_the_file_and_tensor(tmp_path: Path) -> None:
    sd = _sd("resnet10t")
    sd["layer1.0.conv1.weight"][0, 0, 0, 0] = float("nan")
    path = tmp_path / "nan.pth"
    torch.save(sd, path)
    with pytest.raises(PretrainedWeightsUnavailable, match=r"nan\.pth: 1 tensor\(s\) hold NaN or inf \(layer1\.0\.conv1\.weight\)"):
        _net("resnet10t", path)


def test_huge_safetensors_header_fails_before_it_is_read(tmp_path: Path) -> None:
    """A 90 MB header (the issue's probe; sparse file: nothing is written): refused from its
    length alone, so nothing near 90 MB is read or parsed."""
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 90_000_000) + b"{")
        f.truncate(90_000_100)
    from embedder.timm_weights import safetensors_keys

    with pytest.raises(PretrainedWeightsUnavailable, match=r"huge\.safetensors: safetensors header of 90,000,000 bytes"):
        safetensors_keys(path)
    with pytest.raises(PretrainedWeightsUnavailable, match="header of 90,000,000 bytes"):
        _net("resnet10t", path)
    # a small header that names nothing of the model: refused from the header, no tensor read
    meta = {"junk.%d" % i: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]} for i in range(3)}
    raw = json.dumps(meta).encode()
    other = tmp_path / "other.safetensors"
    other.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    with pytest.raises(PretrainedWeightsUnavailable, match=r"other\.safetensors: none of its 3 tensor names"):
        _net("resnet10t", other)


def test_cli_pretrained_export_refuses_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "wrapped.pth"
    torch.save({"weights": _sd("test_vit"), "epoch": 3}, path)       # a wrapper nobody knows
    p = subprocess.run([sys.executable, "-m", "embedder", "pretrained", "--backbone", "timm:resnet10t",
                        "--weights", str(path), "--pooling", "avg", "--out", str(tmp_path / "m.onnx")],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    lines = p.stderr.strip().splitlines()
    assert p.returncode != 0 and len(lines) == 1 and str(path) in lines[0], p.stderr
