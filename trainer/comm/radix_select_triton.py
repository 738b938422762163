"""Fused radix select (Triton): MSTopK's exact top-k of ``|x|`` on CUDA in 5 reads of ``x`` and 10 launches
at fp32, no host sync.

The same search as the pure-torch :mod:`~trainer.comm.radix_select` (AIR Top-K, Zhang et al. SC'23; RAFT's
``select_k``), with each counting pass fused into one kernel that reads ``x`` once:

1. **histogram passes** (3 at fp32: digits of 11, 10, 10 bits; 2 at fp16/bf16; 6 at fp64): every program
   computes the magnitude key from ``x``'s bits on the fly (``topk_keys.magnitude_keys``: the sign bit
   cleared), keeps the keys inside the bucket chosen so far, histograms their next digit in registers over
   a grid-stride loop of tiles and adds it to the pass's global bins with one atomic per non-empty bin;
2. **a pick** after each histogram (one program): suffix sums of the bins, the digit holding the k-th
   largest key and the rank left inside it, written to a 2-element device ``state`` that the next pass
   reads -- so the host never reads a value;
3. **an ordered compaction**: per tile, the counts of keys above the threshold ``T`` and equal to it; an
   inclusive scan of those counts (``torch.cumsum``); then each tile writes its selected positions at
   ``above-before + min(equal-before, need) + rank in tile``: every key above ``T`` and the ``need``
   lowest-index keys equal to it, ascending -- bit for bit MSTopK's result (tie and NaN rules of
   ``topk_keys.py``).

Launches at fp32: 1 ``zeros`` (the bins) + 3 histograms + 3 picks + 1 count + 1 ``cumsum`` + 1 write = 10;
reads of ``x``: 3 + 1 + 1 = 5 (the write also gathers the selected values). Every shape depends on
``(n, k, dtype)`` only, so a CUDA graph can capture the call.

Without a GPU the same kernels run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` in the
environment before triton is imported; ``tests/conftest.py`` sets it on machines without CUDA), which is how
CI tests them (``tests/test_radix_select_triton.py``). Where Triton does not
import, :data:`HAVE_TRITON` is False and the pure-torch radix select is MSTopK's device path.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from trainer.comm.radix_select import digit_widths
from trainer.comm.topk_keys import key_bits, key_dtype

# an optional dependency (CUDA torch wheels bring it; CPU-only installs get it from the test extras), imported
# only when a kernel is launched (radix_select_kernels.py): importing it costs a quarter of a second
HAVE_TRITON = importlib.util.find_spec("triton") is not None

DIGIT_BITS = 11  # bits per histogram pass: 2,048 bins (AIR Top-K's choice); fp32 keys in 3 passes
CUDA_TILE = 4096  # elements per tile on a GPU
CUDA_PROGRAMS_PER_SM = 4  # histogram programs per SM: a grid-stride loop, one atomic per bin per program
INTERPRET_TILE = 1 << 16  # the interpreter pays per program, not per element: large tiles
MAX_NUMEL = 2**31 - 1  # offsets are int32 inside the kernels (a tile past the end included)

# Debug switch: MSTopK's device path runs this select on CPU tensors too (interpreted), so tests drive the
# exact code CUDA runs through ``mstopk``; see ``topk_keys.DEVICE_PATH_ON_CPU`` for the pure-torch one.
FUSED_ON_CPU = False


def usable(x: Tensor) -> bool:
    """True when MSTopK's device path takes this select for ``x``: Triton present and ``x`` on CUDA
    (or on the CPU with :data:`FUSED_ON_CPU` set). Reads metadata only: no host sync."""
    if not HAVE_TRITON:
        return False
    if x.numel() > MAX_NUMEL - max(CUDA_TILE, INTERPRET_TILE):
        return False
    if x.device.type == "cuda":
        return not interpreting()
    return x.device.type == "cpu" and FUSED_ON_CPU and interpreting()


def _launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """Every Triton launch of this module goes through here (the tests count launches by wrapping it)."""
    kernel[grid](*args, **meta)


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1`` when triton is imported):
    then the kernels take CPU tensors and no GPU is needed (how CI tests them)."""
    triton = sys.modules.get("triton")
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"  # (not imported yet, or Triton before 3.4)


