"""Training configuration: one dataclass, the single source of truth for every option.

Config files (TOML) and ``--set key=value`` overrides are mappings of these fields; the CLI's
``--help`` is generated from them, so a new option only has to be added here.
"""
from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from embedder.cli import UsageError

DATASETS = ("cub", "cars", "sop", "omniglot", "folder")
#: Loss and sampler flavours (training/losses.py): the DAS authors' framework, or PML's conventions.
LOSS_FLAVOURS = ("authors", "pml")
#: Named bundles of DAS options (`das_preset`). "paper" is the spec's defaults (T 3, K 4, Z 10,
#: r_s = r_b = 0.01, detached copies, no aux loss): exactly TrainConfig's own defaults. "robust"
#: is the authors' own SOP triplet recipe (DFS factors U[0.5, 2], r_b 0.1, aux loss) with
#: gradients through the copies (as their SOP runs of five of the seven losses) and without an
#: anchor's own copies as its positives: chosen on validation classes, see docs/benchmarks/training-das.md
#: ("Why DAS lost"). A preset is expanded when a config is loaded (files, --set,
#: load_config/config_from_mapping); keys given explicitly next to it win.
DAS_PRESETS: dict[str, dict[str, Any]] = {
    "paper": {},
    "robust": {"das_scale_bounds": [0.5, 2.0], "das_shift_scale": 0.1, "das_aux_loss": True,
               "das_detach": False, "das_exclude_own_copies": True},
}
#: Per-loss refinements of a preset, chosen on validation classes like the preset itself.
#: Contrastive pulls every positive pair to distance 0: copies that pass gradients back to their
#: source pull a class together a second time, so there they are detached (fixed targets).
#: Omniglot validation: +1.14 R@1 detached vs -0.01; held-out alphabets: -0.47 vs -0.79
#: (10 seeds; docs/benchmarks/training-das.md, "DAS fidelity").
DAS_PRESET_LOSSES: dict[str, dict[str, dict[str, Any]]] = {
    "robust": {"contrastive": {"das_detach": True}},
}
AMP_MODES = ("auto", "off", "bf16", "fp16")
HEAD_INITS = ("random", "pca")
HEAD_INPUTS = ("raw", "l2")
#: The dtypes DAS may store its transformation bank in (`das_bank_dtype`; `getattr(torch, name)`
#: is the dtype, and das.DAS accepts exactly these). Strings, so config.py does not import torch.
BANK_DTYPES = ("float32", "float16", "bfloat16")


class ConfigError(UsageError):
    """A config file or override that does not describe a valid TrainConfig: a usage error
    (``python -m training`` exits 2), and a ValueError for library callers."""


_LAST = re.compile(r"^last:(\d+)$")


def parse_trainable(value: str) -> tuple[str, int]:
    """``"all"`` -> ("all", 0), ``"head"`` -> ("head", 0), ``"last:N"`` -> ("last", N);
    anything else raises ValueError with the accepted forms."""
    if value in ("all", "head"):
        return value, 0
    m = _LAST.match(value or "")
    if m and int(m.group(1)) >= 1:
        return "last", int(m.group(1))
    raise ValueError(f"trainable={value!r}: expected 'all', 'head' or 'last:N' (N >= 1 backbone "
                     f"stages, or transformer blocks of a ViT)")


