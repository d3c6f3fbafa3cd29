"""int8 embedders: onnxruntime static quantisation (QDQ) of an exported embedder.

Why: onnxruntime runs int8 convolutions about twice as fast as fp32 on AVX2/VNNI CPUs, and
indexing is almost all convolution. The recipe (:class:`QuantRecipe`, measured in
docs/benchmarks/embedder.md): only ``Conv``, ``Clip`` (ReLU6) and ``Add`` quantised, not the stem
conv; GeM, mean and L2 stay float; 7-bit weights. The embedder's metadata is carried over (plus
``quantization``), so consumers read int8 like fp32; a cosine to fp32 too low is refused.
A timm backbone (a ViT, ConvNeXt) is MatMul, which that recipe leaves float: it gets onnxruntime's
dynamic quantisation of MatMul/Gemm instead (:func:`quantize_matmuls`).
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .errors import ModelLoadError
from .files import atomic_target
from .folders import walk_gallery
from .hashing import file_sha256
from .images import IMAGE_SUFFIXES, ImageLoadError
from .quant_graph import QUANTIZED_OPS, conv_input_means, correct_biases, float_node_names

DEFAULT_IMAGES = 256
METHODS = ("minmax", "entropy", "percentile")
FLOAT_NODES = ("none", "stem", "head", "stem+head", "stem+adds", "full-res")
#: a quantised model whose mean cosine to fp32 on calibration images is below this is broken
#: (measured: 0.99+ for EfficientNet-Lite with the recipe above, 0.75 without Clip)
MIN_MEAN_COSINE = 0.95
#: images per onnxruntime run while calibrating and checking: onnxruntime's calibration session
#: (graph optimisations off, a ReduceMin/Max on every tensor) holds ~125 MB an image of each Lite
#: network's activations, so 16 at a time made the two-backbone default's first `indexer build`
#: peak at 5.2 GB (1.9 GB at 2; min/max ranges do not depend on the grouping)
CALIBRATION_BATCH = 2
QUANT_FORMAT = "qdq-u8s8-per-channel-float-stem"
#: a transformer's int8 (:func:`quantize_matmuls`)
DYNAMIC_OPS = ("MatMul", "Gemm")
DYNAMIC_FORMAT = "dynamic-s8-per-channel-matmul"


class QuantizationError(ValueError):
    """The calibration images or the quantised model are unusable (one-line message)."""


@dataclass(frozen=True)
class QuantRecipe:
    """How a model is quantised; ``float_nodes``: ``stem`` (:func:`input_convs`), ``head``
    (:func:`head_nodes`), both, ``stem+adds``, ``full-res`` (:func:`full_res_nodes`) or none."""

    method: str = "minmax"
    per_channel: bool = True
    float_nodes: str = "stem"
    images: int = DEFAULT_IMAGES
    percentile: float = 99.999
    #: 7-bit weights: on CPUs without VNNI (AVX2 only) onnxruntime's U8S8 kernels multiply with
    #: VPMADDUBSW, whose int16 sums saturate with full-range weights (onnxruntime's docs)
    reduce_range: bool = False
    #: each int8 conv's bias absorbs its rounded weights' mean output shift (:func:`correct_biases`)
    bias_correction: bool = False
    #: bias correction only where the model without it misses the int8/fp32 check (not in ``tag``:
    #: it changes no model the check passes, so cached ones stay valid)
    correct_when_off: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise QuantizationError(f"calibration method {self.method!r}: expected one of {', '.join(METHODS)}")
        if self.float_nodes not in FLOAT_NODES:
            raise QuantizationError(f"float nodes {self.float_nodes!r}: expected one of {', '.join(FLOAT_NODES)}")
        if self.images < 1:
            raise QuantizationError(f"calibration image count must be >= 1, got {self.images}")

    @property
    def tag(self) -> str:
        """Short name (benchmark rows, cache keys): ``minmax-pc-stem-256``."""
        m = self.method if self.method != "percentile" else f"pct{self.percentile:g}"
        return (f"{m}-{'pc' if self.per_channel else 'pt'}-{self.float_nodes}-{self.images}"
                + ("-rr" if self.reduce_range else "") + ("-bc" if self.bias_correction else ""))


#: the recipe `embedder quantize` and `indexer build --int8` use (issue 41, chosen on cub-val:
#: docs/benchmarks/quality-round5.md): min/max, per-channel, stem float, 256 images, and 7-bit
#: weights: on the project's AVX2 CPU full-range weights lost 1.0-1.4 R@1 and ~2 MAP@R to fp32
#: (Lite1; Lite0+Lite1) where reduce_range lost 1.3 / 0.27 R@1 and 0.65 / 0.35 MAP@R. Bias
#: correction brings int8 closer to fp32 (Lite1 cub-val cosine 0.983 -> 0.996) but not the
#: default's R@1 with DBA on validation (93.58 -> 92.97): measured, not chosen (quality-round5.md),
#: except where the int8 model misses the check: line drawings (Omniglot, mean cosine to fp32 0.928
#: two-backbone, 0.942 Lite1; corrected 0.993 / 0.996) stopped `indexer build` at its default
DEFAULT_RECIPE = QuantRecipe(reduce_range=True, correct_when_off=True)

#: CPU flags (Linux's names) of the int8 dot-product instructions onnxruntime's int8 kernels use.
#: With one, the default int8 network runs ~2.1-2.2x its fp32 (Intel Xeon, AMD EPYC Zen 4), so
#: an int8 two-backbone embedder builds faster than Lite1 in fp32; with AVX2 alone ~1.3x, and it
#: does not (docs/benchmarks/quality-round5.md#default-switched-by-cpu). ARM's dot product: not measured.
INT8_DOT_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")


def int8_dot_product(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> str | None:
    """The first of :data:`INT8_DOT_FLAGS` this CPU has (None: none, or no ``/proc/cpuinfo``)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return None
    flags = set(line.partition(":")[2].split())
    return next((f for f in INT8_DOT_FLAGS if f in flags), None)


