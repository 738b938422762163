"""The model names the trainer knows, in a module without torch, so that the configuration (and with it
``datacache-train --help`` and every usage error) is checked before torch is imported."""

from __future__ import annotations

MODEL_CHOICES = ("resnet18", "resnet50", "small_resnet", "small_resnet_cifar")