@dataclass
class TrainConfig:
    """Everything a training run needs. Defaults follow the paper's recipe (supp. C)."""

    # --- data ---
    dataset: str = "cub"  # cub | cars | sop | omniglot | folder
    root: str = ""  # dataset root folder (layout depends on `dataset`)
    max_classes: int = 0  # use only the first N classes of each split (0 = all)
    test_classes: list[str] = field(default_factory=list)  # folder: explicit test classes
    test_images: float = 0.0  # folder: this share of every class's photos tests, the rest trains: all classes train (0 = split by classes)
    holdout_alphabets: int = 10  # omniglot without images_evaluation/: last N alphabets test
    cache_images: bool = False  # keep decoded images in memory (small datasets; workers = 0 only: each epoch's fresh workers start empty)
    workers: int = 0  # DataLoader worker processes
    # Decode every image once into device memory and crop / flip / normalise batches there
    # (training/device_batches.py): for a GPU that outruns the decoders; one process only.
    device_batches: bool = False
    # --- model ---
    backbone: str = "resnet50"  # resnet18|34|50|efficientnet_lite0|1|2|small_cnn|timm:<model name>
    dim: int = 128  # embedding dimension (0 = no embedding layer: the pooled features, L2-normalised)
    pooling: str = "avg"  # avg | avgmax | gem | mean | model (CNNs); cls | mean | gem | model (ViTs)
    gem_p: float = 3.0  # GeM exponent (pooling = "gem")
    pretrained: bool = True  # pretrained weights (timm: from timm's source, the Hugging Face hub)
    weights: str = ""  # timm backbones: local weights file (.safetensors/.pth/.bin, state dict or checkpoint); wins over pretrained
    frozen_bn: bool = False  # keep BatchNorm statistics and affine params fixed
    sync_bn: bool = True  # DDP on CUDA: BatchNorm statistics over the global batch
    input_size: int = 0  # network input size in px (0 = the backbone's default)
    resize: int = 0  # eval: shorter side before the centre crop (0 = keep the backbone ratio)
    # A second backbone, trained first by the same recipe into <out>/<its name>/ and exported in
    # front of this one in one file, <out>/two.onnx (training/runs.py): the two-backbone default.
    concat: str = ""  # second backbone, e.g. efficientnet_lite0 ("" = train one backbone)
    # --- fine-tuning (training/stages.py, training/trunk_cache.py) ---
    # Which part trains: "all" (the paper), "last:N" (the last N backbone stages, pooling and
    # head; earlier stages frozen in eval mode), "head" (the embedding layer on frozen features).
    trainable: str = "all"  # all | last:N | head
    backbone_lr: float = 0.0  # Adam lr of the trainable backbone stages (0 = lr); the head uses lr
    # timm backbones: layer-wise lr decay (BEiT; timm's param_groups_layer_decay): the last
    # block (with the final norm) trains at backbone_lr, each earlier one at layer_decay x the next.
    layer_decay: float = 0.0  # 0 = off; e.g. 0.75 (timm backbones only)
    warmup_epochs: int = 0  # linear lr warm-up over the first N epochs (lr x (e+1)/(N+1))
    head_init: str = "random"  # random | pca (top-d principal directions of the training images' pooled features)
    # "l2": L2-normalise the pooled features before the embedding layer, so the head sees what
    # the training-free gallery embedder stores (the frozen-feature benchmark's input).
    head_input: str = "raw"  # raw | l2
    trunk_cache: bool = False  # cache the frozen stages' activations on disk (fp16); epochs run only the trainable stages
    trunk_views: int = 3  # random training crops per image in the trunk cache (plus the centre crop)
    cache_dir: str = ""  # trunk cache folder ("" = <das cache>/trunk_cache)
    # > 0: train on the other training classes and evaluate on the last N training classes,
    # never on the test split: how a recipe's settings are chosen.
    validation_classes: int = 0  # hold out the last N training classes as the evaluation set (0 = use the test split)
    # --- loss / sampler / DAS ---
    loss: str = "triplet"  # contrastive|triplet|margin|lifted|npair|multisimilarity|softmax|arcface|pml:<PML loss class>
    miner: str = "distance"  # random|semihard|softhard|distance|none
    loss_options: dict[str, Any] = field(default_factory=dict)  # extra build_loss overrides
    # "authors": losses and samplers exactly as the DAS authors' training framework computes
    # them (what produced the paper's numbers); "pml": pytorch-metric-learning's conventions.
    loss_flavour: str = "authors"  # authors | pml (see training/losses.py)
    das: bool = True  # densely-anchored sampling on/off
    # A named bundle of the das_* options below (DAS_PRESETS); applied when the config is
    # loaded, explicit keys win. "paper" = the spec's defaults.
    das_preset: str = "paper"  # paper | robust
    das_num_produce: int = 3  # T: produced copies per real embedding
    das_topk: int = 4  # K: channels in the FRM top-K and in the DFS mask
    das_bank_size: int = 10  # Z: memorised differences per class
    das_scale_range: float = 0.01  # r_s: DFS factor drawn from U[1-r_s, 1+r_s]
    das_shift_scale: float = 0.01  # r_b: MTS shift scale
    das_dfs: bool = True  # discriminative feature scaling on/off (ablation)
    das_mts: bool = True  # memorized transformation shifting on/off (ablation)
    das_detach: bool = True  # produced embeddings are constants in the loss
    # [] keeps U[1-r_s, 1+r_s]; [lo, hi] draws DFS factors from U[lo, hi] instead (the authors'
    # SOP scripts use [0.5, 2.0]), so r_s is then unused.
    das_scale_bounds: list[float] = field(default_factory=list)  # [] = use r_s; [lo, hi] = U[lo, hi]
    # The bank (C x Z x d) is the dominant memory at SOP scale; half precision halves it.
    das_bank_dtype: str = "float32"  # MTS bank storage: float32 | float16 | bfloat16
    # The authors' --aux_loss: a loss on the real embeddings alone keeps the model anchored to
    # real data while the produced ones add density. Ignored when DAS is off.
    das_aux_loss: bool = False  # authors' --aux_loss: L(real) + w * L(real + produced)
    das_aux_weight: float = 1.0  # w in das_aux_loss
    # Not in the paper: on Omniglot an anchor's own copies as positives cost ~4 R@1 with
    # triplet [distance] (docs/benchmarks/training-das.md, "Why DAS lost"); off keeps the spec's behaviour.
    das_exclude_own_copies: bool = False  # samplers never draw an anchor's own DAS copies as positives
    # --- optimisation ---
    epochs: int = 300  # training epochs (paper: 300)
    batch_size: int = 112  # global batch (split over ranks in DDP)
    per_class: int = 2  # images per class in a batch
    fit_batch: bool = False  # fewer training classes than batch_size / per_class: a batch holds every class (else an error)
    lr: float = 1e-5  # Adam learning rate of the model
    weight_decay: float = 4e-4  # Adam weight decay
    lr_milestones: list[int] = field(default_factory=list)  # empty = 2/3 and 5/6 of epochs
    lr_gamma: float = 0.3  # lr factor at each milestone
    steps_per_epoch: int = 0  # cap on batches per epoch (0 = one pass over the train split)
    grad_clip: float = 0.0  # max gradient norm (0 = off)
    # --- evaluation / output ---
    eval_every: int = 1  # evaluate on the test split every N epochs (and after the last)
    eval_ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    eval_batch_size: int = 128
    eval_clustering: bool = True  # NMI and F1 (k-means) in each evaluation
    eval_initial: bool = True  # also evaluate the untrained model (epoch 0)
    out: str = "runs/default"  # run directory (checkpoints, logs, report, ONNX)
    resume: bool = False  # continue from <out>/last.pt if it exists
    export_onnx: bool = True  # export best.pt to <out>/model.onnx at the end
    parity_images: int = 8  # test images for the ONNX parity check
    frm_classes: int = 48  # classes shown in the FRM heatmap
    tensorboard: bool = True  # also log to TensorBoard when it is installed
    progress: bool = True  # tqdm progress bars
    # --- runtime ---
    seed: int = 0  # seeds torch/numpy/python, the sampler and DAS
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    amp: str = "auto"  # auto (bf16 on CUDA, off on CPU) | off | bf16 | fp16
    channels_last: bool = True  # channels-last memory format on CUDA
    threads: int = 0  # torch CPU threads (0 = leave torch's default)

    def validate(self) -> "TrainConfig":
        """Reject values that would only fail later, deep inside a run (a bad config file fails
        before any data or model loads)."""
        for names, ok, expected in _RULES:
            for name in names:
                if not ok(getattr(self, name)):
                    raise ConfigError(f"{name}={getattr(self, name)!r}: expected {expected}")
        if self.batch_size % self.per_class:
            raise ConfigError(
                f"batch_size={self.batch_size} is not a multiple of per_class={self.per_class}")
        if self.test_images and (self.dataset != "folder" or self.test_classes or self.validation_classes):
            raise ConfigError(f"test_images={self.test_images} holds out photos of every class of a folder "
                              "dataset: not with " + ("dataset=" + repr(self.dataset) if self.dataset != "folder"
                                                      else "test_classes" if self.test_classes
                                                      else "validation_classes (whole classes)"))
        self._validate_backbone()
        self._validate_finetune()
        self._validate_das()
        return self

    def _validate_backbone(self) -> None:
        """A timm model name timm does not know, or a weights file that is not there, fails
        here in one line, before any data or model loads."""
        if self.backbone.startswith("timm:"):
            from embedder.timm_backbone import check_weights_file, model_name

            try:
                model_name(self.backbone)
                if self.weights:
                    check_weights_file(self.weights)
            except (ValueError, RuntimeError) as e:
                raise ConfigError(str(e)) from None
        elif self.weights:
            raise ConfigError(f"weights={self.weights!r} needs a timm:<model name> backbone "
                              f"({self.backbone!r} loads its own weights with pretrained = true)")
        if self.layer_decay and not self.backbone.startswith("timm:"):
            raise ConfigError(f"layer_decay needs a timm:<model name> backbone (timm's layer "
                              f"groups); {self.backbone!r} has none")
        if self.concat:
            if self.concat == self.backbone:
                raise ConfigError(f"concat={self.concat!r} is the backbone itself: name a second one")
            try:
                mine, theirs = self.preprocessing(), self.preprocessing(self.concat)
            except (ValueError, RuntimeError) as e:
                raise ConfigError(f"concat={self.concat!r}: {e}") from None
            differ = [f.name for f in fields(mine) if getattr(mine, f.name) != getattr(theirs, f.name)]
            if differ:             # one file has one input: both must see the same pixels
                raise ConfigError(f"concat={self.concat!r} prepares images unlike {self.backbone!r} "
                                  f"({', '.join(differ)} differ): one exported file takes one "
                                  "preprocessing (pair backbones of one family; sizes: set input_size)")

    def preprocessing(self, backbone: str = ""):
        """The Preprocessing of ``backbone`` (default: this run's), with the config's input size and
        resize when given: what the run trains and evaluates with and stores with the model."""
        from embedder.preprocess import preprocessing_for

        pre = preprocessing_for(backbone or self.backbone)
        if self.input_size or self.resize:
            return pre.at_size(self.input_size or pre.input_size, self.resize)
        return pre

    def _validate_finetune(self) -> None:
        try:
            kind, _ = parse_trainable(self.trainable)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.device_batches and self.trunk_cache:
            raise ConfigError("device_batches=true feeds images; trunk_cache=true feeds cached "
                              "activations: choose one")
        if self.trunk_cache and kind == "all":
            raise ConfigError("trunk_cache=true needs frozen stages to cache: set trainable to "
                              "'last:N' or 'head'")
        if kind == "head" and self.dim == 0:
            raise ConfigError("trainable='head' with dim=0: there is no embedding layer to train")
        if self.head_init == "pca" and self.dim <= 0:
            raise ConfigError("head_init='pca' needs an embedding layer (dim > 0)")

    def _validate_das(self) -> None:
        bounds = self.das_scale_bounds
        if bounds:
            if len(bounds) != 2:
                raise ConfigError(f"das_scale_bounds={bounds!r}: expected [] or [low, high]")
            lo, hi = bounds
            if not (math.isfinite(lo) and math.isfinite(hi) and 0.0 < lo <= hi):
                raise ConfigError(f"das_scale_bounds={bounds!r}: expected 0 < low <= high "
                                  f"(e.g. [0.5, 2.0])")
        elif not 0.0 <= self.das_scale_range < 1.0:
            raise ConfigError(f"das_scale_range={self.das_scale_range!r}: expected 0 <= r_s < 1")

    @property
    def das_scale_bounds_tuple(self) -> tuple[float, float] | None:
        """`das_scale_bounds` as DAS takes it: None (use r_s) or (low, high)."""
        if not self.das_scale_bounds:
            return None
        lo, hi = self.das_scale_bounds
        return float(lo), float(hi)

    @property
    def miner_name(self) -> str | None:
        return None if self.miner in ("", "none", None) else self.miner

    def milestones(self) -> list[int]:
        """The lr decay epochs: explicit, or the paper's 200/250 of 300 scaled to `epochs`."""
        if self.lr_milestones:
            return sorted(int(m) for m in self.lr_milestones)
        return sorted({max(1, round(self.epochs * 2 / 3)), max(1, round(self.epochs * 5 / 6))})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _one_of(allowed: Any) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v in allowed), f"one of {', '.join(allowed)}"