def _kernels() -> dict[str, Any]:
    """The kernels, decorated when first imported: compiled for the GPU, or interpreted when
    :func:`interpreting` (Triton's own ``tl`` helpers follow the same switch, read when triton is imported,
    so the mode cannot change within a process: the tests set it for their whole session,
    ``tests/conftest.py``)."""
    from trainer.comm import radix_select_kernels as k

    return {"histogram": k.histogram, "pick": k.pick, "count": k.count, "write": k.write}




def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def fused_topk(x: Tensor, k: int, *, tile: int | None = None, programs: int | None = None,
               launch: Callable[..., None] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(values, indices, threshold_key)``: the exact top-``k`` of ``|x|`` as MSTopK defines it (int32
    indices ascending, ties to the lowest index, NaN/inf above every finite value) and the k-th largest
    magnitude key (0-d, ``topk_keys.key_dtype``).

    ``x``: 1-D floating point, contiguous, CUDA -- or CPU, run by Triton's interpreter. ``1 <= k < len(x)``
    and ``len(x) < 2**31`` (``mstopk`` checks both and handles ``k == 0`` and ``k == n``). ``tile``:
    elements per program (default: 4,096 on a GPU, 65,536 interpreted); ``programs``: at most this many
    histogram programs, each looping over tiles (default: 4 per SM on a GPU; one per tile interpreted);
    ``launch``: replaces :func:`_launch` (tests). No host sync.
    """
    if not HAVE_TRITON:
        raise RuntimeError("fused_topk: Triton is not installed; MSTopK's pure-torch device path needs none")
    n = x.numel()
    if not 1 <= k < n:
        raise ValueError(f"fused_topk: k={k} must be in [1, {n}) (mstopk handles 0 and n)")
    tile = tile or (INTERPRET_TILE if x.device.type == "cpu" else CUDA_TILE)
    if n > MAX_NUMEL - tile:
        raise ValueError(f"fused_topk: {n} elements: at most {MAX_NUMEL - tile} (int32 offsets)")
    x = x.contiguous()
    if (x.device.type == "cpu") != interpreting():
        raise RuntimeError(f"fused_topk: a {x.device.type} tensor with Triton's interpreter "
                           f"{'on' if interpreting() else 'off'}: CUDA tensors need it off, CPU tensors need "
                           "TRITON_INTERPRET=1 in the environment before triton is imported")
    kern = _kernels()
    go = launch or _launch
    kdt = key_dtype(x.dtype)
    nbits = key_bits(x.dtype)
    bits = x.view(kdt)
    const = dict(KEY_MASK=(1 << nbits) - 1, WIDEN=x.dtype.itemsize == 2)
    tiles = -(-n // tile)
    if programs is None:
        programs = tiles if x.device.type == "cpu" else CUDA_PROGRAMS_PER_SM * _sm_count(x.device)
    programs = max(1, min(tiles, programs))
    widths = digit_widths(nbits, DIGIT_BITS)
    dev = x.device
    hist = torch.zeros(sum(1 << w for w in widths), dtype=torch.int32, device=dev)  # launch 1
    state = torch.empty(2, dtype=torch.int64, device=dev)  # [prefix -> threshold, rank -> need]
    below, at = nbits, 0
    for i, width in enumerate(widths):
        below -= width
        h = hist.narrow(0, at, 1 << width)
        at += 1 << width
        go(kern["histogram"], (programs,), bits, n, state, h, tiles, SHIFT=below, WIDTH=width,
           BINS=1 << width, FIRST=i == 0, TILE=tile, **const)
        go(kern["pick"], (1,), h, state, k, WIDTH=width, BINS=1 << width, FIRST=i == 0)
    counts = torch.empty(2 * tiles, dtype=torch.int32, device=dev)
    go(kern["count"], (tiles,), bits, n, state, counts, tiles, TILE=tile, **const)
    incl = torch.cumsum(counts.view(2, tiles), dim=1, dtype=torch.int32).view(-1)  # (n < 2**31: no overflow)
    idx = torch.empty(k, dtype=torch.int32, device=dev)
    val = torch.empty(k, dtype=x.dtype, device=dev)
    go(kern["write"], (tiles,), bits, x, n, state, counts, incl, tiles, idx, val, TILE=tile, **const)
    # the threshold key: the low bytes of state[0] (a view, no launch; every CUDA/CPU target is
    # little-endian) -- the key fits its dtype because it is one of x's keys
    thres = state.view(kdt)[0] if kdt != torch.int64 else state[0]
    return val, idx, thres
