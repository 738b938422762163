"""A whole training run: datasets, model, DDP + comm hooks, epochs, validation, checkpoints, logs.

``train(cfg)`` is what ``python -m trainer`` runs on every rank (under torchrun, or alone in a
one-rank group). Order of a start: rank 0 locks ``--out`` and refuses a fresh run over old
checkpoints (:mod:`trainer.rundir`) -> every schedule phase is checked against the world size and
the dataset (:meth:`TrainConfig.validate_run`) -> a resumed run reads its checkpoint files and
checks them against the config (:func:`trainer.checkpoint.check_resumable`) BEFORE anything is
applied. Each of these steps ends with every rank agreeing on the outcome (:func:`_agree`), so a
problem on one rank is one error line on all of them, never a hang in the next collective.
Then, for a resume: model weights -> DDP + hooks -> comm residuals -> optimizer and GradScaler
state -> the DDP layout warm-up (:func:`trainer.build.layout_warmup`) -> the remaining batches
of the saved epoch, from the saved step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from client.dataset import CachedImageNet
from client.stats import PLACEMENT
from datacache.config import ConfigError
from trainer import checkpoint, locality
from trainer.build import (
    channels_last,
    layout_warmup,
    make_amp,
    make_ddp,
    make_model,
    make_optimizer,
    tune_cudnn,
)
from trainer.comm.auto_topk import auto_resolves_to
from trainer.comm.cross_barrier import CrossBarrier
from trainer.comm.overlap_auto import OverlapTuner
from trainer.data import DistributedBatchSampler, split_indices, train_loader, val_loader
from trainer.device_augment import DeviceAugment
from trainer.distenv import DistInfo, init_distributed
from trainer.epoch_rest import continue_epoch
from trainer.loop import EpochStats, StepContext, drain, recalibrate_bn, train_epoch, validate
from trainer.metrics import MetricsLog, epoch_line
from trainer.rundir import RunLock, check_fresh_start
from trainer.train_config import COMM_AUTO, TrainConfig

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What :func:`train` returns on every rank."""

    epochs: list[dict[str, Any]] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)
    model: nn.Module | None = None
    resumed_from: str | None = None

    @property
    def final(self) -> dict[str, Any]:
        return self.epochs[-1] if self.epochs else {}


@dataclass
class Data:
    train: CachedImageNet
    val: CachedImageNet
    train_idx: list[int]
    val_idx: list[int]