#: The checks of single options (`TrainConfig.validate`): names, test, what is expected.
_RULES: tuple[tuple[tuple[str, ...], Callable[[Any], bool], str], ...] = (
    *(((name,), *_one_of(allowed)) for name, allowed in (
        ("dataset", DATASETS), ("amp", AMP_MODES), ("das_preset", DAS_PRESETS),
        ("loss_flavour", LOSS_FLAVOURS), ("das_bank_dtype", BANK_DTYPES),
        ("head_init", HEAD_INITS), ("head_input", HEAD_INPUTS))),
    (("epochs", "batch_size", "per_class", "eval_every", "eval_batch_size"), lambda v: v > 0,
     "a positive integer"),
    (("dim",), lambda v: v >= 0, "an integer >= 0 (0 = no embedding layer)"),
    (("lr",), lambda v: v > 0, "a positive number"),
    (("layer_decay",), lambda v: 0.0 <= v <= 1.0, "0 (off) or a factor in (0, 1], e.g. 0.75"),
    (("backbone_lr",), lambda v: v >= 0, ">= 0 (0 = lr)"),
    (("warmup_epochs", "trunk_views", "validation_classes"), lambda v: v >= 0, "an integer >= 0"),
    (("das_shift_scale",), lambda v: v >= 0, ">= 0"),
    (("test_images",), lambda v: 0 <= v < 1, "a share in [0, 1), e.g. 0.2 (0 = split by classes)"),
    (("das_aux_weight",), lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
)


def _field_types() -> dict[str, Any]:
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in fields(TrainConfig)}


