"""Preprocessing: the one place that resizes and normalises an image for the model. Saved in every
checkpoint and ONNX file and read back by indexer and serving, so an image is prepared exactly as
during evaluation; ``eval_array`` reproduces torchvision's eval transforms with PIL + numpy only.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import numpy as np
from PIL import Image

from .images import MODES, to_mode

IMAGENET_MEAN: tuple[float, ...] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, ...] = (0.229, 0.224, 0.225)
# TF-style EfficientNet-Lite normalisation (x - 127) / 128 on 0..255, expressed on 0..1 pixels.
TF_MEAN: tuple[float, ...] = (127 / 255,) * 3
TF_STD: tuple[float, ...] = (128 / 255,) * 3
# small_cnn on grayscale: a neutral centring; BatchNorm after the first conv absorbs the rest.
GRAY_MEAN: tuple[float, ...] = (0.5,)
GRAY_STD: tuple[float, ...] = (0.5,)
# EfficientNet-Lite native (input size, resize): the sizes the TF reference trained and evaluated
# them at, resize = input / crop_pct as in timm's configs (0.875, 0.882, 0.890).
#: PIL resize filters by the names timm's pretrained configs use (files without the key: bilinear).
INTERPOLATIONS: tuple[str, ...] = ("bilinear", "bicubic", "nearest", "lanczos")
LITE_SIZES: dict[str, tuple[int, int]] = {"efficientnet_lite0": (224, 256),
                                          "efficientnet_lite1": (240, 272),
                                          "efficientnet_lite2": (260, 292)}


@dataclass(frozen=True)
class Preprocessing:
    """Eval (resize shorter side + centre crop) and train (random resized crop + flip) pipelines;
    ``train_scale`` and ``hflip`` are stored so a checkpoint records how it was trained."""

    input_size: int = 224
    resize: int = 256
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    mode: str = "RGB"
    train_scale: tuple[float, float] = (0.08, 1.0)
    hflip: bool = True
    interpolation: str = "bilinear"   # PIL resize filter: bilinear | bicubic | nearest | lanczos

    def __post_init__(self) -> None:
        for key in ("mean", "std", "train_scale"):
            object.__setattr__(self, key, tuple(float(x) for x in getattr(self, key)))
        if self.mode not in MODES:
            raise ValueError(f"Preprocessing.mode must be one of {MODES}, got {self.mode!r}")
        if int(self.input_size) <= 0 or int(self.resize) < int(self.input_size):
            raise ValueError(f"Preprocessing needs 0 < input_size <= resize, got input_size="
                             f"{self.input_size}, resize={self.resize}")
        c = self.channels()
        if len(self.mean) != c or len(self.std) != c:
            raise ValueError(f"Preprocessing mode {self.mode!r} needs {c} mean/std values, got "
                             f"mean={self.mean}, std={self.std}")
        if any(s <= 0 for s in self.std):
            raise ValueError(f"Preprocessing std must be positive, got {self.std}")
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"Preprocessing interpolation must be one of {', '.join(INTERPOLATIONS)}, "
                             f"got {self.interpolation!r}")

    def channels(self) -> int:
        return 3 if self.mode == "RGB" else 1

    def at_size(self, size: int, resize: int = 0) -> "Preprocessing":
        """This preprocessing at input ``size``, resized to ``resize`` (0: the same resize/crop ratio)."""
        resize = resize or round(size * self.resize / self.input_size)
        return replace(self, input_size=int(size), resize=max(resize, int(size)))

    @property
    def decode_side(self) -> int:
        """The least shorter side images are decoded at: twice ``resize``, so the antialiased eval
        resize still shrinks >= 2x and a reduced decode gives (almost) the full decode's pixels."""
        return 2 * int(self.resize)

    @property
    def train_decode_side(self) -> int:
        """The least shorter side training images are decoded at: the smallest RandomResizedCrop
        (``train_scale[0]`` of the area, aspect 4:3, torchvision's widest) still spans ``input_size``
        pixels, as from the full decode. A phone's 12 MP JPEG decodes at 1/2, a 48 MP one at 1/4:
        a training sample 5-9x faster (docs/benchmarks/training-das.md); smaller photos as before."""
        return max(self.decode_side, math.ceil(self.input_size / math.sqrt(self.train_scale[0] * 3 / 4)))

    def to_dict(self) -> dict:
        """Plain types only (lists, not tuples) so ``torch.load(weights_only=True)`` and JSON agree."""
        return {**asdict(self), "mean": list(self.mean), "std": list(self.std),
                "train_scale": list(self.train_scale)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | str) -> "Preprocessing":
        if isinstance(d, str):
            d = json.loads(d)
        if not isinstance(d, dict):
            raise ValueError(f"preprocessing must be a mapping, got {type(d).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown preprocessing keys {sorted(unknown)}; expected {sorted(known)}")
        return cls(**d)

    # ---- eval ---------------------------------------------------------------------------------
    def _resized_size(self, w: int, h: int) -> tuple[int, int]:
        # torchvision.transforms.functional._compute_resized_output_size with an int size
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = self.resize, int(self.resize * long / short)
        return (new_short, new_long) if w <= h else (new_long, new_short)

    def eval_image(self, img: Image.Image) -> Image.Image:
        """Resize + centre crop, still a PIL image (for display of what the model sees)."""
        if img.mode != self.mode:
            img = to_mode(img, self.mode)
        w, h = img.size
        nw, nh = self._resized_size(w, h)
        if (nw, nh) != (w, h):
            img = img.resize((nw, nh), _PIL_FILTERS[self.interpolation])
        s = self.input_size
        top, left = int(round((nh - s) / 2.0)), int(round((nw - s) / 2.0))
        return img.crop((left, top, left + s, top + s))

    def eval_array(self, img: Image.Image) -> np.ndarray:
        """(C, H, W) float32, normalised as torchvision's ``ToTensor`` + ``Normalize`` (the same
        bits), but transposed first and in place per plane (a third of decode + preprocess saved)."""
        a = np.asarray(self.eval_image(img))
        a = a[None] if a.ndim == 2 else a.transpose(2, 0, 1)
        out = a.astype(np.float32, order="C")
        out /= np.float32(255.0)
        out -= np.asarray(self.mean, np.float32)[:, None, None]
        out /= np.asarray(self.std, np.float32)[:, None, None]
        return out

    def eval_transform(self) -> Callable[[Image.Image], "torch.Tensor"]:  # noqa: F821
        return _EvalTransform(self)

    # ---- train --------------------------------------------------------------------------------
    def train_transform(self) -> Callable[[Image.Image], "torch.Tensor"]:  # noqa: F821
        from torchvision import transforms as T

        steps: list = [_ToMode(self.mode),
                       T.RandomResizedCrop(self.input_size, scale=self.train_scale,
                                           interpolation=T.InterpolationMode(self.interpolation))]
        if self.hflip:
            steps.append(T.RandomHorizontalFlip())
        steps += [T.ToTensor(), T.Normalize(self.mean, self.std)]
        return T.Compose(steps)


