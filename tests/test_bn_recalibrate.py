"""``--bn-recalibrate N``: BatchNorm's running statistics recomputed before validation.

The reference is PyTorch's own ``torch.optim.swa_utils.update_bn`` (reset, then a cumulative average
over the loader's batches in training mode) on the same normalised batches; with a process group the
result is the mean of what each rank's ``update_bn`` gives on its own batches."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import update_bn

from datacache.config import ConfigError
from tests.dist_utils import run_distributed, to_plain
from trainer.build import Amp
from trainer.device_augment import IMAGENET_MEAN, IMAGENET_STD, DeviceAugment
from trainer.loop import recalibrate_bn
from trainer.train_config import make_config

SIZE = 12


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6, momentum=0.3), nn.ReLU(),
                         nn.Conv2d(6, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(3),
                         nn.BatchNorm1d(3))


def _batches(seed: int, n: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    # uneven sizes: a cumulative average weights batches alike, whatever their size (as update_bn)
    return [(torch.randint(0, 256, (4 + k, 3, SIZE, SIZE), dtype=torch.uint8, generator=g),
             torch.zeros(4 + k, dtype=torch.long)) for k in range(n)]


def _normalised(u8: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (u8.float() / 255 - mean) / std


def _stats(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k}


def _trained_away(model: nn.Module) -> nn.Module:
    """Running statistics that no longer match the weights: what a young network validates with."""
    with torch.no_grad():
        model.train()
        model(torch.randn(8, 3, SIZE, SIZE) * 5 + 3)
        for p in model.parameters():
            p.mul_(1.7)
    return model.eval()


def test_recomputed_statistics_equal_torchs_update_bn_and_leave_the_module_as_it_was() -> None:
    batches = _batches(0)
    ours = _trained_away(_model())
    theirs = copy.deepcopy(ours)
    momenta = [m.momentum for m in ours.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    weights = {k: v.clone() for k, v in ours.named_parameters()}
    before = _stats(ours)

    seen = recalibrate_bn(ours, batches, DeviceAugment(), torch.device("cpu"), SIZE, Amp(None, "cpu", None))
    update_bn([_normalised(x) for x, _ in batches], theirs)

    assert seen == len(batches)
    got, want = _stats(ours), _stats(theirs)
    assert any(not torch.allclose(before[k], want[k]) for k in want)  # the statistics did change
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)
    assert [m.momentum for m in ours.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)] == momenta
    assert not ours.training  # the mode it came in with
    assert all(torch.equal(v, weights[k]) for k, v in ours.named_parameters())  # no parameter moved


def _rank(rank: int, world: int) -> dict:
    model = _trained_away(_model())
    batches = _batches(10 + rank)
    recalibrate_bn(model, batches, DeviceAugment(), torch.device("cpu"), SIZE, Amp(None, "cpu", None))
    return to_plain(_stats(model))


def test_every_rank_gets_the_mean_of_the_ranks_statistics() -> None:
    got = run_distributed(_rank, world_size=2, local_size=2)
    refs = []
    for rank in range(2):
        ref = _trained_away(_model())
        update_bn([_normalised(x) for x, _ in _batches(10 + rank)], ref)
        refs.append(_stats(ref))
    assert got[0].keys() == refs[0].keys()
    for k in refs[0]:
        want = (refs[0][k] + refs[1][k]) / 2
        for rank in range(2):
            torch.testing.assert_close(torch.as_tensor(got[rank][k], dtype=want.dtype), want, rtol=1e-5,
                                       atol=1e-5, msg=f"rank {rank}: {k}")


def test_negative_batches_are_refused_naming_the_flag() -> None:
    assert make_config("none", bn_recalibrate=0).bn_recalibrate == 0
    with pytest.raises(ConfigError, match="bn_recalibrate=-1"):
        make_config("none", bn_recalibrate=-1)