def _coerce(name: str, value: Any, where: str) -> Any:
    """Check a value against the field's type; ints are accepted where floats are expected
    (TOML writes 2.0 as 2 easily), in lists too."""
    kind = _field_types()[name]
    origin = typing.get_origin(kind) or kind
    item = typing.get_args(kind)[0] if origin is list else kind
    accepts = (int, float) if item is float else item

    def fits(v: Any) -> bool:
        return isinstance(v, accepts) and (item is bool or not isinstance(v, bool))

    if origin is list:
        ok = isinstance(value, list) and all(fits(v) for v in value)
    else:
        ok = isinstance(value, dict) if origin is dict else fits(value)
    if not ok:
        expected = getattr(kind, "__name__", None) or str(kind).replace("typing.", "")
        raise ConfigError(f"{where}: {name}={value!r}: expected {expected}")
    if item is float:
        return [float(v) for v in value] if origin is list else float(value)
    return value


def load_toml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a config file, resolving ``include = "base.toml"`` (or a list) relative to it:
    included files merge first, in order, then this file's keys override them."""
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError(f"{path}: include cycle ({' -> '.join(str(p) for p in _seen)})")
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    includes = data.pop("include", [])
    merged: dict[str, Any] = {}
    for inc in [includes] if isinstance(includes, str) else includes:
        merged.update(load_toml(path.parent / inc, _seen + (path,)))
    merged.update(data)
    return merged


