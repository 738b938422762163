"""Which GPUs this process may decode on, learned without initialising CUDA (and without torch).

Fork hazard: the daemon forks its decode pool after it has decided which decoder family it fills. Any
CUDA driver call in the parent (``torch.cuda.is_available()`` runs ``cudaGetDeviceCount``, i.e.
``cuInit``) leaves a driver state that a forked child cannot use: the child's first CUDA call fails, so
a DALI ``mixed`` pipeline could never be built in a pool worker. NVML (``libnvidia-ml.so.1``, shipped with
the driver) counts the devices without touching CUDA -- what torch itself does with
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` -- so the probe is safe before a fork.

NVML sees every device of the machine; CUDA sees those ``CUDA_VISIBLE_DEVICES`` names, renumbered from 0.
:func:`visible_ordinals` applies CUDA's rules: comma-separated indices or (prefixes of) UUIDs, the list
ends at the first entry that names no device (so ``-1`` or ``""`` hide every GPU), a device named twice
ends it too. The result is the CUDA ordinals a worker may pass to DALI as ``device_id``.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

NVML_LIBRARY = "libnvidia-ml.so.1"


@dataclass(frozen=True)
class GpuProbe:
    """Outcome of :func:`probe_gpus`: the CUDA ordinals visible to this process, or why there are none."""

    ordinals: tuple[int, ...] = ()
    reason: str = ""  # why no GPU ("" when ordinals is not empty)

    def __bool__(self) -> bool:
        return bool(self.ordinals)


def nvml_devices(library: str = NVML_LIBRARY) -> list[str]:
    """The UUIDs of the machine's GPUs in NVML's (PCI bus) order, read through NVML; raises ``OSError``
    when the library is missing and ``RuntimeError`` when NVML answers with an error. Never initialises
    CUDA (module docstring)."""
    lib = ctypes.CDLL(library)
    rc = lib.nvmlInit_v2()
    if rc != 0:
        raise RuntimeError(f"nvmlInit_v2 returned {rc} (driver not loaded?)")
    try:
        count = ctypes.c_uint(0)
        rc = lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
        if rc != 0:
            raise RuntimeError(f"nvmlDeviceGetCount_v2 returned {rc}")
        uuids = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            buf = ctypes.create_string_buffer(96)
            if lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(handle)) != 0 \
                    or lib.nvmlDeviceGetUUID(handle, buf, ctypes.c_uint(len(buf))) != 0:
                uuids.append(f"GPU-unknown-{i}")  # still a device; only UUID selection cannot name it
            else:
                uuids.append(buf.value.decode("ascii", "replace"))
        return uuids
    finally:
        lib.nvmlShutdown()


def visible_ordinals(uuids: Sequence[str], cuda_visible_devices: str | None) -> tuple[int, ...]:
    """CUDA ordinals (0..k-1) of the devices ``CUDA_VISIBLE_DEVICES`` leaves visible among ``uuids``
    (NVML's list), by CUDA's rules (module docstring); None = the variable is unset = every device."""
    if cuda_visible_devices is None:
        return tuple(range(len(uuids)))
    chosen: list[int] = []
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        index = _device_of(entry, uuids)
        if index is None or index in chosen:
            break  # CUDA stops at the first entry that names no (new) device
        chosen.append(index)
    return tuple(range(len(chosen)))


def _device_of(entry: str, uuids: Sequence[str]) -> int | None:
    if entry.isdigit():
        i = int(entry)
        return i if i < len(uuids) else None
    if entry.startswith(("GPU-", "MIG-")) and len(entry) > 4:
        hits = [i for i, u in enumerate(uuids) if u.startswith(entry)]
        return hits[0] if len(hits) == 1 else None  # an ambiguous prefix names no device
    return None


def probe_gpus(devices: Callable[[], list[str]] | None = None,
               environ: Mapping[str, str] | None = None) -> GpuProbe:
    """The GPUs this process may decode on (module docstring); never raises. ``devices``: NVML's device
    list (default :func:`nvml_devices`)."""
    env = os.environ if environ is None else environ
    try:
        uuids = (devices or nvml_devices)()
    except (OSError, RuntimeError, AttributeError) as e:  # no driver / no NVML / an old NVML
        return GpuProbe(reason=f"NVML cannot list GPUs ({NVML_LIBRARY}: {type(e).__name__}: "
                               f"{str(e)[:160]})")
    if not uuids:
        return GpuProbe(reason="NVML lists no GPU on this machine")
    ordinals = visible_ordinals(uuids, env.get("CUDA_VISIBLE_DEVICES"))
    if not ordinals:
        return GpuProbe(reason=f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r} hides all "
                               f"{len(uuids)} GPUs")
    return GpuProbe(ordinals=ordinals)
