"""Which parts of the embedder train (``TrainConfig.trainable``): ``"all"`` as the paper, the
``"last:N"`` backbone stages plus pooling and head, or the ``"head"`` on frozen pooled features.
`stage_modules` cuts an EfficientNet, ResNet, ConvNeXt or timm ViT into stem and stages, since timm
cannot run a model from an intermediate layer (``forward_intermediates`` only returns them); other
architectures train ``all`` or ``head``. The frozen prefix runs in eval mode without gradients, a
fixed function of the image (what training/trunk_cache.py caches); both parts share the
Embedder's modules, so checkpoint and ONNX export are the whole network.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .config import parse_trainable

__all__ = ["StageSplit", "split_stages", "stage_modules"]

def stage_modules(backbone: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """(stem modules, [stage, ...]) of a backbone built by `embedder.model.build_backbone`, in
    forward order; each stage is a list-free module (a Sequential where it has several parts)."""
    net = getattr(backbone, "net", None)
    stages: list[nn.Module]
    if net is not None and hasattr(net, "blocks") and hasattr(net, "conv_stem"):   # timm EfficientNet
        stages = list(net.blocks)
        stages[-1] = nn.Sequential(stages[-1], net.conv_head, net.bn2)
        return [net.conv_stem, net.bn1], stages
    if net is not None and hasattr(net, "layer4"):                # torchvision / timm ResNet
        act = net.relu if hasattr(net, "relu") else net.act1
        return [net.conv1, net.bn1, act, net.maxpool], [net.layer1, net.layer2, net.layer3,
                                                        net.layer4]
    if net is not None and all(hasattr(net, a) for a in ("stem", "stages", "norm_pre")):  # ConvNeXt
        stages = list(net.stages)
        stages[-1] = nn.Sequential(stages[-1], net.norm_pre)
        return [net.stem], stages
    from timm.models.vision_transformer import VisionTransformer

    if isinstance(net, VisionTransformer):       # DINOv2, CLIP, SigLIP, DeiT, ... (not EVA: RoPE)
        stages = list(net.blocks)
        stages[-1] = nn.Sequential(stages[-1], net.norm)
        return [_VitStem(net)], stages
    raise ValueError(f"trainable='last:N' needs an EfficientNet, ResNet, ConvNeXt or ViT "
                     f"backbone; {type(net or backbone).__name__} has no stages here (use 'all' "
                     f"or 'head')")


class _VitStem(nn.Module):
    """A timm ViT's ``forward_features`` up to its first block: patch embedding, position
    embedding with the class/register tokens, ``norm_pre``."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.patch_embed, self.patch_drop, self.norm_pre = net.patch_embed, net.patch_drop, net.norm_pre
        for name in ("pos_embed", "cls_token", "reg_token"):   # shared with the model: frozen
            if isinstance(getattr(net, name, None), nn.Parameter):   # and in the cache key
                setattr(self, name, getattr(net, name))
        object.__setattr__(self, "_net", net)    # _pos_embed is the model's own method

    def forward(self, x: Tensor) -> Tensor:
        return self.norm_pre(self.patch_drop(self._net._pos_embed(self.patch_embed(x))))


class _Tail(nn.Module):
    """Trainable suffix: the remaining stages, the Embedder's pooling and head."""

    def __init__(self, model: nn.Module, stages: list[nn.Module], pooled_input: bool) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.embedder_head = model.head
        self.pool_params = nn.ParameterList()   # the backbone's own pooling head (split_stages)
        # not registered as a submodule: the Embedder owns these; we only call its methods
        object.__setattr__(self, "_model", model)
        self.pooled_input = pooled_input

    def forward(self, a: Tensor) -> Tensor:
        return self._model.embed(self.pooled(a))

    def pooled(self, a: Tensor) -> Tensor:
        """Pooled features (no head) of prefix activations: what a PCA head is fitted on."""
        if self.pooled_input:
            return a
        for s in self.stages:
            a = s(a)
        return self._model.pool(a)

    def train(self, mode: bool = True) -> "_Tail":
        super().train(mode)
        if mode and self._model.frozen_bn:
            for m in self.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()
        return self


class _Prefix(nn.Module):
    """Frozen prefix: image -> activations (or pooled features), always eval, never grad."""

    def __init__(self, model: nn.Module, modules: list[nn.Module], pooled_output: bool) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)
        object.__setattr__(self, "_model", model)
        self.pooled_output = pooled_output

    @torch.no_grad()
    def forward(self, x: Tensor) -> Tensor:
        if self.pooled_output:
            return self._model.features(x)
        for m in self.parts:
            x = m(x)
        return x

    def train(self, mode: bool = True) -> "_Prefix":
        return super().train(False)


class _Staged(nn.Module):
    """prefix then suffix, the network a step runs when images (not cached activations) come in."""

    def __init__(self, prefix: _Prefix, suffix: _Tail) -> None:
        super().__init__()
        self.prefix, self.suffix = prefix, suffix

    def forward(self, x: Tensor) -> Tensor:
        return self.suffix(self.prefix(x))


@dataclass
class StageSplit:
    """The embedder cut at the frozen/trainable boundary (``trainable != "all"``)."""

    trainable: str
    prefix: _Prefix                 # frozen: images -> activations / pooled features
    suffix: _Tail                   # trainable: activations -> embeddings
    backbone_params: list[nn.Parameter]   # trainable backbone parameters (backbone_lr)
    head_params: list[nn.Parameter]       # the embedding layer (lr)

    @property
    def network(self) -> nn.Module:
        """The whole network as a step runs it on images (prefix without gradients)."""
        return _Staged(self.prefix, self.suffix)


def split_stages(model: nn.Module, trainable: str) -> StageSplit | None:
    """Freeze everything before the trainable part (``requires_grad = False``, eval mode) and
    return the split, or None for ``"all"`` (nothing frozen; the caller runs `model` itself)."""
    kind, n = parse_trainable(trainable)
    if kind == "all":
        return None
    head_params = list(model.head.parameters())
    if kind == "head":
        prefix = _Prefix(model, [model.backbone], pooled_output=True)
        suffix = _Tail(model, [], pooled_input=True)
    else:
        stem, stages = stage_modules(model.backbone)
        if n > len(stages):
            raise ValueError(f"trainable={trainable!r}: {model.config.backbone} has "
                             f"{len(stages)} stages (use 'all' to train the stem too)")
        prefix = _Prefix(model, stem + stages[:-n], pooled_output=False)
        suffix = _Tail(model, stages[-n:], pooled_input=False)
    prefix.requires_grad_(False).eval()
    head_ids = {id(p) for p in head_params}
    backbone_params = [p for p in suffix.parameters() if p.requires_grad and id(p) not in head_ids]
    # The backbone's own pooling head (pooling = "model": a ViT's fc_norm / attention pool,
    # ConvNeXt's head norm) sits after the last stage: it trains with it; unused otherwise.
    placed = {id(p) for p in prefix.parameters()} | {id(p) for p in suffix.parameters()}
    rest = [p for p in model.backbone.parameters() if id(p) not in placed]
    for p in rest:
        if model.config.pooling == "model" and kind == "last":
            backbone_params.append(p)
            suffix.pool_params.append(p)
        else:
            p.requires_grad_(False)
    return StageSplit(trainable, prefix, suffix, backbone_params, head_params)
