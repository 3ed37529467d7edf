"""Operators that make the host wait for the device, or copy host data to it, found as code runs.

A step on a GPU runs at the device's pace only while the host never waits for it: every layer reads
what it needs of the micro-batch from tensors already on the device
(:meth:`~megatron_paradyse.core.layout.SequenceLayout.indices`, asked for once per micro-batch before the
model runs). :class:`HostSyncs` is a dispatch mode that records, for one device, every operator that
breaks this:

- one that copies between the device and elsewhere (``host.to(device)``, ``torch.tensor(list,
  device=...)``, ``.cpu()``): a pageable copy waits for the device;
- one that reads a host tensor beside device tensors (a 0-dim host tensor excepted: torch hands its
  value to the kernel as a number);
- one whose result the host must read before it can go on (``.item()``, ``.tolist()``, ``nonzero``,
  ``masked_select``, indexing with a boolean mask: torch tags them ``data_dependent_output`` or
  ``dynamic_output_shape``; indexing with integer tensors, tagged alike, reads nothing back).

On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` is the authority; this mode needs no GPU: on a CPU
machine the ``meta`` device stands in for it (tensors without data, on a device that is not the host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
import warnings
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["HostSync", "HostSyncs", "cuda_sync_debug", "wait_for_device", "watch_host_syncs"]

_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}
_HOST_READS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_TORCH = os.path.dirname(torch.__file__)


@dataclasses.dataclass(frozen=True)
class HostSync:
    """One operator :class:`HostSyncs` found."""

    op: str
    reason: str
    where: str
    """The innermost caller outside torch (``file:line in function``)."""

    def __str__(self) -> str:
        return f"{self.op}: {self.reason} (at {self.where})"


class HostSyncs(TorchDispatchMode):
    """``with HostSyncs(device) as syncs: step()``, then ``syncs.found``: the operators that copied
    between ``device`` and the host, read host tensors beside device ones, or returned data the host
    reads (module docstring), in the order they ran, backward included."""

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.found: list[HostSync] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = [self._on_device(t.device) for t in inputs]
        if func in _COPIES:
            source, target = _copy_ends(func, args, kwargs)
            if source.type != target.type and self.device.type in (source.type, target.type):
                self._record(func, f"copies from {source.type} to {target.type}")
        elif any(on_device) and _host_reads(func, args):
            self._record(func, "the host reads its result from the device")
        elif any(on_device) and any(not d and t.dim() > 0 for t, d in zip(inputs, on_device)):
            where = sorted({t.device.type for t, d in zip(inputs, on_device) if not d})
            self._record(func, f"reads a tensor on {', '.join(where)} beside {self.device.type} tensors")
        return func(*args, **kwargs)

    def _on_device(self, device: torch.device) -> bool:
        return device.type == self.device.type

    def _record(self, func, reason: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-2] if not f.filename.startswith(_TORCH)]
        where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "?"
        self.found.append(HostSync(str(func), reason, where))


def _host_reads(func, args) -> bool:
    """Whether the host reads ``func``'s result before it can go on: an operator torch tags as data-dependent,
    except indexing with integer indices, whose result's shape is theirs (only a boolean mask's is read)."""
    if not any(tag in func.tags for tag in _HOST_READS):
        return False
    if func is torch.ops.aten.index.Tensor:
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return True


@contextlib.contextmanager
def cuda_sync_debug(mode: str = "error") -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode(mode)`` inside the block (``"error"``: a host synchronisation
    raises; ``"warn"``: it warns), the default mode after it."""
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def watch_host_syncs(device: torch.device) -> Iterator[list[str]]:
    """``with watch_host_syncs(device) as syncs: work()``, then ``syncs``: each host synchronisation of the
    block, with where it happened. On CUDA, what ``torch.cuda.set_sync_debug_mode("warn")`` warns of (the
    authority); elsewhere the operators :class:`HostSyncs` finds (on the CPU, where the device is the host,
    those whose result the host reads: what would wait for a GPU)."""
    found: list[str] = []
    if device.type != "cuda":
        with HostSyncs(device) as watch:
            yield found
        found.extend(map(str, watch.found))
        return
    with warnings.catch_warnings(record=True) as caught, cuda_sync_debug("warn"):
        warnings.simplefilter("always")
        yield found
    # the mode also warns, once, that it is a prototype ("... synchronizing operations"): not a sync
    found.extend(
        f"{w.message} (at {w.filename}:{w.lineno})"
        for w in caught
        if "called a synchronizing CUDA operation" in str(w.message)
    )


def _copy_ends(func, args, kwargs) -> tuple[torch.device, torch.device]:
    """(source, target) device of ``aten._to_copy(src, device=...)`` or ``aten.copy_(dst, src)``."""
    if func is torch.ops.aten._to_copy.default:
        source = args[0].device
        target = kwargs.get("device")
        return source, source if target is None else torch.device(target)
    return args[1].device, args[0].device


def wait_for_device(device: torch.device) -> None:
    """Make the host wait until ``device`` has run what was queued on it (the measurements' deliberate
    wait, around a timed window); nothing on the host, whose work is done when its call returns."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
