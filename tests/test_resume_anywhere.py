"""Real training runs resumed mid-epoch on another world size (real gloo groups, the trainer's own
loader): 4 ranks (2 x 2) stopped after step 4 of 7, resumed on 2 ranks (2 nodes x 1) and on 3.

Counted by a hook between the trainer's sampler and its DataLoader (every batch the loader takes),
never by the sampler's own bookkeeping: across the two phases every sample of the interrupted epoch
is trained at most once, and all of them when the batches divide; the global batch is kept (per-rank
batch 48 / M), the next epoch is the new world's ordinary one, error-feedback residuals are re-split."""

from __future__ import annotations

import contextlib
import io
import shutil
from collections import Counter

import numpy as np
import pytest

from tests.dist_utils import RecordingBatchSampler, run_distributed
from trainer.train_config import make_config


def _rank(rank: int, world: int, cfg_values: dict) -> dict:
    from trainer.data import train_loader
    from trainer.run import train
    from trainer.train_config import TrainConfig

    seen: list = []
    cfg = TrainConfig.from_dict(cfg_values)

    def make_loader(data, sampler):
        return train_loader(data.train, RecordingBatchSampler(sampler, seen), workers=cfg.workers,
                            seed=cfg.seed, crop_scale=cfg.crop_scale, flip=cfg.flip)

    said = io.StringIO()
    with contextlib.redirect_stdout(said):  # rank 0's log lines
        res = train(cfg, make_loader=make_loader, record_losses=True)
    return {"seen": seen, "losses": res.step_losses, "epochs": res.epochs, "said": said.getvalue()}


def _cfg(digits: dict, out: str, **kw) -> dict:
    # the digits validation folder (359 images) as the training set; global batch 48: on 4 ranks
    # 90 per rank (one padded), 7 steps of 12
    base = dict(data=digits["val"], val_data=digits["val"], cache=digits["cache"], short_side=32,
                model="small_resnet_cifar", width=4, zero_init_residual=False, resolution="16",
                batch_size="48", epochs=2, lr=0.1, lr_scaling="none", workers=0, device="cpu", progress=False,
                seed=5, val_every=0, out=out, keep_checkpoints=0, checkpoint_every=2, comm="naive_ag",
                selector="exact", density=0.05)
    return make_config(**{**base, **kw}).to_dict()


@pytest.fixture(scope="module")
def interrupted(digits_data, tmp_path_factory) -> dict:
    """The 4-rank run and its checkpoint after step 4 of epoch 1 (what a lost node leaves behind)."""
    out = tmp_path_factory.mktemp("anywhere") / "a"
    cfg = _cfg(digits_data, str(out))
    res = run_distributed(_rank, world_size=4, local_size=2, args=(cfg,))
    ckpt = out / "checkpoints" / "step00000004"
    assert (ckpt / "train.pt").exists()
    before = [(e, s, ix) for r in res for e, s, ix in r["seen"] if e == 0 and s < 4]
    return {"out": out, "ckpt": ckpt, "cfg": cfg, "trained": [i for _, _, ix in before for i in ix]}


@pytest.mark.slow
@pytest.mark.parametrize("world,local", [(2, 1), (3, 3)])
def test_resume_on_another_world_size_trains_the_rest_of_the_epoch_once(interrupted, tmp_path, world: int,
                                                                       local: int) -> None:
    out = tmp_path / "b"
    shutil.copytree(interrupted["out"], out)
    ckpt = out / "checkpoints" / "step00000004"
    cfg = {**interrupted["cfg"], "out": str(out), "resume": str(ckpt)}
    res = run_distributed(_rank, world_size=world, local_size=local, args=(cfg,))
    per_rank = 48 // world
    rest = [i for r in res for e, s, ix in r["seen"] if e == 0 for i in ix]
    first = interrupted["trained"]
    assert len(first) == 4 * 48 and len(set(first)) == 4 * 48  # the padded copy is in a dropped tail
    remaining = 359 - 4 * 48
    steps = -(-remaining // world) // per_rank
    for r in res:
        assert [s for e, s, _ in r["seen"] if e == 0] == list(range(4, 4 + steps))  # same steps everywhere
        assert all(len(ix) == per_rank for e, _, ix in r["seen"] if e == 0)
    counts = Counter(first + rest)
    assert max(counts.values()) == 1  # nothing twice: not the 4 trained steps, not within the rest
    assert len(rest) == world * steps * per_rank
    assert 359 - len(counts) < world * per_rank  # only the ranks' incomplete last batches left out
    # the next epoch: the new world's ordinary plan, all of it
    ep1 = [i for r in res for e, _, ix in r["seen"] if e == 1 for i in ix]
    assert len(ep1) == world * (-(-359 // world) // per_rank) * per_rank
    rec = res[0]["epochs"]
    assert rec[0]["global_batch"] == 48 and rec[0]["steps"] == steps and rec[1]["global_batch"] == 48
    assert all(np.isfinite(x) for x in res[0]["losses"])
    said = res[0]["said"]
    assert (f"epoch 1, step 4; epoch 1 was planned for 4 ranks: its {remaining} untrained samples re-planned "
            f"over {world} ranks, {per_rank} per rank (global batch 48 kept)") in said
    assert "error-feedback residuals re-split, their sum kept" in said


@pytest.mark.slow
def test_resume_keeps_the_global_batch_or_refuses_with_the_choices(digits_data, tmp_path) -> None:
    """--batch-per-rank 16 on 2 ranks (global 32) resumed mid-epoch on 3: 32 does not split over 3."""
    from datacache.config import ConfigError

    cfg = _cfg(digits_data, str(tmp_path / "a"), batch_size="16", batch_per_rank=True, epochs=1,
               comm="allreduce")
    run_distributed(_rank, world_size=2, local_size=1, args=(cfg,))
    ckpt = tmp_path / "a" / "checkpoints" / "step00000002"
    bad = {**cfg, "resume": str(ckpt)}
    with pytest.raises(RuntimeError) as err:  # run_distributed re-raises each rank's failure
        run_distributed(_rank, world_size=3, local_size=3, args=(bad,))
    assert ConfigError.__name__ in str(err.value)
    assert "global batch 32 on 2 ranks; it does not split over 3 ranks" in str(err.value)
    assert "resume on 1, 2, 4, 8, 16, 32 ranks, or from an epoch-end checkpoint" in str(err.value)
