"""Device half of the split augmentation: resize, flip and normalise a whole batch of crop windows.

The loader workers only cut windows (:mod:`client.crop`); here a :class:`~client.crop.CropBatch`
becomes the model's input ``float [B, 3, S, S]`` in a few batched tensor ops on whatever device
the batch is on:

* ``"matmul"``: the resize is separable, so each axis is one matrix product per sample:
  ``out = Wy @ X @ Wx^T`` with ``Wy [B, S, Hp]`` / ``Wx [B, S, Wp]`` built for the whole batch
  at once (:func:`axis_weights`). Their entries are Pillow's bilinear filter *with* Pillow's
  antialiasing (the triangle's support widens to the downscale factor), so the result is what
  ``PIL.Image.resize(..., BILINEAR)`` gives for the same box -- unlike ``affine_grid`` +
  ``grid_sample``, which samples 4 pixels per output and aliases when shrinking a 160-px crop
  to 64. Sampling is clamped to each window (rows/columns past ``h_k``/``w_k`` get weight 0,
  as Pillow renormalises at an image edge); fractional boxes (validation's resize-then-centre-
  crop) are exact. A flip reverses the rows of ``Wx``: free. Two batched GEMMs: nothing on a
  GPU, but dense, so on a CPU they are slow where the band of non-zero weights is only a few
  wide (bench/results/NOTES.md#device-augment). On a device the whole augmentation is a fixed
  ~45 kernel launches whatever the batch size (:func:`_resize_matmul_device`; the CPU path's
  memory-bounding chunks and groups would be ~700 launches for 256 images).
* ``"interpolate"``: per sample, torch's uint8 antialiased bilinear kernel (the same filter,
  rounding to uint8 between its two passes as Pillow does) writes into the batch
  (:func:`client.augment.resize_crops`; bench/results/NOTES.md#device-augment). CPU batches only: on a
  GPU it would need a device -> host read of the window sizes and one kernel launch per sample
  (and CUDA's antialiased upsample may not take uint8), so a device batch is refused with one
  line. Boxes must be whole windows (training batches, ``size == 0``).
* ``"place"``: boxes at scale 1 with whole-pixel corners (pad-and-crop batches,
  :class:`client.crop.PadCropCollate`): each window is copied into its slot of a zeroed uint8
  batch at the box's offset (numpy views, one copy per sample), flipped in place. No resampling at
  all; the matmul path gives the same pixels (its weights are exactly 0 and 1 there) at several
  times the cost on a CPU. CPU batches only, for the same reason as ``"interpolate"``.
* ``"auto"`` (default): on the CPU ``"interpolate"`` for training batches and ``"place"`` for
  scale-1 boxes, ``"matmul"`` otherwise (CUDA, and fractional validation boxes).

Normalisation ``(x / 255 - mean) / std`` follows, and the batch leaves in the requested memory
format (channels_last for convolutions on a GPU). Uint8 batches that are already the output
size (a loader that resized on the host) are only converted and normalised.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from client.augment import _new_batch, resize_crops
from client.crop import _FLIP, _H, _Y0, CropBatch, device_path

METHOD_CHOICES = ("auto", "matmul", "interpolate", "place")
# resize_matmul converts the uint8 batch to float in this many groups of samples: on the CPU
# (MATMUL_GROUPS) to bound the float copies' memory (bench/augment_memory.py); on a device
# (DEVICE_MATMUL_GROUPS) every group costs 3 more kernel launches, and the float copy (4 bytes per
# byte of the padded batch, per group) is small next to a GPU's memory: 2 groups halve it.
MATMUL_GROUPS = 8
DEVICE_MATMUL_GROUPS = 2
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def axis_weights(start: Tensor, extent: Tensor, window: Tensor, n_out: int, n_in: int,
                 flip: Tensor | None = None) -> Tensor:
    """Resampling matrices ``[..., n_out, n_in]`` (float32) of Pillow's antialiased bilinear filter,
    one per entry of ``start``/``extent``/``window`` (same shape: ``[B]``, or ``[B, 2]`` for both
    axes of a batch at once).

    Output pixel ``o`` of sample ``b`` is centred at ``start[b] + (o + 0.5) * scale`` in input
    pixels, ``scale = extent / n_out``; input pixel ``i`` (centre ``i + 0.5``) weighs
    ``max(0, 1 - |i + 0.5 - centre| / fs)`` with ``fs = max(scale, 1)`` (Pillow's
    ``precompute_coeffs`` for the triangle filter), only for ``i < window[b]``; each row is
    normalised to sum 1. ``flip[b]`` reverses the output order (a horizontal flip): row ``o`` is
    computed at output position ``n_out - 1 - o`` (``(n_out - 0.5) - o``, exact in float32), the
    same numbers as reversing the rows afterwards, without a flipped copy.
    """
    dev = start.device
    start = start.to(torch.float32)
    scale = extent.to(torch.float32) / n_out
    fs = scale.clamp(min=1.0)
    # unsqueeze rather than Python indexing: the same ops, and they also run on fake CUDA tensors
    # (tests/test_fake_cuda.py checks the device placement of this path without a GPU).
    # arange(0.5, n) is o + 0.5 exactly (halves are exact in float32)
    out_pos = torch.arange(0.5, n_out, device=dev, dtype=torch.float32)
    if flip is not None:
        reverse = torch.arange(n_out - 0.5, 0.0, -1.0, device=dev, dtype=torch.float32)
        out_pos = torch.where(flip.to(dev).unsqueeze(-1), reverse, out_pos)
    centre = start.unsqueeze(-1) + out_pos * scale.unsqueeze(-1)
    pos = torch.arange(0.5, n_in, device=dev, dtype=torch.float32)
    # in place after the subtraction: one [..., n_out, n_in] tensor alive, not two (-a + 1 is 1 - a exactly)
    w = (pos - centre.unsqueeze(-1)).abs_().div_(fs.unsqueeze(-1).unsqueeze(-1))
    w.neg_().add_(1.0).clamp_(min=0.0)
    w.mul_(pos < window.to(device=dev, dtype=torch.float32).unsqueeze(-1).unsqueeze(-1))
    w.div_(w.sum(dim=-1, keepdim=True).clamp_(min=1e-12))
    return w


def resize_matmul(batch: CropBatch, size: int) -> Tensor:
    """Resize (and flip) every box of ``batch`` to ``size x size``: float32 ``[B, 3, S, S]`` in
    pixel units (0..255, not rounded), on the batch's device. Two batched GEMMs.

    A device batch (:func:`client.crop.device_path`) takes :func:`_resize_matmul_device`: the same
    filter in ~40 kernel launches whatever the batch size (tests/test_gpu_budgets.py), its result
    laid out ``[B, S(x), 3, S(y)]`` (a strided view; :class:`DeviceAugment` writes the final
    layout while normalising)."""
    if device_path(batch.pixels):
        return _resize_matmul_device(batch, size)
    pix = batch.padded()  # [B, Hmax, Wmax, 3]
    n, hp, wp, _ = pix.shape
    b, win = batch.boxes, batch.windows
    wy = axis_weights(b.select(1, 0), b.select(1, 1), win.select(1, 0), size, hp)
    wx = axis_weights(b.select(1, 2), b.select(1, 3), win.select(1, 1), size, wp, flip=batch.flips)
    # Both passes run for MATMUL_GROUPS groups of samples in turn (every product is per sample, so
    # the result is the same): the float copy of the uint8 input, the vertical pass's rows and the
    # broadcast of the horizontal pass exist for one group at a time, not for the whole batch
    # (peak tensor bytes: bench/augment_memory.py).
    flat = pix.reshape(n, hp, wp * 3)
    out = torch.empty((n, 3, size, size), dtype=torch.float32, device=pix.device)
    group = max(1, -(-n // MATMUL_GROUPS))
    for s0 in range(0, n, group):
        k = min(group, n - s0)
        # vertical pass on the HWC buffer as [k, Hp, Wp*3]: no permute of the big input
        rows = torch.bmm(wy.narrow(0, s0, k), flat.narrow(0, s0, k).to(torch.float32))  # [k, S, Wp*3]
        rows = rows.view(k, size, wp, 3).permute(0, 3, 1, 2)                             # [k, 3, S, Wp]
        torch.matmul(rows, wx.narrow(0, s0, k).transpose(1, 2).unsqueeze(1), out=out.narrow(0, s0, k))
    return out                                                                        # [B, 3, S, S]


def _resize_matmul_device(batch: CropBatch, size: int) -> Tensor:
    """:func:`resize_matmul` for a device batch: a fixed, small number of kernel launches.

    The augmentation runs right after the step's host sync while the GPU idles, so every launch
    is latency on the step (the CPU path's ~60 chunks of :meth:`CropBatch.padded` plus 8 groups of
    the GEMMs were ~900 ops for 256 images). Here: the padding is one row gather (12 ops); both
    axes' weights are ONE :func:`axis_weights` call over ``[B, 2]`` (``n_in = max(hmax, wmax)``:
    the extra input columns lie past every window and weigh exactly 0, so each axis' matrix is a
    narrow view of the same values); the vertical pass computes the TRANSPOSED rows
    ``[k, Wp*3, S]`` (``X^T @ Wy^T``, transposes as BLAS strides, no copy), which are already the
    ``[k, Wp, 3*S]`` operand the horizontal pass needs, so there is no permute copy between the
    passes. The output ``[B, S(x), 3, S(y)]`` is returned as a ``[B, 3, S, S]`` view; the
    normalisation writes it out in the requested memory format (channels_last: one pass). The
    sums are the CPU path's in another order (equal within float rounding).
    Memory (GPU): besides the padded uint8 batch and the float32 output, the float copy of the
    padded input (4 bytes per pixel byte) per group of :data:`DEVICE_MATMUL_GROUPS`, the rows
    ``[k, Wp*3, S]`` and the weights ``[B, 2, S, max(hmax, wmax)]`` float32: more transient memory
    than the CPU path's :data:`MATMUL_GROUPS` groups (measured by ``bench/augment_memory.py``'s
    meter with ``client.crop.DEVICE_PATH_ON_CPU``), traded for a fixed number of launches."""
    pix = batch.padded()  # [B, Hmax, Wmax, 3]
    n, hp, wp, _ = pix.shape  # HAZARD (host/device): host ints from shapes only; meta stays on the device
    dev = pix.device
    # One float32 copy of the columns the weights need: window (h, w), box (y0, y_ext, x0, x_ext)
    # and flip (whole numbers and the boxes' float64 values, converted as axis_weights would).
    mf = batch.meta.narrow(1, 0, _FLIP + 1).to(torch.float32)
    box = mf.narrow(1, _Y0, 4).view(n, 2, 2)                            # [B, axis (y, x), (start, extent)]
    # flip flags [B, 2]: (False, flip_b); 0 * flip for the vertical axis
    flip = (torch.arange(2, device=dev, dtype=torch.float32) * mf.narrow(1, _FLIP, 1)) > 0.5
    w = axis_weights(box.select(2, 0), box.select(2, 1), mf.narrow(1, _H, 2), size, max(hp, wp), flip=flip)
    wy = w.select(1, 0).narrow(2, 0, hp)                                # [B, S, Hp]
    wx = w.select(1, 1).narrow(2, 0, wp)                                # [B, S, Wp]
    flat = pix.view(n, hp, wp * 3)
    out = torch.empty((n, size, 3 * size), dtype=torch.float32, device=dev)  # [B, S(x), (3, S(y))]
    group = max(1, -(-n // DEVICE_MATMUL_GROUPS))
    for s0 in range(0, n, group):
        k = min(group, n - s0)
        xf = flat.narrow(0, s0, k).to(torch.float32)                              # [k, Hp, Wp*3]
        rows_t = torch.bmm(xf.transpose(1, 2), wy.narrow(0, s0, k).transpose(1, 2))  # [k, Wp*3, S(y)]
        torch.bmm(wx.narrow(0, s0, k), rows_t.view(k, wp, 3 * size), out=out.narrow(0, s0, k))
        del xf, rows_t  # freed before the next group's copy, not after it
    return out.view(n, size, 3, size).permute(0, 2, 3, 1)                      # [B, 3, S(y), S(x)] view


def resize_interpolate(batch: CropBatch, size: int) -> Tensor:
    """Resize (and flip) every whole window of ``batch`` with torch's uint8 antialiased kernel,
    one call per sample: uint8 channels_last ``[B, 3, S, S]``. Training batches on the CPU only:
    per-sample window sizes are host values, and a device batch would need a device -> host read
    of its ``meta`` (plus one kernel launch per sample, and CUDA's antialiased kernel may not take
    uint8); such a batch is refused with one line -- use ``matmul``."""
    if batch.pixels.device.type != "cpu":
        raise ValueError(f"DeviceAugment(method='interpolate') runs on CPU batches only, this one is on "
                         f"{batch.pixels.device}; use method='matmul' (or 'auto', which picks it there)")
    if batch.size != 0:
        raise ValueError("resize_interpolate needs whole-window boxes (training batches, size 0); "
                         "use resize_matmul for validation batches")
    views = batch.views()  # [h, w, 3] views of the packed windows
    images = [v.permute(2, 0, 1) for v in views]
    boxes = [(0, 0, int(v.shape[0]), int(v.shape[1])) for v in views]
    out = _new_batch(len(images), size)
    return resize_crops(images, boxes, batch.flips.tolist(), size, out=out)


def is_placement(batch: CropBatch, size: int) -> bool:
    """Whether every box of a CPU batch is ``size`` pixels at scale 1 with whole-pixel corners (reads
    ``meta``: a host read, so CPU batches only)."""
    if batch.pixels.device.type != "cpu" or batch.size != size:
        return False
    b = batch.boxes
    ext = b.narrow(1, 1, 1), b.narrow(1, 3, 1)
    starts = b.narrow(1, 0, 1), b.narrow(1, 2, 1)
    return bool(all((e == size).all() for e in ext) and all((s == s.round()).all() for s in starts))


def place_windows(batch: CropBatch, size: int) -> Tensor:
    """Pad-and-crop batches on the CPU (see ``"place"`` in the module docstring): uint8
    channels_last ``[B, 3, S, S]``, zero where a box lies outside its window."""
    if not is_placement(batch, size):
        raise ValueError(f"DeviceAugment(method='place') needs a CPU batch of {size}-px boxes at scale 1 "
                         "with whole-pixel corners (pad-and-crop batches); use method='matmul'")
    out = torch.zeros((len(batch), size, size, 3), dtype=torch.uint8)
    dst = out.numpy()
    sizes = batch.windows.tolist()                                                         # (h, w)
    corners = batch.boxes.index_select(1, torch.tensor([0, 2])).to(torch.int64).tolist()  # (y0, x0)
    flips = batch.flips.tolist()
    for k, (win, (h, w), (y0, x0), flip) in enumerate(zip(batch.views(), sizes, corners, flips)):
        # output pixel o shows window pixel (y0 + o): negative y0 (a pad-crop box starting in the
        # padding) leaves the first -y0 rows zero, positive y0 skips the window's first rows
        (oy, wy, ny), (ox, wx, nx) = ((max(0, -a), max(0, a), min(size - max(0, -a), n - max(0, a)))
                                      for a, n in ((y0, h), (x0, w)))
        if ny > 0 and nx > 0:
            dst[k, oy:oy + ny, ox:ox + nx] = win.numpy()[wy:wy + ny, wx:wx + nx]
        if flip:
            dst[k] = dst[k, :, ::-1].copy()
    return out.permute(0, 3, 1, 2)  # [B, 3, S, S] channels_last view


class DeviceAugment:
    """Batches -> normalised model input on the batch's device (see the module docstring).

    ``mean``/``std`` per channel (0..1 units; ImageNet's by default), ``method`` one of
    :data:`METHOD_CHOICES`, ``memory_format`` of the output, ``dtype`` of the output.
    Call with a :class:`~client.crop.CropBatch` (or a ``(uint8 [B,3,S,S], labels)`` pair) and
    the output size; returns ``(x, labels)``.
    """

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD, *,
                 method: str = "auto", memory_format: torch.memory_format = torch.contiguous_format,
                 dtype: torch.dtype = torch.float32) -> None:
        if method not in METHOD_CHOICES:
            raise ValueError(f"DeviceAugment method={method!r}; choose one of {', '.join(METHOD_CHOICES)}")
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise ValueError(f"mean and std need 3 values each, std > 0; got {mean!r}, {std!r}")
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.method = method
        self.memory_format = memory_format
        self.dtype = dtype
        self._consts: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def method_for(self, batch: CropBatch) -> str:
        if self.method != "auto":
            return self.method
        cpu = batch.pixels.device.type == "cpu"
        if cpu and batch.size == 0:
            return "interpolate"
        return "place" if cpu and is_placement(batch, batch.size) else "matmul"

    def _normalise(self, x: Tensor) -> Tensor:
        dev = x.device
        if dev not in self._consts:
            # HAZARD (host -> device): two small uploads, once per device (cached), never per batch
            mul = torch.tensor([1.0 / (255.0 * s) for s in self.std], device=dev).view(1, 3, 1, 1)
            sub = torch.tensor([m / s for m, s in zip(self.mean, self.std)], device=dev).view(1, 3, 1, 1)
            self._consts[dev] = (mul, sub)
        mul, sub = self._consts[dev]
        # (x / 255 - mean) / std, float32: the multiply converts (uint8 or float32 input) AND writes
        # the requested memory format in the same pass (the resize's output may be any strided
        # view), so no separate float copy or layout copy
        out = torch.empty_like(x, dtype=torch.float32, memory_format=self.memory_format)
        torch.mul(x, mul, out=out).sub_(sub)
        return out if self.dtype == torch.float32 else out.to(self.dtype)

    def resize(self, batch: CropBatch, size: int) -> Tensor:
        """The resized, flipped batch in pixel units (float32 or uint8), before normalisation."""
        if batch.size not in (0, size):
            raise ValueError(f"this batch was cut for output size {batch.size}, not {size} "
                             "(a validation loader is made for one size)")
        method = self.method_for(batch)
        if method == "interpolate":
            return resize_interpolate(batch, size)
        if method == "place":
            return place_windows(batch, size)
        return resize_matmul(batch, size)

    def __call__(self, batch: CropBatch | tuple[Tensor, Tensor], size: int) -> tuple[Tensor, Tensor]:
        if isinstance(batch, CropBatch):
            return self._normalise(self.resize(batch, size)), batch.labels
        images, labels = batch
        if images.dtype != torch.uint8 or images.dim() != 4 or tuple(images.shape[1:]) != (3, size, size):
            raise ValueError(f"expected a CropBatch or uint8 [B, 3, {size}, {size}] images, got "
                             f"{images.dtype} {tuple(images.shape)}")
        return self._normalise(images), labels
