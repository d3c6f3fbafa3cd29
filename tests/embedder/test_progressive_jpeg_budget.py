"""Progressive JPEG and MPO decodes are charged libjpeg's full coefficient buffer in the decode
budget (issue 39, FAIL 1; before: charged their scaled frame, ~1 MB, while libjpeg held 6 bytes
a pixel: 4 x 6300^2 at once peaked at +462 MB). Asserts on the budget's accounting (a real
DecodeBudget that records what is reserved), not on timing or RSS."""
from __future__ import annotations

import io
from contextlib import contextmanager
from typing import Iterator

import pytest
from PIL import Image

from embedder import decode_budget
from embedder.images import ImageTooLargeError, load_image


class RecordingBudget(decode_budget.DecodeBudget):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.reserved: list[int] = []

    @contextmanager
    def reserve(self, n: int) -> Iterator[None]:
        self.reserved.append(int(n))
        with super().reserve(n):
            yield


def _jpeg(side: int, **kw) -> bytes:
    b = io.BytesIO()
    Image.new("RGB", (side, side), (40, 90, 160)).save(b, "JPEG", **kw)
    return b.getvalue()


def _mpo(side: int, **kw) -> bytes:
    b = io.BytesIO()
    frames = [Image.new("RGB", (side, side), c) for c in ((40, 90, 160), (10, 10, 10))]
    frames[0].save(b, "MPO", save_all=True, append_images=frames[1:], **kw)
    return b.getvalue()


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> RecordingBudget:
    rec = RecordingBudget(2 ** 31)
    monkeypatch.setattr(decode_budget, "BUDGET", rec)
    return rec


def test_progressive_6300_is_charged_its_coefficients(recorder: RecordingBudget) -> None:
    coeffs = 6304 * 6304 * 3 * 2                      # 4:4:4, 8x8 blocks, 2 bytes a coefficient
    load_image(_jpeg(6300, progressive=True, subsampling=0), min_side=224)
    assert recorder.reserved and recorder.reserved[-1] >= coeffs
    recorder.reserved.clear()
    load_image(_jpeg(6300, progressive=True, subsampling=2), min_side=224)   # 4:2:0: half
    assert coeffs // 2 <= recorder.reserved[-1] < coeffs
    recorder.reserved.clear()
    load_image(_jpeg(6300, subsampling=0), min_side=224)                    # baseline: scaled frame
    assert max(recorder.reserved, default=0) < 16 * 2 ** 20


def test_progressive_mpo_is_charged_like_jpeg(recorder: RecordingBudget) -> None:
    load_image(_mpo(4000, progressive=True, subsampling=0), min_side=224)
    assert recorder.reserved[-1] >= 4000 * 4000 * 3 * 2


def test_over_the_budget_alone_is_refused_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = RecordingBudget(160 * 2 ** 20)
    monkeypatch.setattr(decode_budget, "BUDGET", rec)
    data = _jpeg(6300, progressive=True, subsampling=0)
    with pytest.raises(ImageTooLargeError, match=r"6300x6300 progressive JPEG \(39\.7 MP.*needs about 2\d\d MB"):
        load_image(data, min_side=224, name="p.jpg")
    with pytest.raises(ImageTooLargeError):                                 # a truncated third too
        load_image(data[:len(data) // 3], min_side=224, name="p.jpg")
    assert rec.reserved == []                                                # nothing decoded


def test_scans_are_counted_in_the_first_frame_only() -> None:
    assert decode_budget.jpeg_scans(_jpeg(64)) == 1
    assert decode_budget.jpeg_scans(_jpeg(64, progressive=True)) > 1
    assert decode_budget.jpeg_scans(_mpo(64)) == 1                           # two frames, one scan each
