"""Activation offload: a recomputed layer's input waits for the backward in host memory.

A recomputed layer keeps only its ``[s/p, b, h]`` input from its forward to its backward (the recompute
checkpoint). With offload, the checkpoint saves that input through :class:`ActivationOffload`'s
saved-tensor hooks: the forward copies it to (pinned) host memory, and the device copy dies with the
last reference to it; the backward brings it back when the recompute needs it. The copies run on a side
stream, so they overlap the layers' compute: the device-to-host copy behind the layer's own forward,
and the copy back prefetched: bringing one layer's input back starts bringing back the input of the
offloaded layer whose backward comes next, behind this layer's backward.

One :class:`ActivationOffload` serves one micro-batch (:class:`~megatron_paradyse.core.micro_batch.MicroBatch`
makes it), so micro-batches in flight together (pipeline schedules) each prefetch their own. On CPU the
"host" copy is a copy in the same memory, made under :func:`~megatron_paradyse.core.memory.host_memory`
so the CPU memory tracker counts it apart, as CUDA's allocator does not count pinned host memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import Tensor

from megatron_paradyse.core.memory import host_memory

__all__ = ["ActivationOffload"]


@dataclasses.dataclass(slots=True)
class _Offloaded:
    """One saved input: its host copy until the backward brings it back."""

    host: Tensor | None
    device: torch.device
    stored: torch.cuda.Event | None
    """Recorded after the device-to-host copy (CUDA)."""
    fetched: Tensor | None = None
    """The copy brought back ahead of use (prefetched), until it is used."""
    arrived: torch.cuda.Event | None = None
    """Recorded after the host-to-device copy of ``fetched`` (CUDA)."""


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream host copies of ``device`` run on (one per device, for the process)."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


class ActivationOffload:
    """Saved-tensor hooks that keep what they save in host memory (see the module docstring).

    ``with offload.hooks(): checkpoint(...)``: the tensors the checkpoint saves (the layer's input) go to
    host memory; :attr:`host_bytes` counts what is there now, :attr:`host_peak_bytes` the most there was.
    """

    def __init__(self) -> None:
        # by handle, numbered in forward order (the backward brings them back in reverse); dropped once back
        self._saved: dict[int, _Offloaded] = {}
        self._stored = 0
        self.host_bytes = 0
        self.host_peak_bytes = 0

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.store, self.restore):
            yield

    def store(self, x: Tensor) -> int:
        """Start copying ``x`` to host memory; the handle :meth:`restore` takes."""
        if x.device.type == "cuda":
            stream = _copy_stream(x.device)
            stream.wait_stream(torch.cuda.current_stream(x.device))  # x is written
            with torch.cuda.stream(stream):
                host = torch.empty_like(x, device="cpu", pin_memory=True)
                host.copy_(x, non_blocking=True)
                stored = torch.cuda.Event()
                stored.record(stream)
            x.record_stream(stream)  # the allocator may not hand out x's memory before the copy has read it
        else:
            with host_memory():
                host = x.detach().clone()
            stored = None
        self._saved[self._stored] = _Offloaded(host, x.device, stored)
        self._stored += 1
        self.host_bytes += host.nbytes
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
        return self._stored - 1

    def restore(self, index: int) -> Tensor:
        """``x`` back on its device (once), and the copy back of the one stored before it started."""
        entry = self._saved.pop(index, None)
        if entry is None:
            raise RuntimeError(
                "an offloaded activation is brought back once, for its layer's recompute; a second backward "
                "through it (retain_graph=True) needs the layer without offload ('+rc', not '+rc+off')"
            )
        if entry.fetched is None:
            self._fetch(entry)
        x, entry.fetched = entry.fetched, None
        if entry.arrived is not None:
            current = torch.cuda.current_stream(x.device)
            current.wait_event(entry.arrived)
            x.record_stream(current)  # made on the copy stream, used and freed on this one
        previous = self._saved.get(index - 1)
        if previous is not None and previous.fetched is None:
            self._fetch(previous)  # the next backward's input, behind this backward
        return x

    def _fetch(self, entry: _Offloaded) -> None:
        """Start bringing ``entry`` back to its device; its host copy is released."""
        host, entry.host = entry.host, None
        if entry.device.type == "cuda":
            stream = _copy_stream(entry.device)
            stream.wait_event(entry.stored)
            with torch.cuda.stream(stream):
                entry.fetched = torch.empty_like(host, device=entry.device)
                entry.fetched.copy_(host, non_blocking=True)
                entry.arrived = torch.cuda.Event()
                entry.arrived.record(stream)
            # the pinned block goes back to torch's host allocator, which holds it until the copy is done
        else:
            entry.fetched = host.clone()
        self.host_bytes -= host.nbytes
