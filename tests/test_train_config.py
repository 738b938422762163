"""Trainer configuration, schedules, the DAWNBench recipe, the distributed batch sampler, the split."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from datacache.config import ConfigError
from trainer.build import comm_config
from trainer.cli import build_parser, grid_configs, main
from trainer.data import DistributedBatchSampler, ShardSampler, split_indices
from trainer.schedule import EpochSchedule, LRSchedule, positive_int
from trainer.train_config import TrainConfig, make_config


def test_epoch_schedule_parse_and_errors() -> None:
    s = EpochSchedule.parse("0:96,13:128,24:224,27:288", positive_int, "resolution")
    assert [s.at(e) for e in (0, 12, 13, 23, 24, 26, 27, 40)] == [96, 96, 128, 128, 224, 224, 288, 288]
    assert EpochSchedule.parse("64", positive_int, "resolution").at(5) == 64
    assert str(s) == "0:96,13:128,24:224,27:288"
    for bad, msg in (("5:96", "start at epoch 0"), ("0:96,0:128", "increase strictly"),
                     ("0:x", "cannot read"), ("96,13:128", "EPOCH: prefix"), ("0:0", "cannot read")):
        with pytest.raises(ConfigError, match=msg):
            EpochSchedule.parse(bad, positive_int, "resolution")


def test_lr_schedule_against_closed_forms() -> None:
    poly = LRSchedule(peak=2.0, epochs=10, warmup_epochs=2, warmup_start=0.1, decay="poly", power=2)
    assert poly.at(0, 256) == pytest.approx(0.2)
    assert poly.at(1, 256) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))
    assert poly.at(2, 256) == pytest.approx(2.0)
    assert poly.at(6, 256) == pytest.approx(2.0 * (1 - 4 / 8) ** 2)  # Mikami's (1 - e/E)^2
    cos = LRSchedule(peak=1.0, epochs=4, decay="cosine", scaling="linear", ref_batch=256)
    assert cos.at(0, 512) == pytest.approx(2.0)  # linear scaling: 1.0 x 512 / 256
    assert cos.at(2, 256) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos.at(3.99, 256) == pytest.approx(0.5 * (1 + math.cos(math.pi * 3.99 / 4)))
    with pytest.raises(ConfigError, match="poly, cosine, none"):
        LRSchedule(peak=1.0, epochs=2, decay="step")


def test_config_errors_name_the_field_and_the_choices() -> None:
    with pytest.raises(ConfigError, match="optimizer='adam'; choose one of sgd, lars, lamb"):
        make_config(optimizer="adam")
    with pytest.raises(ConfigError, match="allreduce, torus, naive_ag, hitopk"):
        make_config(comm="0:hitopk,5:ring")
    with pytest.raises(ConfigError, match="resnet18, resnet50, small_resnet, small_resnet_cifar"):
        make_config(model="vgg")
    with pytest.raises(ConfigError, match="density"):
        make_config(density=0.0)
    with pytest.raises(ConfigError, match="none, dawnbench, digits"):
        make_config(recipe="fast")
    with pytest.raises(ConfigError, match="does not split over 3 ranks"):
        make_config(batch_size="256").global_batch(0, 3)
    with pytest.raises(ConfigError, match="unknown TrainConfig fields"):
        TrainConfig.from_dict({"learning_rate": 1})
    cfg = make_config(recipe="digits", lr=0.3)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg and cfg.lr == 0.3 and cfg.model == "small_resnet_cifar"


def test_dawnbench_recipe_has_the_papers_schedule_shape() -> None:
    cfg = make_config(recipe="dawnbench", data="x")
    res = [cfg.resolution_schedule.at(e) for e in range(cfg.epochs)]
    assert cfg.epochs == 28 and [res.count(r) for r in (96, 128, 224, 288)] == [13, 11, 3, 1]
    assert res == sorted(res)  # progressive resizing: 13 epochs at 96, 11 at 128, 3 at 224, 1 at 288
    per_gpu = [cfg.global_batch(e, 128) // 128 for e in range(28)]
    assert per_gpu == [256] * 27 + [128]  # Table 4 of Shi et al.: 256 per GPU, 128 at 288 px
    methods = [cfg.comm_schedule.at(e) for e in range(28)]
    assert methods == ["hitopk"] * 13 + ["torus"] * 15  # MSTopK-SGD over HiTopKComm, then 2D-Torus
    cc = comm_config(cfg)
    # auto: MSTopK on the CPU, torch.topk on CUDA (faster there, bench/results/topk_gpu.json)
    assert cc.schedule is not None and cc.selector == "auto" and cc.density == 0.01
    assert cc.method_at(0, 12) == "hitopk" and cc.method_at(0, 13) == "torus"
    assert cfg.optimizer == "lars" and cfg.pto and cfg.label_smoothing == 0.1 and cfg.decay == "poly"
    assert cfg.warmup_epochs > 0 and cfg.model == "resnet50" and cfg.amp == "auto"


@pytest.mark.parametrize("world,n", [(1, 50), (3, 50), (4, 37), (2, 13)])
def test_batch_sampler_follows_distributed_sampler_order(world: int, n: int) -> None:
    indices = list(range(100, 100 + n))
    for rank in range(world):
        s = DistributedBatchSampler(indices, world, rank, seed=7)
        s.set_epoch(2, batch_size=4)
        ref = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=7)
        ref.set_epoch(2)
        order = [indices[i] for i in ref]  # torch's own order is the independent reference
        batches = list(s)
        assert len(batches) == len(order) // 4 == len(s)
        assert [i for b in batches for i in b.indices] == order[: len(batches) * 4]
        assert [(b.epoch, b.step, b.rank) for b in batches] == [(2, k, rank) for k in range(len(batches))]
        s.set_epoch(2, batch_size=4, start_step=1)  # a resumed epoch: exactly the remaining batches
        assert [b.indices for b in s] == [b.indices for b in batches[1:]]
        s.set_epoch(2, batch_size=4, max_steps=1)
        assert len(list(s)) == 1
    with pytest.raises(ConfigError, match="larger than"):
        DistributedBatchSampler(indices, world, 0).set_epoch(0, batch_size=n + 1)


def test_shard_sampler_covers_every_sample_once() -> None:
    seen = [i for r in range(3) for b in ShardSampler(range(10), 3, r, 2) for i in b.indices]
    assert sorted(seen) == list(range(10))


def test_split_is_stratified_and_seeded() -> None:
    labels = [c for c in range(5) for _ in range(20)] + [5]  # class 5 has one sample: kept for training
    tr, va = split_indices(labels, 0.2, seed=1)
    assert sorted(tr + va) == list(range(101)) and not set(tr) & set(va)
    counts = np.bincount(np.asarray(labels)[va], minlength=6)
    assert counts.tolist() == [4, 4, 4, 4, 4, 0]
    assert split_indices(labels, 0.2, seed=1) == (tr, va) and split_indices(labels, 0.2, seed=2) != (tr, va)


def test_cli_help_flags_and_errors(capsys) -> None:
    text = build_parser().format_help()
    assert "torchrun" in text and "sweep" in text and "digits" in text
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--comm", "--resolution", "--batch-size", "--recipe", "--amp", "--resume", "--pto"):
        assert flag in out
    assert main(["--recipe", "digits", "--optimizer", "lars", "--comm", "0:hitopk,5:ring"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1  # one line, no traceback
    assert "comm method 'ring'; choose one of allreduce, torus, naive_ag, hitopk" in err
    assert main(["--device", "cpu", "--cache", "memory://"]) == 2  # no --data
    assert "--data" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--optimizer", "adam"])  # argparse lists the choices
    assert e.value.code == 2 and "choose from" in capsys.readouterr().err


def test_sweep_grid_product() -> None:
    runs = grid_configs({"recipe": "digits", "out": "/tmp/x", "model": "small_resnet"},
                        ["lr=0.1,0.2", "flip=true,false"])
    assert [label for label, _ in runs] == ["lr=0.1-flip=True", "lr=0.1-flip=False", "lr=0.2-flip=True",
                                            "lr=0.2-flip=False"]
    last = runs[3][1]
    assert last.lr == 0.2 and last.flip is False and last.out == "/tmp/x/03-lr=0.2-flip=False"
    with pytest.raises(ConfigError, match="not a training option"):
        grid_configs({}, ["learning=0.1"])
    with pytest.raises(ConfigError, match="expected a float"):
        grid_configs({}, ["lr=fast"])


def test_model_init_is_seeded_and_leaves_the_global_rng_alone() -> None:
    from trainer.build import make_model

    cfg = make_config(model="small_resnet", width=4, seed=3)
    before = torch.get_rng_state()
    a = make_model(cfg, 10, torch.device("cpu"))
    b = make_model(cfg, 10, torch.device("cpu"))
    assert torch.equal(before, torch.get_rng_state())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_amp_and_memory_format_choices() -> None:
    from trainer.build import channels_last, make_amp, make_model

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    with pytest.raises(ConfigError, match="amp=fp16 needs CUDA"):
        make_amp(make_config(amp="fp16"), cpu)
    assert make_amp(make_config(amp="auto"), cpu).dtype is None  # auto: fp16 on CUDA, off on a CPU
    bf16 = make_amp(make_config(amp="bf16"), cpu)
    assert bf16.scaler is None  # bf16 keeps fp32's exponent range: no loss scaling
    # below width 8 the projection shortcut is a 1x1 stride-2 conv of < 8 channels, whose channels_last CPU
    # backward crashes torch 2.13 (trainer/build.py): refused with what to do
    with pytest.raises(ConfigError, match=r"channels-last off .* --width 8"):
        make_model(make_config(model="small_resnet_cifar", width=4, channels_last="on"), 10, cpu)
    model = make_model(make_config(model="small_resnet_cifar", width=8, channels_last="on"), 10, cpu)
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    with bf16.autocast():
        assert model(x).dtype == torch.bfloat16
    assert channels_last(make_config(), cuda) and not channels_last(make_config(), cpu)
    assert not channels_last(make_config(channels_last="off"), cuda)


def test_console_script_points_at_the_cli() -> None:
    import importlib
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml")) as f:  # [project.scripts] (tomllib needs 3.11)
        target = re.search(r'^datacache-train = "([\w.]+):(\w+)"$', f.read(), re.M)
    assert target is not None
    assert getattr(importlib.import_module(target.group(1)), target.group(2)) is main


def test_dist_timeout_must_be_positive_and_reaches_the_process_group() -> None:
    with pytest.raises(ConfigError, match=r"dist_timeout=0\.0 is out of range"):
        make_config(dist_timeout=0.0)
    assert make_config(dist_timeout=20).dist_timeout == 20  # tests/test_emulated_elastic.py: it fires