@dataclass
class QuantizeReport:
    """What :func:`quantize_embedder` did: the file, the calibration images, the int8/fp32 check."""

    out: Path
    calibration_images: int         # dynamic: 0 (its check's images are ``checked``)
    skipped: list[tuple[str, str]]
    mean_cosine: float
    min_cosine: float
    checked: int = 0


def calibration_files(folder: str | os.PathLike, n: int = DEFAULT_IMAGES) -> list[Path]:
    """Up to ``n`` image files of ``folder`` (recursive), spread evenly over its sorted file list,
    so every sub-folder (class) of a gallery contributes; deterministic."""
    root = Path(folder)
    if not root.is_dir():
        raise QuantizationError(f"{root}: calibration folder not found (expected a folder of images)")
    if n < 1:
        raise QuantizationError(f"calibration image count must be >= 1, got {n}")
    # the gallery's walk (linked class folders followed once, hidden entries left out), sorted
    files = sorted(f.abspath for f in walk_gallery(root)
                   if f.problem is None and f.abspath.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise QuantizationError(f"{root}: no images (expected files ending in "
                                f"{', '.join(sorted(IMAGE_SUFFIXES))})")
    return spread(files, n)


def spread(files: Sequence[Path], n: int) -> list[Path]:
    """Up to ``n`` of the sorted ``files``, evenly spaced: the build's calibration choice."""
    step = len(files) / min(n, len(files))
    return [files[int(i * step)] for i in range(min(n, len(files)))]


def int8_by_default(backbone: str) -> bool:
    """Whether `indexer build` quantises an embedder of this backbone unasked, and by the static
    recipe: this project's own backbones (EfficientNet-Lite, ResNet, small_cnn, and pairs of them)
    are convolutional, and their int8 was measured on retrieval. A timm one (``timm:NAME``, a ViT
    say) gets :func:`quantize_matmuls`, only when asked: its speed is measured, its effect on a
    pretrained ViT's retrieval is not (no such weights offline here)."""
    from .timm_backbone import is_timm

    return not any(is_timm(part) for part in backbone.split("+"))


def is_quantized(meta: dict[str, str]) -> bool:
    return "quantization" in meta


def _batches(embedder: Any, files: Sequence[Path], batch_size: int, skipped: list[tuple[str, str]],
             progress: bool) -> Iterator[np.ndarray]:
    """Preprocessed (N, C, H, W) batches of ``files``; unreadable ones recorded in ``skipped``."""
    from tqdm.auto import tqdm

    batch: list[np.ndarray] = []
    with tqdm(total=len(files), desc="calibrating", unit="img", disable=not progress) as bar:
        for f in files:
            try:
                batch.append(embedder.prepare(f))
            except ImageLoadError as e:
                skipped.append((str(f), e.reason))
            bar.update(1)
            if len(batch) == batch_size:
                yield np.stack(batch)
                batch = []
        if batch:
            yield np.stack(batch)


class _Reader:
    """onnxruntime's CalibrationDataReader over preprocessed batches, one batch per
    ``collect_data`` call (``set_range``), so histogram calibrators never hold every batch."""

    def __init__(self, input_name: str, batches: list[np.ndarray]) -> None:
        self.input_name, self.batches = input_name, batches
        self.pos, self.end = 0, len(batches)

    def __len__(self) -> int:
        return len(self.batches)

    def set_range(self, start_index: int, end_index: int) -> None:
        self.pos, self.end = start_index, min(end_index, len(self.batches))

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.pos >= self.end:
            return None
        self.pos += 1
        return {self.input_name: self.batches[self.pos - 1]}


def quantize_embedder(model: str | os.PathLike, calibration: str | os.PathLike | Sequence[Path],
                      out: str | os.PathLike, *, images: int | None = None, batch_size: int = CALIBRATION_BATCH,
                      progress: bool = False, check_images: int = 32,
                      log: Callable[[str], None] | None = None,
                      recipe: QuantRecipe = DEFAULT_RECIPE) -> QuantizeReport:
    """Write the int8 version of ``model`` to ``out`` (only after the int8/fp32 check), calibrated on
    a folder (up to ``images`` spread over it) or a list of files (corrupt ones skipped); a timm
    backbone's by :func:`quantize_matmuls`, ``check_images`` of those files checking it."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from .runtime import OnnxEmbedder, write_metadata

    model, out = Path(model), Path(out)
    fp32 = OnnxEmbedder(model, device="cpu", batch_size=batch_size)   # ModelLoadError if not ours
    if is_quantized(fp32.metadata):
        raise ModelLoadError(model, "already quantised (metadata 'quantization'); quantise the fp32 export")
    dynamic = not int8_by_default(fp32.metadata.get("backbone", ""))
    files = (list(calibration) if isinstance(calibration, (list, tuple))
             else calibration_files(calibration, images or recipe.images))
    if not files:
        raise QuantizationError("no calibration images given")
    if dynamic:                  # nothing to calibrate: images for the int8/fp32 check only
        files = spread(files, check_images)
    skipped: list[tuple[str, str]] = []
    batches = list(_batches(fp32, files, batch_size, skipped, progress))
    if not batches:   # before onnxruntime sees an empty reader
        raise QuantizationError(f"none of the {len(files)} calibration images could be read "
                                f"(first: {skipped[0][0]}: {skipped[0][1]})")
    seen = sum(len(b) for b in batches)
    if dynamic:
        mean_cos, min_cos = quantize_matmuls(fp32, model, out, np.concatenate(batches), batch_size)
        return QuantizeReport(out, 0, skipped, mean_cos, min_cos, checked=seen)
    reader = _Reader(fp32.input_name, batches)
    method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
              "percentile": CalibrationMethod.Percentile}[recipe.method]
    # histograms are merged one batch at a time (quantize_static's strided calibration) instead
    # of holding every batch's activations (GBs at 256 photos); min/max reads all batches at once
    extra: dict[str, Any] = {} if recipe.method == "minmax" else {"CalibStridedMinMax": 1}
    if recipe.method == "percentile":
        extra["CalibPercentile"] = recipe.percentile
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="das-quantize-") as tmp:
        pre = Path(tmp) / "pre.onnx"
        # symbolic shape inference trips over the Expand of the L2 normalisation; onnx's own
        # shape inference is enough for Conv/Clip/Add
        quant_pre_process(str(model), str(pre), skip_symbolic_shape=True)
        pre_proto = onnx.load(str(pre))
        floats = float_node_names(pre_proto, recipe.float_nodes)
        with atomic_target(out, suffix=".onnx") as tmp_out:
            quantize_static(str(pre), tmp_out, reader, quant_format=QuantFormat.QDQ,
                            per_channel=recipe.per_channel, reduce_range=recipe.reduce_range,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            op_types_to_quantize=list(QUANTIZED_OPS), nodes_to_exclude=floats,
                            calibrate_method=method, extra_options=extra)
            calibrated = onnx.load(tmp_out)
            first = np.concatenate(batches[:-(-check_images // batch_size)])[:check_images]   # not a copy of all
            tries = [True] if recipe.bias_correction else [False, True] if recipe.correct_when_off else [False]
            for corrected in tries:
                proto = onnx.ModelProto()
                proto.CopyFrom(calibrated)
                if corrected:
                    convs = [n for n in pre_proto.graph.node if n.op_type == "Conv" and n.name not in floats]
                    means = conv_input_means(pre_proto, sorted({n.input[0] for n in convs}),
                                             fp32.input_name, batches)
                    correct_biases(proto, pre_proto, means)
                write_metadata(proto, {**fp32.metadata, "quantization": json.dumps({
                    "format": QUANT_FORMAT, "ops": list(QUANTIZED_OPS), "float_nodes": floats,
                    "float_policy": recipe.float_nodes, "per_channel": recipe.per_channel,
                    "reduce_range": recipe.reduce_range, "bias_correction": corrected,
                    "calibration": recipe.method, **({"percentile": recipe.percentile}
                                                     if recipe.method == "percentile" else {}),
                    "calibration_images": seen, "fp32_sha256": fp32.model_hash})})
                onnx.save(proto, tmp_out)
                mean_cos, min_cos = _check(fp32, tmp_out, first, batch_size)
                if mean_cos >= MIN_MEAN_COSINE:
                    break
                if log is not None and corrected != tries[-1]:
                    log(f"int8: mean cosine to fp32 {mean_cos:.3f} on calibration images (expected >= "
                        f"{MIN_MEAN_COSINE}); correcting the int8 convolutions' biases")
            else:
                raise QuantizationError(
                    f"{model}: the int8 model's embeddings differ from fp32 (mean cosine "
                    f"{mean_cos:.3f} on calibration images, expected >= {MIN_MEAN_COSINE}"
                    f"{', bias-corrected' if tries[-1] else ''}); not written")
    report = QuantizeReport(out, seen, skipped, mean_cos, min_cos)
    if log is not None:
        for path, why in skipped:
            log(f"skipped {path}: {why}")
    return report


def quantize_matmuls(fp32: Any, model: Path, out: Path, x: np.ndarray, batch: int) -> tuple[float, float]:
    """Write the int8 version of a transformer embedder: MatMul/Gemm weights int8 per output
    channel, activations quantised per call at run time (onnxruntime's dynamic quantisation: no
    calibration, so no fixed ranges to miss a ViT's outlier activations; a scale per tensor of
    the call, so an image's embedding moves a little with its batch-mates: cosine 0.9999 to fp32
    on a trained ViT-Tiny, docs/benchmarks/embedder.md); other ops float. Written
    only when its embeddings of ``x`` (preprocessed images) keep a mean cosine to fp32 >=
    :data:`MIN_MEAN_COSINE`; returns (mean, min). Measured (ViT-S/14, 2 Zen 4 cores, VNNI): the
    network 1.95-2.10x, `indexer build` 2.16-2.25x (docs/benchmarks/embedder.md)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from .runtime import write_metadata

    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_target(out, suffix=".onnx") as tmp_out:
        quantize_dynamic(str(model), tmp_out, op_types_to_quantize=list(DYNAMIC_OPS), per_channel=True,
                         weight_type=QuantType.QInt8)
        proto = onnx.load(tmp_out)
        write_metadata(proto, {**fp32.metadata, "quantization": json.dumps({
            "format": DYNAMIC_FORMAT, "ops": list(DYNAMIC_OPS), "per_channel": True,
            "calibration": "none (dynamic)", "check_images": len(x), "fp32_sha256": fp32.model_hash})})
        onnx.save(proto, tmp_out)
        mean_cos, min_cos = _check(fp32, tmp_out, x, batch)
        if mean_cos < MIN_MEAN_COSINE:
            raise QuantizationError(f"{model}: the int8 model's embeddings differ from fp32 (mean cosine "
                                    f"{mean_cos:.3f} on {len(x)} images, expected >= {MIN_MEAN_COSINE}); not written")
    return mean_cos, min_cos


def _check(fp32: Any, int8_path: str, x: np.ndarray, batch: int) -> tuple[float, float]:
    """(mean, min) cosine between fp32 and int8 embeddings of the same preprocessed images."""
    from .runtime import load_session

    sess = load_session(int8_path)
    a, b = (np.concatenate([s.run(None, {fp32.input_name: x[i:i + batch]})[0] for i in range(0, len(x), batch)])
            for s in (fp32.session, sess))
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12)
    return float(cos.mean()), float(cos.min())


def int8_model_path(model: str | os.PathLike, calibration: str | os.PathLike, *,
                    images: int = DEFAULT_IMAGES, progress: bool = False,
                    log: Callable[[str], None] | None = None) -> Path:
    """The int8 version of ``model`` made once into ``$DAS_CACHE/int8/``, named by the fp32 model's
    hash, the calibration files and the recipe, so a resumed build gets the same model; ``log``:
    :func:`quantize_embedder`'s lines."""
    from .pretrained import cache_dir, made_once
    from .runtime import read_metadata

    model = Path(model)
    if is_quantized(read_metadata(model)):
        return model
    files = calibration_files(calibration, images)
    root = Path(calibration)
    listing = "\n".join(f"{f.relative_to(root).as_posix()}\t{f.stat().st_size}" for f in files)
    import hashlib

    recipe = "" if DEFAULT_RECIPE.tag == "minmax-pc-stem-256" else f"\n{DEFAULT_RECIPE.tag}"
    key = hashlib.sha256(f"{file_sha256(model)}\n{listing}{recipe}".encode()).hexdigest()[:16]
    return made_once(cache_dir() / "int8" / f"{model.stem}-int8-{key}.onnx",
                     lambda out: quantize_embedder(model, files, out, progress=progress, log=log))
