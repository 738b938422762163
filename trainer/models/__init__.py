"""Models used by the trainer (plain torch; torchvision-compatible parameter names and shapes)."""

from __future__ import annotations

from torch import nn

from trainer.model_names import MODEL_CHOICES
from trainer.models.resnet import BasicBlock, Bottleneck, ResNet, resnet18, resnet50, small_resnet

__all__ = ["MODEL_CHOICES", "BasicBlock", "Bottleneck", "ResNet", "build_model", "resnet18", "resnet50",
           "small_resnet"]


def build_model(name: str, num_classes: int, *, width: int = 16,
                zero_init_residual: bool = False) -> nn.Module:
    """The model called ``name`` (one of :data:`MODEL_CHOICES`); ``width`` only for the small ones
    (``small_resnet_cifar``: the 3x3 stride-1 stem for ~32-px images)."""
    if name == "resnet18":
        return resnet18(num_classes, zero_init_residual=zero_init_residual)
    if name == "resnet50":
        return resnet50(num_classes, zero_init_residual=zero_init_residual)
    if name in ("small_resnet", "small_resnet_cifar"):
        return small_resnet(num_classes, width=width, zero_init_residual=zero_init_residual,
                            small_input=name == "small_resnet_cifar")
    raise ValueError(f"model={name!r}; choose one of {', '.join(MODEL_CHOICES)}")
