"""ResNet-18 / ResNet-50 in plain torch (torchvision is unavailable on these machines).

Parameter names and shapes match torchvision's ``resnet18`` / ``resnet50`` (ResNet v1.5:
the stride-2 of a bottleneck sits on its 3x3 convolution), so a torchvision state dict
loads unchanged. ResNet-50 has 161 parameter tensors and 25,557,032 parameters.

:func:`small_resnet` is the same network narrowed (``width`` channels in the first stage instead
of 64, one block per stage), for CPU runs (the CPU training benchmark at 64 px); with
``small_input=True`` its stem is CIFAR-style (one 3x3 convolution of stride 1, no max-pool), for
images of ~32 px (the digits run).

``zero_init_residual=True`` zero-initialises the last BatchNorm gamma of every residual
block (Goyal et al., "Accurate, Large Minibatch SGD"), so each block starts as identity.
The network uses no ``view``/``reshape`` on 4-D activations, so it runs unchanged in
``channels_last`` memory format (``model.to(memory_format=torch.channels_last)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet50", "small_resnet"]


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with an identity (or 1x1 projection) shortcut (ResNet-18/34)."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = _conv3x3(cin, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (carries the stride, v1.5) -> 1x1 expand, with shortcut (ResNet-50+)."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = _conv1x1(cin, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, width * self.expansion)
        self.bn3 = nn.BatchNorm2d(width * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ImageNet-style ResNet: 7x7 stem, max-pool, four stages, global average pool, linear head."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: Sequence[int],
        num_classes: int = 1000,
        zero_init_residual: bool = False,
        widths: Sequence[int] = (64, 128, 256, 512),
        small_input: bool = False,
    ) -> None:
        super().__init__()
        if len(layers) != 4 or any(n < 1 for n in layers):
            raise ValueError(f"layers must be four positive block counts, got {list(layers)}")
        if len(widths) != 4 or any(int(w) < 1 for w in widths):
            raise ValueError(f"widths must be four positive channel counts, got {list(widths)}")
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        self.inplanes = int(widths[0])
        if small_input:  # CIFAR-style stem: keep the resolution of small images
            self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=3, stride=1, padding=1, bias=False)
            self.maxpool: nn.Module = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._make_stage(block, int(widths[0]), layers[0], stride=1)
        self.layer2 = self._make_stage(block, int(widths[1]), layers[1], stride=2)
        self.layer3 = self._make_stage(block, int(widths[2]), layers[2], stride=2)
        self.layer4 = self._make_stage(block, int(widths[3]), layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(int(widths[3]) * block.expansion, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(m.last_bn().weight)

    def _make_stage(self, block: type[BasicBlock] | type[Bottleneck], width: int, blocks: int,
                    stride: int) -> nn.Sequential:
        downsample: nn.Module | None = None
        if stride != 1 or self.inplanes != width * block.expansion:
            downsample = nn.Sequential(
                _conv1x1(self.inplanes, width * block.expansion, stride),
                nn.BatchNorm2d(width * block.expansion),
            )
        stage = [block(self.inplanes, width, stride, downsample)]
        self.inplanes = width * block.expansion
        stage += [block(self.inplanes, width) for _ in range(1, blocks)]
        return nn.Sequential(*stage)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        # flatten of an [N, C, 1, 1] tensor is layout-agnostic (safe in channels_last)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000, zero_init_residual: bool = False) -> ResNet:
    """ResNet-18 (11,689,512 parameters with 1000 classes, 62 parameter tensors)."""
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes=num_classes, zero_init_residual=zero_init_residual)


def resnet50(num_classes: int = 1000, zero_init_residual: bool = False) -> ResNet:
    """ResNet-50 v1.5 (25,557,032 parameters with 1000 classes, 161 parameter tensors)."""
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes=num_classes, zero_init_residual=zero_init_residual)


def small_resnet(num_classes: int = 1000, width: int = 16, zero_init_residual: bool = False,
                 small_input: bool = False) -> ResNet:
    """A narrow ResNet for CPU runs: BasicBlocks ``(1, 1, 1, 1)``, widths ``width x (1, 2, 4, 8)``,
    the ImageNet stem (7x7 stride 2 + max-pool), or with ``small_input`` a 3x3 stride-1 stem and no
    max-pool (``width=16``, 10 classes: 310,746 / 308,826 parameters)."""
    return ResNet(BasicBlock, (1, 1, 1, 1), num_classes=num_classes, zero_init_residual=zero_init_residual,
                  widths=tuple(width * m for m in (1, 2, 4, 8)), small_input=small_input)
