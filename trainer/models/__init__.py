"""Models used by the trainer (plain torch; torchvision-compatible parameter names and shapes)."""

from trainer.models.resnet import BasicBlock, Bottleneck, ResNet, resnet18, resnet50

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet50"]
