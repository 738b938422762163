"""ResNet-18/50: torchvision-compatible parameter counts/names, shapes, backward, options."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from trainer.models import Bottleneck, ResNet, resnet18, resnet50


@pytest.fixture(scope="module")
def r50() -> ResNet:
    torch.manual_seed(0)
    return resnet50(zero_init_residual=True)   # shapes are those of the default model


@pytest.fixture(scope="module")
def r18() -> ResNet:
    torch.manual_seed(0)
    return resnet18()


def test_parameter_counts_match_torchvision(r18: ResNet, r50: ResNet) -> None:
    for model, n_tensors, n_params in ((r18, 62, 11_689_512), (r50, 161, 25_557_032)):
        params = list(model.parameters())
        assert len(params) == n_tensors
        assert sum(p.numel() for p in params) == n_params


def test_resnet50_names_and_shapes_like_torchvision(r50: ResNet) -> None:
    shapes = {k: tuple(v.shape) for k, v in r50.state_dict().items()}
    assert shapes["conv1.weight"] == (64, 3, 7, 7)
    assert shapes["layer1.0.downsample.0.weight"] == (256, 64, 1, 1)
    assert shapes["layer2.0.conv2.weight"] == (128, 128, 3, 3)   # v1.5: the stride sits on the 3x3
    assert shapes["layer4.2.bn3.running_var"] == (2048,)
    assert shapes["fc.weight"] == (1000, 2048)
    assert r50.layer2[0].conv2.stride == (2, 2) and r50.layer2[0].conv1.stride == (1, 1)
    assert sum(k.endswith("num_batches_tracked") for k in shapes) == 53


@pytest.mark.parametrize("name", ["r18", "r50"])
def test_forward_backward_tiny_input(name: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(name)
    model.train()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    out = model(x)
    assert out.shape == (2, 1000) and torch.isfinite(out).all()
    model.zero_grad()
    nn.functional.cross_entropy(out, torch.tensor([1, 7])).backward()
    bad = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not bad
    assert model.fc.weight.grad.abs().sum() > 0


def test_zero_init_residual_makes_blocks_identity_at_init(r50: ResNet, r18: ResNet) -> None:
    model = r50  # built with zero_init_residual=True (no optimizer step touches it in this file)
    blocks = [m for m in model.modules() if isinstance(m, Bottleneck)]
    assert len(blocks) == 16 and all(torch.all(b.bn3.weight == 0) for b in blocks)
    assert all(torch.all(b.bn1.weight == 1) for b in blocks)
    # a block without downsample is relu(x + 0) == x for x >= 0 (eval-mode BN, zero beta)
    block = model.layer1[1].eval()
    x = torch.rand(1, 256, 8, 8)
    assert_close(block(x), x)
    assert all(torch.all(b.bn2.weight == 1) for b in (r18.layer1[0], r18.layer4[1]))  # default: off


def test_channels_last_gives_same_output(r18: ResNet) -> None:
    model = r18.eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    ref = model(x)
    cl_model = resnet18()
    cl_model.load_state_dict(model.state_dict())
    cl_model = cl_model.eval().to(memory_format=torch.channels_last)
    assert cl_model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    out = cl_model(x.to(memory_format=torch.channels_last))
    assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_bad_config_errors() -> None:
    with pytest.raises(ValueError, match="four positive"):
        ResNet(Bottleneck, (3, 4, 6))
    with pytest.raises(ValueError, match="num_classes"):
        resnet18(num_classes=0)


def test_small_resnet_and_build_model() -> None:
    from trainer.models import MODEL_CHOICES, build_model, small_resnet

    torch.manual_seed(0)
    assert sum(p.numel() for p in small_resnet(10, width=16).parameters()) == 310_746  # ImageNet stem
    assert isinstance(small_resnet(10).maxpool, nn.MaxPool2d)
    m = small_resnet(10, width=16, small_input=True)
    assert sum(p.numel() for p in m.parameters()) == 308_826
    assert tuple(m.conv1.weight.shape) == (16, 3, 3, 3) and m.conv1.stride == (1, 1)
    assert isinstance(m.maxpool, nn.Identity) and m.fc.in_features == 128
    out = m(torch.randn(2, 3, 16, 16).contiguous(memory_format=torch.channels_last))
    assert out.shape == (2, 10)
    assert MODEL_CHOICES == ("resnet18", "resnet50", "small_resnet", "small_resnet_cifar")
    assert isinstance(build_model("small_resnet_cifar", 10).maxpool, nn.Identity)
    assert isinstance(build_model("resnet18", 5), ResNet)
    with pytest.raises(ValueError, match="resnet18, resnet50, small_resnet, small_resnet_cifar"):
        build_model("vgg16", 10)
    with pytest.raises(ValueError, match="widths"):
        ResNet(Bottleneck, (1, 1, 1, 1), widths=(8, 8, 8))