def parse_override(item: str) -> tuple[str, Any]:
    """``key=value`` with a TOML value (``lr=1e-4``, ``eval_ks=[1,10]``); bare words are strings."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value")
    key, raw = (s.strip() for s in item.split("=", 1))
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def expand_preset(data: dict[str, Any], where: str = "config") -> dict[str, Any]:
    """`data` with its `das_preset`'s options (and their refinement for its loss) filled in
    under the keys it sets itself."""
    preset = data.get("das_preset", "paper")
    if preset not in DAS_PRESETS:
        raise ConfigError(f"{where}: das_preset={preset!r}: expected one of "
                          f"{', '.join(DAS_PRESETS)}")
    for_loss = DAS_PRESET_LOSSES.get(preset, {}).get(data.get("loss", TrainConfig.loss), {})
    return {**DAS_PRESETS[preset], **for_loss, **data}


def config_from_mapping(data: dict[str, Any], where: str = "config") -> TrainConfig:
    names = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        from difflib import get_close_matches

        meant = [f"{u} -> {m[0]}" for u in unknown for m in [get_close_matches(u, names, n=1)] if m]
        raise ConfigError(f"{where}: unknown option(s) {', '.join(unknown)}; "
                          + (f"did you mean {', '.join(meant)}? " if meant else "")
                          + "see `python -m training --help`")
    data = expand_preset(data, where)
    values = {k: _coerce(k, v, where) for k, v in data.items()}
    return TrainConfig(**values).validate()


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None
                ) -> TrainConfig:
    """A TrainConfig from an optional TOML file plus overrides (``key=value`` strings or a dict)."""
    data: dict[str, Any] = load_toml(path) if path else {}
    where = str(path) if path else "config"
    if isinstance(overrides, dict):
        data.update(overrides)
    else:
        types = _field_types()
        for item in overrides or []:
            key, value = parse_override(item)
            if types.get(key) is str and not isinstance(value, str):
                value = item.split("=", 1)[1].strip()  # `--set root=2024` means the string
            data[key] = value
    return config_from_mapping(data, where)


def replace(cfg: TrainConfig, **changes: Any) -> TrainConfig:
    return dataclasses.replace(cfg, **changes).validate()