def bn_recalibration_loader(cfg: TrainConfig, data: Data, res: int, world: int, rank: int, gbs: int,
                            device: torch.device) -> Any:
    """``--bn-recalibrate N``'s batches: N per rank of training images (centre crops as validation takes
    them, no augmentation), a fixed sample drawn with the run's seed -- not the split's head, which an
    ImageFolder orders by class."""
    per_rank = max(1, gbs // world)
    k = min(len(data.train_idx), cfg.bn_recalibrate * per_rank * world)
    idx = sorted(random.Random(cfg.seed).sample(list(data.train_idx), k))
    return val_loader(data.train, idx, res, world_size=world, rank=rank, batch_size=per_rank,
                      workers=cfg.workers, crop_fraction=cfg.val_crop_fraction,
                      pin_memory=device.type == "cuda")


def open_data(cfg: TrainConfig, cache: str = "") -> Data:
    """The training dataset and the validation split (a separate folder, or a held-out part);
    ``cache`` overrides ``cfg.cache`` (the trainer adds ``local=`` for the byte accounting)."""
    kw: dict[str, Any] = {"cache": cache or cfg.cache or None, "short_side": cfg.short_side,
                          "record_key_file": cfg.record_key_file or None}  # None: the environment's
    train = CachedImageNet(cfg.data, **kw)
    if cfg.val_data:
        val = CachedImageNet(cfg.val_data, **kw)
        if list(val.classes) != list(train.classes):
            raise ConfigError(f"--val-data {cfg.val_data} has classes {list(val.classes)[:5]}..., --data has "
                              f"{list(train.classes)[:5]}...: the class folders must match")
        return Data(train, val, list(range(len(train))), list(range(len(val))))
    tr, va = split_indices(list(train.targets), cfg.val_fraction, cfg.seed)
    return Data(train, train, tr, va)


def _choose_comm(cfg: TrainConfig, info: DistInfo, model: nn.Module, device: torch.device, classes: int
                 ) -> tuple[TrainConfig, str]:
    """``--comm auto`` at a fresh start: the method whose predicted step is the shortest for this model's
    gradients on this job's measured links and its measured forward + backward (:mod:`trainer.comm.probe`);
    with ``--overlap auto`` also ``none`` at once when the model gives the thread nothing. The config
    with that method (and mode) and the log lines. The checkpoints then record the method, so a resume
    keeps it. COLLECTIVE."""
    from trainer.comm.probe import choose_method, measure_step
    from trainer.comm.topology import Topology

    topo = Topology.from_env(info.local_world_size)
    params = [p for p in model.parameters() if p.requires_grad]
    d = sum(p.numel() for p in params)
    # one batch of the first epoch's shape, from its own generator (the run's RNG is not touched)
    b, res = cfg.global_batch(0, info.world_size) // info.world_size, cfg.resolution_schedule.at(0)
    fmt = torch.channels_last if channels_last(cfg, device) else torch.contiguous_format
    x = torch.randn((b, 3, res, res), generator=torch.Generator().manual_seed(0))
    x = x.to(device, memory_format=fmt)
    y = (torch.arange(b) % classes).to(device)
    step = measure_step(model, x, y, autocast=make_amp(cfg, device).autocast, device=device)
    # DDP's buckets (the pieces that communicate while backward goes on); --overlap cross cuts the same size
    nbytes = sum(p.numel() * p.element_size() for p in params)
    pieces = max(1, math.ceil(nbytes / (cfg.bucket_cap_mb * 2**20)))
    choice = choose_method(topo, d, cfg.density, fp16=cfg.fp16_comm, device=device, step=step,
                           overlap=cfg.overlap, pieces=pieces)
    lines = "\n".join(ln for ln in (choice.line(), choice.overlap_line()) if ln)
    return dataclasses.replace(cfg, comm=choice.method, overlap=choice.overlap), lines


def _schedules(cfg: TrainConfig, epoch: int, gbs: int, steps: int, lr: float) -> dict[str, Any]:
    return {"lr": lr, "global_batch": gbs, "seed": cfg.seed,
            "resolution": cfg.resolution_schedule.at(epoch), "comm_method": cfg.comm_schedule.at(epoch),
            "steps_in_epoch": steps}


def _sum_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def _gather_over_ranks(values: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's ``values`` (COLLECTIVE), rank order."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [t.tolist()]
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def _resume_sampler(cfg: TrainConfig, loaded: checkpoint.Loaded, sampler: DistributedBatchSampler,
                    file: str) -> str:
    """A mid-epoch resume continues the saved epoch with the same --sampler: its saved plan on the same
    world and layout, else its untrained samples re-planned over this run's ranks (:mod:`trainer.epoch_rest`;
    ``local`` then plans them from a fresh owners snapshot). Returns the log note ("" when continued)."""
    saved = str(loaded.saved_config.get("sampler", "global"))
    if saved != cfg.sampler:
        raise ConfigError(f"{file}: saved mid-epoch with --sampler {saved}, now {cfg.sampler}; resume with "
                          f"--sampler {saved} (or from an epoch-end checkpoint)")
    state = loaded.train.get("sampler")
    if state is not None and not isinstance(state, dict):
        raise ConfigError(f"{file}: damaged sampler state; {checkpoint.WHAT_TO_DO}")
    if isinstance(sampler, locality.LocalityBatchSampler) and state is None:
        raise ConfigError(f"{file}: lacks the locality sampler's state (owners snapshot); "
                          f"{checkpoint.WHAT_TO_DO}")
    try:
        saved_world = int(loaded.train.get("world_size", sampler.world_size))
        return continue_epoch(sampler, state, saved_world=saved_world,
                              global_batch=int(loaded.schedules["global_batch"]), epoch=loaded.pos.epoch,
                              step=loaded.pos.step)
    except ConfigError as e:
        raise ConfigError(f"{file}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{file}: damaged sampler state ({type(e).__name__}); "
                          f"{checkpoint.WHAT_TO_DO}") from None


def _epoch_batch(cfg: TrainConfig, sampler: DistributedBatchSampler, epoch: int, world: int) -> int:
    """The global batch of ``epoch``: the config's, or the kept one of a re-planned resumed epoch."""
    rest = sampler.rest_for(epoch)
    return rest.batch * world if rest is not None else cfg.global_batch(epoch, world)


def _comm_state(loaded: checkpoint.Loaded, path: str, world: int,
                state: Any) -> tuple[dict[str, Any] | None, str]:
    """This rank's comm state to load: its own file, or -- saved on another world size or layout -- the
    counters of rank 0 and its share of every saved rank's error-feedback residuals, re-split so their
    sum (what the model is owed) is kept (:mod:`trainer.comm.ef_reshard`)."""
    from trainer.comm.ef_reshard import needs_reshard, reshard

    topo = state.ensure_topology()
    saved_world = int(loaded.train.get("world_size", world))
    if saved_world == world and (loaded.comm is None or not needs_reshard(loaded.comm["ef"], topo)):
        return loaded.comm, ""
    states = checkpoint.read_comm_states(path, saved_world)
    note = (f"; comm state saved on {saved_world} ranks, now {topo.world_size} ({topo.local_size} per node): "
            "error-feedback residuals re-split, their sum kept")
    return {**states[0], "ef": reshard([s["ef"] for s in states], topo)}, note


def _say_locality(logger: MetricsLog, cfg: TrainConfig, cluster: Any, mine: str | None, why: str,
                  masters_by_node: list[str]) -> None:
    """One log line (rank 0) on the sampler and the local master."""
    if cfg.sampler == "local" and cluster is None:
        logger.say("sampler local: the cache has no Redis Cluster tier, so each epoch is an ordinary seeded "
                   "exactly-once shuffle (equal batches on every rank)")
    elif cfg.sampler == "local":
        missing = [n for n, m in enumerate(masters_by_node) if not m]
        logger.say(f"sampler local: {len(masters_by_node)} nodes, masters {masters_by_node}, exchange "
                   f"{cfg.exchange}" + (f"; nodes {missing} have no local master known (their reads are "
                                        "remote; pass --local-master host:port there)" if missing else ""))
    if cluster is not None:
        logger.say(f"local master (rank 0): {mine or 'none'} ({why})")


LoaderFactory = Callable[[Data, DistributedBatchSampler], Iterable[Any]]


def _agree(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every rank; if it raised a ConfigError on ANY rank, raise that error (the
    lowest failing rank's) on every rank. COLLECTIVE: a rank that failed alone would otherwise
    leave the others waiting in the next collective."""
    result, error = None, None
    try:
        result = fn()
    except ConfigError as e:
        error = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        first = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
        if first is not None:
            raise ConfigError(first[1] if first[0] == 0 else f"rank {first[0]}: {first[1]}")
    elif error is not None:
        raise ConfigError(error)
    return result


@contextlib.contextmanager
def _out_dir(cfg: TrainConfig, info: DistInfo, resuming: bool) -> Iterator[None]:
    """Rank 0 holds the lock on ``--out`` for the run (see :mod:`trainer.rundir`)."""
    lock = RunLock(cfg.out)

    def take() -> None:
        if info.is_main:
            lock.acquire()
            try:
                check_fresh_start(cfg.out, resuming, cfg.overwrite)
            except BaseException:
                lock.release()
                raise

    _agree(take)
    try:
        yield
    finally:
        lock.release()


def _apply(what: str, file: str, fn: Callable[[], Any], hint: str) -> None:
    """Apply one part of a checkpoint; a mismatch is a ConfigError naming the file (never the
    torch message's tensors: only its first line, which names keys and shapes)."""
    try:
        fn()
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{file}: its {what} does not fit this run ({first}); {hint}") from None


def train(cfg: TrainConfig, info: DistInfo | None = None, *, make_loader: LoaderFactory | None = None,
          record_losses: bool = False) -> RunResult:
    """Run ``cfg`` on this rank. ``make_loader(data, sampler)`` replaces the cached crop loader
    (benchmarks: a naive loader over the same sampler); ``record_losses`` reads every step's loss
    (tests)."""
    if not cfg.data:
        raise ConfigError("no training data: pass --data URL (an ImageFolder or a .txt/.csv list)")
    info = info or init_distributed(cfg.device, cfg.dist_timeout)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    path = _agree(lambda: checkpoint.resolve(cfg.resume, cfg.out))
    with _out_dir(cfg, info, resuming=path is not None):
        return _train(cfg, info, path, make_loader=make_loader, record_losses=record_losses)


def _train(cfg: TrainConfig, info: DistInfo, path: str | None, *, make_loader: LoaderFactory | None,
           record_losses: bool) -> RunResult:
    device, rank, world = info.device, info.rank, info.world_size
    tune_cudnn(device)
    # the Redis Cluster tier's master on this node: counts local/remote bytes, and --sampler local
    cluster = _agree(lambda: locality.cluster_store(cfg.cache))
    mine, why = _agree(lambda: locality.find_local_master(cluster, cfg.local_master, cfg.sampler == "local"))
    data = _agree(lambda: open_data(cfg, locality.with_local_master(cfg.cache, mine) if mine else ""))
    _agree(lambda: cfg.validate_run(world, len(data.train_idx)))
    node_of_rank = locality.node_of_ranks(world, info.local_world_size)
    masters_by_node: list[str] = []
    keys: list[bytes] = []
    sampler: DistributedBatchSampler
    if cfg.sampler == "local":
        if cluster is not None:
            masters_by_node = _agree(lambda: locality.node_masters(mine, node_of_rank))
            if rank == 0:  # only rank 0 maps keys to masters (epoch_owners broadcasts the result)
                keys = data.train.reader.keys(data.train_idx)
        unowned = np.full(len(data.train_idx), -1, dtype=np.int16)  # set per epoch (epoch_owners)
        sampler = locality.LocalityBatchSampler(data.train_idx, unowned, node_of_rank, rank, cfg.seed,
                                                cfg.exchange)
    else:
        sampler = DistributedBatchSampler(data.train_idx, world, rank, cfg.seed)

    publisher = None  # rank 0's run plan for the daemons' rolling fill (trainer.locality.plan_publisher)
    if isinstance(sampler, locality.LocalityBatchSampler) and cluster is not None and rank == 0:
        publisher, why_not = locality.plan_publisher(data.train, data.train_idx, sampler, masters_by_node)
        sampler.publisher = publisher
        if publisher is None:
            log.info("run plan not published for the daemons' rolling fill: %s", why_not)

    view = data.train.samples  # (root prefix + relative path, label), built per item
    fingerprint = checkpoint.dataset_fingerprint(
        data.train.classes, ((view[i][0][len(view.prefix):], view[i][1]) for i in data.train_idx),
        len(data.train_idx))

    replan_note = auto_note = ""

    def read_checkpoint() -> checkpoint.Loaded | None:
        nonlocal replan_note, cfg, auto_note
        if not path:
            return None
        # on the CPU: the RNG state must stay a CPU tensor; load_state_dict moves the rest to the params
        loaded = checkpoint.load(path, rank, world, map_location="cpu")
        if cfg.comm == COMM_AUTO:  # the method the run chose at its start (its residuals are that method's)
            saved = str(loaded.saved_config.get("comm", ""))
            if not saved or saved == COMM_AUTO:
                raise ConfigError(f"{os.path.join(path, 'train.pt')}: --comm auto cannot tell which method "
                                  "this checkpoint trained with; pass that method with --comm")
            cfg = dataclasses.replace(cfg, comm=saved)
            auto_note = f"--comm auto: {saved}, the method of the checkpoint (no new measurement on resume)"
        checkpoint.check_resumable(loaded, {}, path, cfg.to_dict(), fingerprint)  # model, optimizer, data
        if 0 < cfg.stop_at_step <= loaded.pos.global_step:
            raise ConfigError(f"--stop-at-step {cfg.stop_at_step}: {path} is already at global step "
                              f"{loaded.pos.global_step}; pass a later step, or drop --stop-at-step")
        now: dict[str, Any] = {}
        if loaded.pos.epoch < cfg.epochs:
            if loaded.pos.step > 0:  # the sampler only: continued, or the rest of the epoch re-planned
                replan_note = _resume_sampler(cfg, loaded, sampler, os.path.join(path, "train.pt"))
            gbs = _epoch_batch(cfg, sampler, loaded.pos.epoch, world)
            rest = sampler.rest_for(loaded.pos.epoch)
            first = rest.start_step if rest is not None else 0
            sampler.set_epoch(loaded.pos.epoch, gbs // world, first, cfg.steps_per_epoch)
            now = _schedules(cfg, loaded.pos.epoch, gbs, sampler.steps_in_epoch(), 0.0)
        checkpoint.check_resumable(loaded, now, path, replanned=bool(replan_note))  # the schedules
        return loaded

    loaded = _agree(read_checkpoint)  # everything checked before anything is applied
    train_file = os.path.join(path or "", "train.pt")
    hint = "resume with the config the checkpoint was made with, or start a new run in another --out"
    model = make_model(cfg, len(data.train.classes), device)
    if loaded is not None:
        _apply("model", train_file, lambda: model.load_state_dict(loaded.train["model"]), hint)
    if cfg.comm == COMM_AUTO:  # a fresh start: measure this job's links, pick (COLLECTIVE)
        cfg, auto_note = _choose_comm(cfg, info, model, device, len(data.train.classes))
    optimizer = make_optimizer(cfg, model)
    ddp, state = make_ddp(model, cfg, device, optimizer)  # --overlap cross: steps the optimizer itself
    amp = make_amp(cfg, device)
    if loaded is not None:
        comm_state, comm_note = _comm_state(loaded, path or "", world, state)
        if comm_state is not None:
            _apply("comm state", os.path.join(path or "", f"comm_rank{rank}.pt"),
                   lambda: state.load_state_dict(comm_state), checkpoint.WHAT_TO_DO)
        _apply("optimizer state", train_file, lambda: optimizer.load_state_dict(loaded.train["optimizer"]),
               hint)
        if amp.scaler is not None and loaded.train["scaler"]:
            _apply("GradScaler state", train_file, lambda: amp.scaler.load_state_dict(loaded.train["scaler"]),
                   hint)
        torch.set_rng_state(loaded.train["rng"])
    fmt = torch.channels_last if channels_last(cfg, device) else torch.contiguous_format
    ctx = StepContext(ddp, optimizer, state, amp, nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing),
                      DeviceAugment(*cfg.normalization, memory_format=fmt), device, cfg.lr_schedule,
                      # --overlap auto: measured again after a resume (same results either way; the
                      # machines may differ)
                      OverlapTuner(state, device=device) if cfg.overlap == "auto" else None, cfg.prefetch)
    pad_crop = (cfg.resolution_schedule.at(0), cfg.pad) if cfg.augment == "padcrop" else None
    loader = make_loader(data, sampler) if make_loader is not None else train_loader(
        data.train, sampler, workers=cfg.workers, seed=cfg.seed, crop_scale=cfg.crop_scale, flip=cfg.flip,
        pad_crop=pad_crop,
        pin_memory=device.type == "cuda")
    logger = MetricsLog(cfg.out, enabled=info.is_main)
    if auto_note:
        logger.say(auto_note)
    start_epoch, start_step, gstep = 0, 0, 0
    if loaded is not None:
        start_epoch, start_step, gstep = loaded.pos.epoch, loaded.pos.step, loaded.pos.global_step
        if start_epoch < cfg.epochs and isinstance(ddp, CrossBarrier):
            state.fresh = False  # its pieces are fixed from the start: no layout step to warm up
        elif start_epoch < cfg.epochs:
            res = cfg.resolution_schedule.at(start_epoch)
            x = torch.zeros((sampler.batch_size, 3, res, res), device=device).contiguous(memory_format=fmt)
            layout_warmup(ddp, state, (x, torch.zeros(sampler.batch_size, dtype=torch.long, device=device)),
                          ctx.loss_fn, ctx.amp.autocast)
        logger.say(f"resumed from {path}: epoch {start_epoch + 1}, step {start_step}{replan_note}{comm_note}")
    pruner = checkpoint.Pruner(os.path.join(cfg.out, "checkpoints"), cfg.keep_checkpoints)
    _say_locality(logger, cfg, cluster, mine, why, masters_by_node)
    # the selector that runs ("auto" decides per device: MSTopK on the CPU, torch.topk on CUDA)
    selector = auto_resolves_to(device.type) if cfg.selector == "auto" else cfg.selector
    logger.write("start", config=cfg.to_dict(), world_size=world, nodes=info.nodes, device=str(device),
                 train_samples=len(data.train_idx), val_samples=len(data.val_idx), resumed_from=path,
                 selector=selector)
    result = RunResult(model=model, resumed_from=path)
    val_loaders: dict[int, Any] = {}  # one persistent loader per resolution
    bn_loaders: dict[int, Any] = {}  # --bn-recalibrate's, likewise
    overlap_said = False  # --overlap auto's decision, logged once after the epoch it came in
    for epoch in range(start_epoch, cfg.epochs):
        res = cfg.resolution_schedule.at(epoch)
        gbs = _epoch_batch(cfg, sampler, epoch, world)
        first = start_step if epoch == start_epoch else 0
        sampler.set_epoch(epoch, gbs // world, first, cfg.steps_per_epoch)
        continued = loaded is not None and epoch == start_epoch and first > 0 and not replan_note
        if isinstance(sampler, locality.LocalityBatchSampler) and cluster is not None and not continued:
            # a new epoch, or the re-planned rest of one: a fresh snapshot; continued: the saved owners
            sampler.set_owners(locality.epoch_owners(cluster, keys, masters_by_node,
                                                     n=len(data.train_idx)))  # COLLECTIVE
        steps = sampler.steps_in_epoch()
        if isinstance(sampler, locality.LocalityBatchSampler):
            sampler.publish_epoch()  # rank 0: the daemons fill in this epoch's order
        before = data.train.stats()

        def on_step(step: int, epoch: int = epoch, steps: int = steps, g0: int = gstep - first,
                    gbs: int = gbs) -> None:
            g = g0 + step  # the global step just completed
            if publisher is not None:
                publisher.progress(trained=step * (gbs // world))
            every = cfg.checkpoint_every and g % cfg.checkpoint_every == 0
            stop = 0 < cfg.stop_at_step <= g
            if (every or stop) and step < steps:  # the epoch's end has its own checkpoint
                _save(cfg, info, model, ctx, pruner, fingerprint, checkpoint.Position(epoch, step, g),
                      _schedules(cfg, epoch, gbs, steps, optimizer.param_groups[0]["lr"]), sampler)
                if stop:  # every rank at the same step: they all leave the epoch here
                    raise _StopRun(g)

        try:
            stats = train_epoch(ctx, loader, epoch=epoch, resolution=res, global_batch=gbs,
                                steps_in_epoch=steps, start_step=first,
                                progress=cfg.progress and info.is_main, record_losses=record_losses,
                                on_step=on_step)
        except _StopRun as stop:
            _say_stop(logger, stop.step, epoch, cfg)
            break
        gstep += stats.steps
        result.step_losses += stats.step_losses
        rec = _epoch_record(cfg, data, stats, before, res, gbs, world, device)
        rec["comm_method"] = state.active_method or state.config.method  # what the hooks ran
        rec["overlap"] = "cross" if isinstance(ddp, CrossBarrier) else state.overlap  # in force at the end
        decision = ctx.tuner.decision if ctx.tuner is not None else None
        if decision is not None and not overlap_said:
            overlap_said = True
            logger.say(decision.line())
            logger.write("overlap_auto", mode=decision.mode, none_s=decision.none_s, async_s=decision.async_s,
                         steps_per_mode=decision.steps_per_mode, ranks=decision.world)
        rec["sampler"] = cfg.sampler
        if isinstance(sampler, locality.LocalityBatchSampler):
            rec["planned_local_fraction"] = sampler.local_fraction()
        if cfg.val_every and ((epoch + 1) % cfg.val_every == 0 or epoch + 1 == cfg.epochs) and data.val_idx:
            if cfg.bn_recalibrate:  # every rank evaluates the statistics all ranks recomputed
                if res not in bn_loaders:
                    bn_loaders[res] = bn_recalibration_loader(cfg, data, res, world, rank, gbs, device)
                recalibrate_bn(model, bn_loaders[res], ctx.augment, device, res, amp, cfg.prefetch)
            else:
                for buf in model.buffers():  # every rank evaluates rank 0's BatchNorm statistics
                    dist.broadcast(buf, 0)
            if res not in val_loaders:
                val_loaders[res] = val_loader(data.val, data.val_idx, res, world_size=world, rank=rank,
                                              batch_size=max(1, gbs // world), workers=cfg.workers,
                                              crop_fraction=cfg.val_crop_fraction,
                                              pin_memory=device.type == "cuda")
            v = validate(model, val_loaders[res], ctx.augment, device, res, amp, cfg.prefetch)
            rec.update(val_top1=v["top1"], val_top5=v["top5"], val_loss=v["loss"], val_samples=v["samples"])
        _save(cfg, info, model, ctx, pruner, fingerprint, checkpoint.Position(epoch + 1, 0, gstep),
              _schedules(cfg, epoch, gbs, steps, stats.lr), sampler)
        logger.write("epoch", **rec)
        logger.say(epoch_line(rec, cfg.epochs))
        result.epochs.append(rec)
        if 0 < cfg.stop_at_step <= gstep and epoch + 1 < cfg.epochs:
            _say_stop(logger, gstep, epoch + 1, cfg)
            break
    logger.write("end", epochs=len(result.epochs))
    if isinstance(ddp, CrossBarrier):
        ddp.close()  # its communication thread (after the last pieces) and its hooks
    state.close()  # the communication thread of --overlap async (none otherwise)
    if publisher is not None:
        publisher.close()  # the daemons stop planning for this run at once (no wait for the expiry)
    if cluster is not None:
        cluster.close()  # the slot-map reader's own connections (the datasets keep theirs)
    return result


class _StopRun(Exception):
    """``--stop-at-step`` reached mid-epoch (raised on every rank after the checkpoint)."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped at global step {step}")
        self.step = step


def _say_stop(logger: MetricsLog, step: int, epoch: int, cfg: TrainConfig) -> None:
    logger.write("stop", global_step=step, epoch=epoch)
    logger.say(f"stopped after global step {step} (--stop-at-step {cfg.stop_at_step}), checkpoint written: "
               f"continue with --resume auto (any world size)")


def _epoch_record(cfg: TrainConfig, data: Data, stats: EpochStats, before: dict[str, Any], res: int, gbs: int,
                  world: int, device: torch.device) -> dict[str, Any]:
    after = data.train.stats()
    hits, misses, decoded = (after[k] - before[k] for k in ("hits", "misses", "decoded"))
    wait, loss, aug, hits, misses, decoded = _sum_over_ranks(
        [stats.data_wait_fraction / world, stats.loss / world, stats.augment_s / world, hits, misses,
         decoded], device)
    # where each byte went, per rank (all-gathered) and summed: local = the master on the rank's node
    placed = _gather_over_ranks([after[k] - before[k] for k in PLACEMENT], device)
    per_rank = {f"rank_{k}": [row[i] for row in placed] for i, k in enumerate(PLACEMENT)}
    return {**{k: sum(v) for k, v in zip(PLACEMENT, zip(*placed))}, **per_rank,
            "epoch": stats.epoch, "resolution": res, "global_batch": gbs, "steps": stats.steps,
            "lr": stats.lr, "loss": loss, "seconds": stats.seconds,
            "samples_per_s": stats.samples_per_s * world, "data_wait_fraction": wait, "augment_s": aug,
            "skipped_steps": stats.skipped_steps, "cache_hits": int(hits), "cache_misses": int(misses),
            "cache_hit_ratio": round(hits / (hits + misses), 4) if hits + misses else None,
            "decoded": int(decoded)}


def _save(cfg: TrainConfig, info: DistInfo, model: nn.Module, ctx: StepContext, pruner: checkpoint.Pruner,
          dataset: dict[str, Any], pos: checkpoint.Position, schedules: dict[str, Any],
          sampler: DistributedBatchSampler) -> None:
    drain(ctx)  # --overlap cross: every step so far applied before the weights are written
    d = checkpoint.save(cfg.out, rank=info.rank, pos=pos, model=model, optimizer=ctx.optimizer,
                        scaler=ctx.amp.scaler, comm_state=ctx.state.state_dict(), schedules=schedules,
                        config_json=cfg.to_json(), world_size=info.world_size, pruner=pruner,
                        sampler=sampler.state_dict(),
                        dataset=dataset)
    log.info("checkpoint %s", d)
