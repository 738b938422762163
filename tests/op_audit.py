"""Dispatcher-level audits used by the comm tests on a machine without a GPU.

``SyncAudit``: records every aten op that needs the host to read device data -- the ops that
are a host/device sync on CUDA (``.item()``/``bool()``/``int()`` of a tensor, ``nonzero``,
boolean-mask indexing, ``unique``, ``masked_select``, ``repeat_interleave`` without an output
size, ``bincount``, ``equal``...). Run the CUDA code path on CPU tensors under it (see
``trainer.comm.topk_keys.DEVICE_PATH_ON_CPU``): an empty ``found`` list means the code would
not sync on CUDA. This list is the reference the tests rely on; ``torch.cuda.set_sync_debug_mode``
is the check on a real GPU.

``ScatterAudit``: records every accumulating scatter (``index_add``, ``index_put`` with
``accumulate=True``, ``scatter_add``, ``scatter_reduce``) into a FLOATING-POINT tensor whose index
has DUPLICATES: on CUDA those sums run as atomics in an unspecified order, so the float result
differs from run to run and from rank to rank. Integer sums (the radix select's int32 histogram)
are exact in any order and not recorded.

``OpCount``: counts every aten op run inside the ``with`` block and, separately, the ops that
would LAUNCH device work on CUDA (a kernel or a copy): the per-batch launch budgets of
``tests/test_gpu_budgets.py`` are counted with it on a machine without a GPU (the CUDA code
path runs on fake CUDA tensors or, forced, on CPU tensors; the aten ops are the same).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_SYNC_OPS = {
    aten._local_scalar_dense.default,  # .item(), bool(t), int(t), float(t)
    aten.nonzero.default,
    aten.nonzero.out,
    aten.masked_select.default,
    aten.unique_dim.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten.allclose.default,
    aten.repeat_interleave.Tensor,
}


def _name(func: Any) -> str:
    return str(getattr(func, "__name__", func))


class SyncAudit(TorchDispatchMode):
    """Collect the names of host-syncing ops run inside the ``with`` block."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNC_OPS:
            self.found.append(_name(func))
        elif func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
            # boolean-mask indexing expands the mask with nonzero (a sync); integer indices do not
            idx = args[1]
            if any(t is not None and t.dtype == torch.bool for t in idx):
                self.found.append(_name(func) + "(bool mask)")
        return func(*args, **kwargs)


_SCATTERS = {
    aten.index_add_.default: 2, aten.index_add.default: 2, aten.index_add.out: 2,
    aten.scatter_add_.default: 2, aten.scatter_add.default: 2,
    aten.scatter_reduce_.two: 2, aten.scatter_reduce.two: 2,
}


class ScatterAudit(TorchDispatchMode):
    """Collect accumulating scatters whose index holds duplicates (order-dependent on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.with_duplicates: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pos = _SCATTERS.get(func)
        index = None
        if pos is not None:
            index = args[pos]
        elif func in (aten.index_put_.default, aten.index_put.default) and (
                kwargs.get("accumulate") or (len(args) > 3 and args[3])):
            index = args[1][0]
        if index is not None and args[0].is_floating_point():  # (integer sums: any order, one result)
            self.calls += 1
            flat = index.reshape(-1)
            if torch.unique(flat).numel() != flat.numel():
                self.with_duplicates.append(_name(func))
        return func(*args, **kwargs)


# Ops that allocate or re-describe memory without running a kernel. Everything else counts as a
# launch, conversions included: ``_to_copy`` (a dtype or device change) and ``copy_`` are kernels
# (``Tensor.to`` to the same dtype/device/format dispatches nothing at all), and so are the fills of
# ``zeros``/``full``/``arange``. ``_unsafe_view`` is the metadata half of ``reshape``'s copy (the
# copy itself is counted as ``clone``). ``_local_scalar_dense`` is counted: a device -> host copy
# (and a sync, which ``SyncAudit`` reports).
_METADATA_OPS = {
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
    aten.new_empty.default, aten.new_empty_strided.default, aten._unsafe_view.default,
    aten.set_.source_Storage_storage_offset, aten.resize_.default,
}


def launches(func: Any) -> bool:
    """Whether aten op ``func`` launches device work on CUDA: not a view or alias (``is_view``:
    ``view``/``reshape``-as-view/``narrow``/``select``/``permute``/``transpose``/``unsqueeze``/
    ``expand``/``as_strided``/``unfold``/``detach``/``lift_fresh``...), not an allocation only."""
    return not getattr(func, "is_view", False) and func not in _METADATA_OPS


class OpCount(TorchDispatchMode):
    """Count the aten ops run inside the ``with`` block: ``total`` (every aten op; ``prim`` queries
    such as ``Tensor.device`` under fake tensors are not ops and not counted), ``launching`` (the
    ones :func:`launches` says run device work), ``by_op`` (launching ops by name).

    HAZARD (mode order): under ``FakeTensorMode`` the tests enter this mode INSIDE the fake one
    (``with FakeTensorMode(), OpCount():``): the innermost mode sees each op first, exactly as the
    program calls it, before the fake mode handles it (outside, it could also count ops that a
    fake-mode decomposition runs; on the augmentation both orders count the same with torch 2.13).
    Dispatch modes are thread-local: run the counted code on this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.launching = 0
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", "aten") != "aten":  # prim.device etc.: a Python-side metadata query
            return func(*args, **(kwargs or {}))
        self.total += 1
        if launches(func):
            self.launching += 1
            self.by_op[_name(func)] += 1
        return func(*args, **(kwargs or {}))

    def summary(self) -> str:
        """One line: the counts and the launching ops, most frequent first."""
        ops = ", ".join(f"{name} x{n}" for name, n in self.by_op.most_common())
        return f"{self.launching} launching of {self.total} ops: {ops}"


# Fused on CUDA even when a later list holds 0-d tensors (measured with the profiler on an H100,
# torch 2.11: _foreach_addcmul_ over ResNet-50's 161 tensors with a list of 0-d scales ran 4 kernels).
_FOREACH_SCALE_LIST_OK = ("_foreach_addcmul", "_foreach_addcdiv")


class ForeachShapeAudit(TorchDispatchMode):
    """Collect ``torch._foreach_*`` calls that CUDA runs one kernel per tensor instead of fused.

    CUDA's multi-tensor kernels need every tensor list of a call to match the first one element by
    element (shape, dtype, device); otherwise the op falls back to a loop over the tensors -- one launch
    each (a ``_foreach_mul_`` of ResNet-50's 161 tensors by a list of 0-d trust ratios: 161 kernels,
    against 3 with matching lists, measured on an H100). The CPU runs every foreach op as a loop, so this
    is only visible here, by shape: ``slow`` lists ``"op: first shape vs other shape"``. addcmul/addcdiv
    with 0-d scale lists are exempt (measured fused)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.slow: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = _name(func)
        if name.startswith("_foreach_"):
            self.calls += 1
            lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
            exempt = name.startswith(_FOREACH_SCALE_LIST_OK)
            for other in lists[1:]:
                for x, y in zip(lists[0], other):
                    if x.shape != y.shape and not (exempt and y.dim() == 0):
                        self.slow.append(f"{name}: {tuple(x.shape)} vs {tuple(y.shape)}")
                        break
        return func(*args, **(kwargs or {}))
