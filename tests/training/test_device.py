"""Device resolution: auto / cpu / cuda / cuda:N / torchrun's LOCAL_RANK.

The CPU tests run against a fake CUDA whose `set_device` applies torch's own index check
(`torch.cuda._utils._get_device_index`), so an index-less ``torch.device("cuda")`` is refused
exactly as on a real GPU machine: the bug that killed every default-device run on CUDA.
"""
from __future__ import annotations

import pytest
import torch
from torch.cuda._utils import _get_device_index

from training.distributed import DistInfo
from training.device import amp_dtype, resolve_device


@pytest.fixture
def fake_cuda(monkeypatch):
    """Two visible CUDA devices; records what set_device was given."""
    state = {"current": 0, "set": []}

    def set_device(device):
        index = _get_device_index(device)          # raises for torch.device("cuda"), as torch does
        state["set"].append(index)
        state["current"] = index

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    return state


def test_fake_set_device_rejects_an_index_less_device_like_torch(fake_cuda):
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_device(torch.device("cuda"))


@pytest.mark.parametrize("name", ["auto", "cuda"])
def test_default_and_index_less_cuda_get_an_index(fake_cuda, name):
    dev = resolve_device(name)
    assert dev == torch.device("cuda", 0)
    assert fake_cuda["set"] == [0]


def test_index_less_cuda_follows_the_current_device(fake_cuda):
    fake_cuda["current"] = 1
    assert resolve_device("cuda") == torch.device("cuda", 1)


def test_explicit_index_is_kept(fake_cuda):
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert fake_cuda["set"] == [1]


def test_index_out_of_range_is_a_clear_error(fake_cuda):
    with pytest.raises(RuntimeError, match="CUDA device 3 requested but only 2 visible"):
        resolve_device("cuda:3")


@pytest.mark.parametrize("name", ["auto", "cuda"])
def test_torchrun_rank_takes_its_local_rank(fake_cuda, name):
    info = DistInfo(rank=1, world_size=2, local_rank=1)
    assert resolve_device(name, info) == torch.device("cuda", 1)
    assert fake_cuda["set"] == [1]


def test_torchrun_overrides_an_explicit_index_with_a_warning(fake_cuda):
    info = DistInfo(rank=1, world_size=2, local_rank=1)
    with pytest.warns(UserWarning, match="LOCAL_RANK"):
        assert resolve_device("cuda:0", info) == torch.device("cuda", 1)


def test_torchrun_local_rank_beyond_the_visible_devices(fake_cuda):
    info = DistInfo(rank=3, world_size=4, local_rank=3)
    with pytest.raises(RuntimeError, match="only 2 visible"):
        resolve_device("auto", info)


def test_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="expected auto, cpu, cuda or cuda:N"):
        resolve_device("gpu0")


def test_amp_follows_the_device():
    assert amp_dtype("auto", torch.device("cuda", 0)) is torch.bfloat16
    assert amp_dtype("auto", torch.device("cpu")) is None
    assert amp_dtype("fp16", torch.device("cpu")) is torch.float16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_real_cuda_default_device():
    dev = resolve_device("auto")
    assert dev.type == "cuda" and dev.index == torch.cuda.current_device()
    assert torch.ones(1, device=dev).device == dev
