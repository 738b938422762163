"""``TrainConfig``: everything a training run needs, typed and validated, plus the recipes.

Every field has a help text in its metadata; :mod:`trainer.cli` builds the command line from
them, so the flags, the config and the checkpoint's record of it never drift apart. A bad value
raises :class:`~datacache.config.ConfigError` naming the field and, for choices, listing the
valid ones. Schedules are strings (``"0:96,13:128"``; see :class:`trainer.schedule.EpochSchedule`)
parsed once, here.

Recipes (``--recipe NAME``) are partial configs applied before the explicit flags:

* ``dawnbench`` -- the shape of the 28-epoch DAWNBench run of Shi et al. 2021 §5.6 (Table 4):
  13 epochs at 96 px, 11 at 128, 3 at 224, 1 at 288; 256 samples per GPU (128 in the 288-px
  epoch); MSTopK-SGD over HiTopKComm (ρ = 1 %) for the first 13 epochs, 2D-Torus all-reduce
  afterwards; LARS with PTO (Mikami et al. 2018 §3.2: trust coefficient 0.01, eps 1e-6),
  label smoothing 0.1, linear warm-up then poly decay (power 2), ResNet-50, fp16 AMP on GPUs.
  The peak LR is a starting point to tune, not the paper's (which it does not state).
* ``digits`` -- the real-data run on scikit-learn's digits (``python -m trainer digits``):
  a small ResNet (CIFAR stem) at 32 px, no flips (a mirrored digit is another symbol).
* ``fashion`` -- Zalando's Fashion-MNIST (``python -m trainer fashion``; 60,000 + 10,000 28x28
  grayscale images): the CIFAR-stem ResNet at width 8 (78,002 parameters; ``--width 16``: 308,826),
  28 px, torchvision's ``RandomCrop(28, padding=4)`` + horizontal flip (``--augment padcrop``), the
  dataset's mean/std, label smoothing 0.1, SGD with Nesterov momentum, one warm-up epoch then cosine
  decay over 20 epochs, global batch 256 (2 nodes x 2 ranks: 64 per rank). The grayscale images
  are stored and served as 3 equal channels, as ``ImageFolder``'s RGB loader gives them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from datacache.config import ConfigError
from trainer.comm.names import METHOD_CHOICES, OVERLAP_CHOICES, SELECTOR_CHOICES
from trainer.model_names import MODEL_CHOICES
from trainer.schedule import DECAY_CHOICES, LR_SCALING_CHOICES, EpochSchedule, LRSchedule, positive_int
from trainer.staging import STAGING_CHOICES

SAMPLER_CHOICES = ("global", "local")
OPTIMIZER_CHOICES = ("sgd", "lars", "lamb")
AMP_CHOICES = ("off", "auto", "fp16", "bf16")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
TRISTATE_CHOICES = ("auto", "on", "off")
RECIPE_CHOICES = ("none", "dawnbench", "digits", "fashion")
AUGMENT_CHOICES = ("rrc", "padcrop")
IMAGENET_MEAN = "0.485,0.456,0.406"
IMAGENET_STD = "0.229,0.224,0.225"
# Fashion-MNIST's training split: pixel mean and standard deviation over all 60,000 x 28 x 28 pixels
# (0..1 units; tests/test_fashion_recipe.py recomputes them from the IDX file)
FASHION_MEAN = "0.2860"
FASHION_STD = "0.3530"


def _f(default: Any, help: str, group: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "group": group, "choices": choices})


COMM_AUTO = "auto"  # --comm auto: measured at start, the cheapest method (trainer.comm.probe)


def _method(text: str) -> str:
    if text not in (*METHOD_CHOICES, COMM_AUTO):
        raise ConfigError(f"comm method {text!r}; choose one of {', '.join(METHOD_CHOICES)} or {COMM_AUTO}")
    return text


@dataclass(frozen=True)
class TrainConfig:
    """A training run (see the module docstring; ``trainer.cli`` documents each flag)."""

    # data
    data: str = _f("", "training ImageFolder (or .txt/.csv list): any fsspec URL or path", "data")
    val_data: str = _f("", "validation ImageFolder; empty: hold out --val-fraction of --data", "data")
    val_fraction: float = _f(0.1, "fraction of --data held out for validation without --val-data", "data")
    cache: str = _f("", "cache URL (lmdb:///local/dir, memory://); empty: the default LMDB cache", "data")
    short_side: int = _f(160, "short side of the cached variant (it serves every resolution)", "data")
    record_key_file: str = _f("", "file holding the cache's record key (the daemons' record_key_file): "
                              "records must carry its keyed MAC; empty: $DATACACHE_RECORD_KEY_FILE if set, "
                              "else none", "data")
    workers: int = _f(2, "DataLoader worker processes per rank (they only cut crop windows)", "data")
    prefetch: str = _f("inline", "where the next batch is staged (taken from the loader, copied and "
                       "augmented; on CUDA on a side stream): inline (on the training thread, before each "
                       "step) or thread (a staging thread one batch ahead, so the training thread does not "
                       "stage after the step's host sync); the same batches either way", "data",
                       STAGING_CHOICES)
    sampler: str = _f("global", "sample order: global (DistributedSampler's shuffle) or local (each node "
                      "reads mostly the samples its own Redis Cluster master holds; exactly once per epoch)",
                      "data", SAMPLER_CHOICES)
    exchange: float = _f(0.1, "--sampler local: fraction of each node's samples swapped across nodes every "
                         "epoch (0.1: ~90%% of the bytes stay on the node at 16 nodes)", "data")
    local_master: str = _f("", "--sampler local / byte accounting: host:port of the Redis Cluster master on "
                           "this rank's node as the cluster announces it (empty: the one master with an "
                           "address of this host)", "data")
    # model
    model: str = _f("resnet50", "network", "model", MODEL_CHOICES)
    width: int = _f(16, "first-stage channels of small_resnet(_cifar)", "model")
    zero_init_residual: bool = _f(True, "zero-initialise each residual block's last BatchNorm gamma (Goyal "
                                  "et al.; helps large batches, slows tiny short runs)", "model")
    # schedules
    epochs: int = _f(1, "epochs to train", "schedule")
    batch_size: str = _f("256", "global batch size, or a schedule EPOCH:SIZE,... (batch-size control)",
                         "schedule")
    batch_per_rank: bool = _f(False, "--batch-size values are per rank, not global", "schedule")
    resolution: str = _f("224", "training resolution, or a schedule EPOCH:PX,... (progressive resizing)",
                         "schedule")
    steps_per_epoch: int = _f(0, "stop each epoch after this many steps (0: the whole epoch)", "schedule")
    lr: float = _f(0.1, "peak learning rate (per --lr-ref-batch samples with --lr-scaling linear)",
                   "schedule")
    lr_scaling: str = _f("linear", "scale the peak LR with the global batch", "schedule", LR_SCALING_CHOICES)
    lr_ref_batch: int = _f(256, "reference batch of linear LR scaling", "schedule")
    warmup_epochs: float = _f(0.0, "linear LR warm-up length in epochs", "schedule")
    warmup_start: float = _f(0.0, "LR at epoch 0 as a fraction of the peak", "schedule")
    decay: str = _f("cosine", "LR decay after the warm-up", "schedule", DECAY_CHOICES)
    poly_power: float = _f(2.0, "exponent of poly decay", "schedule")
    label_smoothing: float = _f(0.0, "label smoothing of the cross-entropy loss", "schedule")
    # optimizer
    optimizer: str = _f("sgd", "optimizer", "optimizer", OPTIMIZER_CHOICES)
    momentum: float = _f(0.9, "momentum (SGD, LARS)", "optimizer")
    weight_decay: float = _f(5e-5, "weight decay (not on biases and BatchNorm)", "optimizer")
    nesterov: bool = _f(False, "Nesterov momentum (SGD, LARS)", "optimizer")
    pto: bool = _f(False, "LARS/LAMB trust ratios with PTO (each rank computes its share of layers)",
                   "optimizer")
    trust_coefficient: float = _f(0.001, "LARS trust coefficient (eta)", "optimizer")
    lars_eps: float = _f(0.0, "LARS eps in the trust ratio's denominator", "optimizer")
    # gradient communication
    comm: str = _f("allreduce", "comm method, or a schedule EPOCH:METHOD,... (e.g. 0:hitopk,13:torus); "
                   f"methods: {', '.join(METHOD_CHOICES)}; or auto: the method with the shortest step by the "
                   "cost model, with this job's links, selection cost and forward + backward measured at "
                   "start (with --overlap auto also none at once when the model gives async nothing; a "
                   "resume keeps the checkpoint's method)", "comm")
    selector: str = _f("auto", "top-k selector of the sparse methods (auto: MSTopK on the CPU, torch.topk "
                                "on CUDA, the faster of the two on each)", "comm", SELECTOR_CHOICES)
    density: float = _f(0.01, "fraction of each bucket the sparse methods send", "comm")
    error_feedback: bool = _f(True, "keep what top-k did not send and add it next step", "comm")
    fp16_comm: bool = _f(False, "float16 values on the wire", "comm")
    bucket_cap_mb: float = _f(25.0, "DDP bucket (fusion buffer) size in MB", "comm")
    overlap: str = _f("none", "when each bucket communicates: none (inside DDP's hook; backward waits, "
                      "except the plain dense all-reduce), async (on a communication thread / CUDA "
                      "side stream while backward goes on; same results bit for bit), cross (no DDP: "
                      "pieces of --bucket-cap-mb started front layers first under --comm-credit-mb per "
                      "round, each applied as it arrives while the next forward runs; CUDA on a side "
                      "stream; no --pto, --fp16-comm or fp16 AMP) or auto (none and async timed on the "
                      "first 19 steps, the faster kept and logged; with --comm auto, none without timing "
                      "when the cost model gives async nothing)", "comm", OVERLAP_CHOICES)
    comm_credit_mb: float = _f(8.0, "--overlap cross: MB of pieces one negotiation round may start "
                               "(ByteScheduler's credit: smaller lets front layers overtake sooner, at one "
                               "tiny all-reduce per round)", "comm")
    # augmentation
    augment: str = _f("rrc", "training crop: rrc (RandomResizedCrop to the resolution) or padcrop "
                      "(torchvision's RandomCrop(resolution, padding=--pad), zero fill: for small images; "
                      "one resolution)",
                      "augment", AUGMENT_CHOICES)
    pad: int = _f(4, "--augment padcrop: zero padding on each side before the random crop", "augment")
    crop_scale: float = _f(0.08, "smallest random-resized-crop area fraction (torchvision: 0.08)", "augment")
    flip: bool = _f(True, "random horizontal flips", "augment")
    val_crop_fraction: float = _f(0.875, "validation: resize to S / fraction, centre-crop S", "augment")
    mean: str = _f(IMAGENET_MEAN, "per-channel mean subtracted from the 0..1 pixels: 3 values, or 1 for all "
                   "channels", "augment")
    std: str = _f(IMAGENET_STD, "per-channel standard deviation the pixels are divided by: 3 values, or 1",
                  "augment")
    # device and precision
    device: str = _f("auto", "cuda when available, else cpu", "device", DEVICE_CHOICES)
    amp: str = _f("off", "autocast: fp16 (+GradScaler, CUDA only), bf16 (CUDA or CPU), auto (fp16 on CUDA, "
                   "off on CPU)", "device", AMP_CHOICES)
    channels_last: str = _f("auto", "channels_last memory format (auto: on CUDA)", "device", TRISTATE_CHOICES)
    threads: int = _f(0, "torch CPU threads per rank (0: leave torch's default)", "device")
    # run
    seed: int = _f(0, "seed of model init, sample order and augmentation", "run")
    out: str = _f("runs/train", "directory for metrics.jsonl and checkpoints", "run")
    checkpoint_every: int = _f(0, "also checkpoint every N steps (0: at epoch ends only)", "run")
    stop_at_step: int = _f(0, "stop after N global steps in all, with a checkpoint (0: run every epoch); "
                           "continue later with --resume auto, on any world size", "run")
    dist_timeout: float = _f(1800.0, "seconds a collective waits for the other ranks before this rank fails "
                             "(a node lost without closing its connections is noticed this way; under "
                             "torchrun --max-restarts the job then restarts on the nodes left)", "run")
    keep_checkpoints: int = _f(3, "keep the newest N checkpoints (0: all)", "run")
    resume: str = _f("", "checkpoint to resume from: a file, or 'auto' (the newest in --out)", "run")
    overwrite: bool = _f(False, "start a fresh run even if --out holds checkpoints (deletes them and "
                         "metrics.jsonl); without it such a start is refused", "run")
    val_every: int = _f(1, "validate every N epochs (0: never)", "run")
    bn_recalibrate: int = _f(0, "before each validation, recompute BatchNorm's running statistics over N "
                             "batches of training images (centre crops) per rank, averaged over the ranks, "
                             "as torch.optim.swa_utils.update_bn does (0: off; the running averages of a "
                             "young network lag its weights)", "run")
    progress: bool = _f(True, "progress bar on rank 0", "run")
    recipe: str = _f("none", "preset applied before the other flags", "run", RECIPE_CHOICES)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ConfigError(f"{f.name}={value!r}; choose one of {', '.join(choices)}")
        positive = ("short_side", "width", "epochs", "lr_ref_batch")
        non_negative = ("workers", "steps_per_epoch", "checkpoint_every", "stop_at_step", "val_every",
                        "bn_recalibrate",
                        "threads", "keep_checkpoints", "pad")
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r}; must be a positive integer")
        for name in non_negative:
            if int(getattr(self, name)) < 0:
                raise ConfigError(f"{name}={getattr(self, name)!r}; must be an integer >= 0")
        checks = {"val_fraction": 0 <= self.val_fraction < 1, "density": 0 < self.density <= 1,
                  "crop_scale": 0 < self.crop_scale <= 1,
                  "val_crop_fraction": 0 < self.val_crop_fraction <= 1,
                  "label_smoothing": 0 <= self.label_smoothing < 1, "momentum": 0 <= self.momentum < 1,
                  "weight_decay": self.weight_decay >= 0, "bucket_cap_mb": self.bucket_cap_mb > 0,
                  "comm_credit_mb": self.comm_credit_mb > 0, "dist_timeout": self.dist_timeout > 0}
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(f"{name}={getattr(self, name)!r} is out of range")
        if not 0 <= self.exchange <= 1:
            raise ConfigError(f"exchange={self.exchange!r}; must be a fraction in [0, 1] (e.g. 0.1)")
        if self.local_master:
            host, sep, port = self.local_master.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"local_master={self.local_master!r} is not host:port (e.g. 10.0.0.5:7000)")
        # parse every schedule now: a typo fails at start, on every rank alike
        _ = self.batch_schedule, self.resolution_schedule, self.comm_schedule, self.lr_schedule
        if COMM_AUTO in {v for _, v in self.comm_schedule.phases} and len(self.comm_schedule.phases) > 1:
            raise ConfigError(f"comm={self.comm!r}: auto picks one method for the whole run; use --comm auto "
                              "alone, or a schedule of methods")
        _ = self.normalization
        if self.overlap == "cross":  # each refusal names what to use instead (trainer/comm/cross_barrier.py)
            for bad, why in ((self.pto, "--pto (its trust ratios need every piece first)"),
                             (self.fp16_comm, "--fp16-comm (an fp16 sum may overflow late)"),
                             (self.amp == "fp16", "--amp fp16 (GradScaler skips all parameters at once)")):
                if bad:
                    raise ConfigError(f"--overlap cross cannot run with {why}; use --overlap async")
        if self.augment == "padcrop":
            sizes = {v for _, v in self.resolution_schedule.phases}
            if len(sizes) > 1:
                raise ConfigError(f"--augment padcrop crops one size; resolution={self.resolution!r} "
                                  "changes it (use one resolution, or --augment rrc for progressive "
                                  "resizing)")
            if self.pad >= min(sizes):
                raise ConfigError(f"pad={self.pad} must be smaller than the {min(sizes)}-px crop")

    @cached_property
    def normalization(self) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
        """``(mean, std)``, 3 values each (one given value is used for every channel)."""
        out = []
        for name in ("mean", "std"):
            text = getattr(self, name)
            try:
                values = [float(v) for v in text.split(",")]
            except ValueError:
                values = []
            if len(values) == 1:
                values *= 3
            bad = len(values) != 3 or not all(map(math.isfinite, values))
            if bad or (name == "std" and min(values) <= 0):
                raise ConfigError(f"{name}={text!r}: expected 3 comma-separated numbers (or 1 for every "
                                  f"channel){', all > 0' if name == 'std' else ''}, e.g. "
                                  f"{IMAGENET_MEAN if name == 'mean' else IMAGENET_STD}")
            out.append((values[0], values[1], values[2]))
        return out[0], out[1]

    @cached_property
    def batch_schedule(self) -> EpochSchedule[int]:
        return EpochSchedule.parse(self.batch_size, positive_int, "batch_size")

    @cached_property
    def resolution_schedule(self) -> EpochSchedule[int]:
        return EpochSchedule.parse(self.resolution, positive_int, "resolution")

    @cached_property
    def comm_schedule(self) -> EpochSchedule[str]:
        return EpochSchedule.parse(self.comm, _method, "comm")

    @cached_property
    def lr_schedule(self) -> LRSchedule:
        return LRSchedule(self.lr, self.epochs, self.warmup_epochs, self.warmup_start, self.decay,
                          self.poly_power, self.lr_scaling, self.lr_ref_batch)

    def global_batch(self, epoch: int, world_size: int) -> int:
        """Global batch size at ``epoch``; must split evenly over the ranks."""
        b = self.batch_schedule.at(epoch)
        if self.batch_per_rank:
            return b * world_size
        if b % world_size:
            raise ConfigError(f"batch_size {b} (schedule epoch {epoch}: the run's epoch {epoch + 1}) does "
                              f"not split over {world_size} ranks; "
                              f"use a multiple of {world_size} or --batch-per-rank")
        return b

    def validate_run(self, world_size: int, train_samples: int) -> None:
        """Check every schedule phase that will run against the world size and the dataset, so a
        phase that cannot run fails now, in one line, not when training reaches it hours later."""
        per_rank_samples = -(-train_samples // world_size)  # DistributedBatchSampler pads to this
        starts = sorted({s for sched in (self.batch_schedule, self.resolution_schedule, self.comm_schedule)
                         for s, _ in sched.phases if s < self.epochs})
        for epoch in starts:
            gbs = self.global_batch(epoch, world_size)  # raises when it does not split over the ranks
            per_rank = gbs // world_size
            if per_rank > per_rank_samples:
                raise ConfigError(f"batch_size {self.batch_schedule.at(epoch)} (schedule epoch {epoch}: the "
                                  f"run's epoch {epoch + 1}; global "
                                  f"{gbs} = {per_rank} per rank x {world_size} ranks) is larger than the "
                                  f"{train_samples} training samples: lower --batch-size or use more data")

    def to_dict(self) -> dict[str, Any]:
        """The config as written to the run directory (metrics, checkpoints): URLs' passwords hidden."""
        from datacache.redact import redact

        return {f.name: redact(v) if isinstance(v := getattr(self, f.name), str) else v
                for f in dataclasses.fields(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(f"unknown TrainConfig fields {unknown}; valid: {', '.join(sorted(names))}")
        return cls(**values)


RECIPES: dict[str, dict[str, Any]] = {
    "none": {},
    "dawnbench": dict(
        model="resnet50", epochs=28, resolution="0:96,13:128,24:224,27:288",
        batch_size="0:256,27:128", batch_per_rank=True, comm="0:hitopk,13:torus", selector="auto",
        density=0.01, optimizer="lars", pto=True, trust_coefficient=0.01, lars_eps=1e-6, momentum=0.9,
        weight_decay=5e-5, label_smoothing=0.1, lr=2.0, lr_scaling="linear", lr_ref_batch=256 * 128,
        warmup_epochs=2.0, warmup_start=0.01, decay="poly", poly_power=2.0, amp="auto",
        channels_last="auto"),
    "digits": dict(
        model="small_resnet_cifar", width=16, zero_init_residual=False, short_side=32, resolution="32",
        epochs=30, batch_size="64", optimizer="sgd", lr=0.1, lr_scaling="none", momentum=0.9,
        weight_decay=5e-4, warmup_epochs=1.0, decay="cosine", label_smoothing=0.1, crop_scale=0.5, flip=False,
        val_crop_fraction=1.0, workers=1),
    "fashion": dict(
        model="small_resnet_cifar", width=8, zero_init_residual=False, short_side=28, resolution="28",
        augment="padcrop", pad=4, flip=True, val_crop_fraction=1.0, mean=FASHION_MEAN, std=FASHION_STD,
        epochs=20, batch_size="256", optimizer="sgd", lr=0.2, lr_scaling="none", momentum=0.9, nesterov=True,
        weight_decay=5e-4, warmup_epochs=1.0, warmup_start=0.1, decay="cosine", label_smoothing=0.1,
        workers=1),
}


def make_config(recipe: str = "none", **overrides: Any) -> TrainConfig:
    """The recipe's values, then ``overrides`` (the explicit flags)."""
    if recipe not in RECIPES:
        raise ConfigError(f"recipe={recipe!r}; choose one of {', '.join(RECIPES)}")
    return TrainConfig(**{**RECIPES[recipe], **overrides, "recipe": recipe})