_PIL_FILTERS = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC, "nearest": Image.NEAREST,
                "lanczos": Image.LANCZOS}


class _EvalTransform:
    """A picklable callable (DataLoader workers) wrapping ``eval_array``."""

    def __init__(self, pre: Preprocessing) -> None:
        self.pre = pre

    def __call__(self, img: Image.Image):
        import torch

        return torch.from_numpy(self.pre.eval_array(img))

    def __repr__(self) -> str:
        return f"EvalTransform({self.pre})"


class _ToMode:
    def __init__(self, mode: str) -> None:
        self.mode = mode

    def __call__(self, img: Image.Image) -> Image.Image:
        return img if img.mode == self.mode else to_mode(img, self.mode)

    def __repr__(self) -> str:
        return f"ToMode({self.mode!r})"


def timm_preprocessing(backbone: str) -> Preprocessing:
    """From timm's data config: shorter side to ``floor(size / crop_pct)``, centre crop ``size`` (also
    for 'squash'/'border' configs); non-square inputs take the height."""
    from .timm_backbone import timm_data_config     # imports timm: only for timm backbones

    dc = timm_data_config(backbone)
    chans, size = int(dc["input_size"][0]), int(dc["input_size"][1])
    crop_pct = float(dc.get("crop_pct") or 1.0)
    interp = dc.get("interpolation", "bilinear")
    if interp not in INTERPOLATIONS:
        interp = "bicubic" if interp == "random" else "bilinear"
    return Preprocessing(size, max(size, math.floor(size / crop_pct)), tuple(dc["mean"])[:chans],
                         tuple(dc["std"])[:chans], "RGB" if chans == 3 else "L", interpolation=interp)


def preprocessing_for(backbone: str) -> Preprocessing:
    """The preprocessing a backbone was (pre)trained with (timm's config for ``timm:`` backbones)."""
    if backbone.startswith("timm:"):
        return timm_preprocessing(backbone)
    if backbone in ("resnet18", "resnet34", "resnet50"):
        return Preprocessing(224, 256, IMAGENET_MEAN, IMAGENET_STD, "RGB")
    if backbone in LITE_SIZES:
        size, resize = LITE_SIZES[backbone]
        return Preprocessing(size, resize, TF_MEAN, TF_STD, "RGB")
    if backbone == "small_cnn":
        # Omniglot-size: 105 px characters resized to 32 and centre-cropped to 28; strokes are
        # thin, so training crops keep most of the glyph and flips stay off (mirrored glyphs
        # are different characters in several alphabets).
        return Preprocessing(28, 32, GRAY_MEAN, GRAY_STD, "L", train_scale=(0.6, 1.0), hflip=False)
    raise ValueError(f"unknown backbone {backbone!r}; expected one of "
                     "resnet18, resnet34, resnet50, efficientnet_lite0/1/2, small_cnn, or "
                     "timm:<model name>")
