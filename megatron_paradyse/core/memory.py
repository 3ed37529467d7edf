"""Peak memory allocated by a piece of work, on CUDA and on CPU.

On CUDA it is the caching allocator's own count (``torch.cuda.max_memory_allocated``). CPU has no
allocator statistics, so :class:`PeakMemory` watches every operator through a dispatch mode and
counts the storages it creates until they are freed: the same quantity, bytes held by live tensors
created inside the window, without allocator caching or fragmentation. Memory held before the window
(weights, optimizer state) is not counted; :attr:`PeakMemory.peak_bytes` is the high-water mark above
it. On CPU "host" and "device" are the same memory: what stands for host memory (offloaded activations)
is made under :func:`host_memory` and left out of the count, as CUDA's allocator leaves out pinned host
memory.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import gc
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "GradientRoot",
    "MemoryEvent",
    "PeakMemory",
    "allocator_capacity_bytes",
    "collective_buffers_freed_promptly",
    "device_memory_bytes",
    "freeze_what_lives_now",
    "host_memory",
    "peak_bytes_of",
    "peak_memory_window",
    "recurring_least",
    "recurring_peak_bytes",
    "storage_bytes",
]

_ON_HOST: contextvars.ContextVar[bool] = contextvars.ContextVar("paradyse_on_host", default=False)


@contextlib.contextmanager
def host_memory() -> Iterator[None]:
    """Storages made inside are host memory: the CPU tracker does not count them as the device's."""
    token = _ON_HOST.set(True)
    try:
        yield
    finally:
        _ON_HOST.reset(token)


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryEvent:
    """One storage created or freed while a :class:`_StorageTracker` recorded events."""

    op: str
    """The operator that created the storage (for a free too: what was freed), e.g. ``aten.mm.default``."""
    nbytes: int
    """Positive when created, negative when freed."""
    live: int
    """Bytes alive right after the event."""
    op_index: int
    """Operators dispatched before it (a free happens between operators: after ``op_index`` of them)."""
    storage: int
    """Creation number of the storage: a free names the creation it undoes."""


class _StorageTracker(TorchDispatchMode):
    """Counts bytes of storages created by operators while active, and when each is freed.

    With ``record=True`` it also keeps every creation and free as a :class:`MemoryEvent` in
    :attr:`events`, so a trace can be laid beside a prediction to find where they diverge.
    """

    def __init__(self, *, record: bool = False) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.events: list[MemoryEvent] | None = [] if record else None
        self._known: dict[int, tuple[weakref.ref, int]] = {}  # storages counted, by id, until freed; creation
        self._ops = 0
        self._created = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Nothing is compiled under the tracker: torch's wrapper that keeps Dynamo out of
        ``__torch_dispatch__`` would only cost each operator a few microseconds."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and func._opname not in _POINT_TO_POINT:
            out = _collective_let_go_of(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        self._ops += 1
        if _ON_HOST.get():
            return out
        inputs = None  # the storages the operator read, gathered only for an output not already counted
        for t in _tensors(out):
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._known:
                continue  # a view of a storage already counted
            if inputs is None:
                inputs = {id(a.untyped_storage()) for a in _tensors((args, kwargs))}
            if key in inputs:
                continue  # an in-place result on a storage made before the window
            nbytes = storage.nbytes()
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            self._created += 1
            if self.events is not None:
                self.events.append(MemoryEvent(str(func), nbytes, self.live, self._ops - 1, self._created))
            freed = functools.partial(self._freed, key, nbytes, func, self._created)
            self._known[key] = (weakref.ref(storage, freed), self._created)
        return out

    def creation_of(self, tensor: torch.Tensor) -> int | None:
        """The creation number of ``tensor``'s storage (:attr:`MemoryEvent.storage`), or None where it was
        made before the window."""
        known = self._known.get(id(tensor.untyped_storage()))
        return known[1] if known else None

    def _freed(self, key: int, nbytes: int, func, storage: int, _: weakref.ref) -> None:
        del self._known[key]
        self.live -= nbytes
        if self.events is not None:
            self.events.append(MemoryEvent(str(func), -nbytes, self.live, self._ops, storage))


_POINT_TO_POINT = frozenset({"send", "recv_", "recv_any_source_"})
"""c10d operators one rank may start before its peer has: waiting for them inside the operator could
deadlock, so :func:`_collective_let_go_of` leaves them to :func:`collective_buffers_freed_promptly`."""

_RELEASE_WAIT_SECONDS = 5.0
"""How long :func:`_collective_let_go_of` waits for gloo's worker thread before it gives up on a holder
it does not know of (the measurement then goes on, as it did before the wait)."""


def _collective_let_go_of(func, args, kwargs):
    """Runs a c10d collective on CPU tensors to completion and returns once gloo has let go of them.

    Gloo's work object holds the collective's tensors until its worker thread drops it, a moment after
    the collective completes; if the code has dropped a buffer by then, the worker frees it late (it
    needs the GIL for that), and a peak measured meanwhile counts a buffer the code no longer holds. So
    the collective is waited for here, its work replaced by a completed one that holds its output
    tensors, and the caller gets it back only once each tensor's reference count is again what it was
    before the collective. Every rank runs the same collectives in the same order, so waiting inside one
    cannot deadlock; an asynchronous collective becomes a synchronous one, which changes no tensor's
    lifetime. A collective on device tensors is left as it is: there the allocator's own count is what
    the run holds."""
    held = _tensors((args, kwargs))
    if not held or any(t.device.type != "cpu" for t in held):
        return func(*args, **kwargs)
    counts = [t._use_count() for t in held]
    out = func(*args, **kwargs)
    work = out[-1] if isinstance(out, tuple) else out
    work.wait()
    done = torch.futures.Future()
    done.set_result(_tensors(out[:-1]) if isinstance(out, tuple) else None)
    completed = torch._C._distributed_c10d._create_work_from_future(done).boxed()
    out = (*out[:-1], completed) if isinstance(out, tuple) else completed
    del work
    deadline = time.monotonic() + _RELEASE_WAIT_SECONDS
    while any(t._use_count() > n for t, n in zip(held, counts, strict=True)) and time.monotonic() < deadline:
        time.sleep(0)  # lets the worker thread run; it needs no GIL while the tensors' Python objects live
    return out


def _tensors(value, found: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The tensors with storage in an operator's arguments or results (nested lists, tuples and dicts),
    added to ``found``: a walk of the few containers ATen uses, far cheaper per operator than a general
    pytree flatten."""
    found = [] if found is None else found
    if isinstance(value, torch.Tensor):
        if not value.is_meta:
            found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, found)
    return found


class PeakMemory:
    """``with PeakMemory(device) as m: work()`` then ``m.peak_bytes``: bytes above the start, at peak."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.peak_bytes = 0
        self._tracker: _StorageTracker | None = None
        self._start = 0

    @staticmethod
    def slows_work(device: torch.device | str) -> bool:
        """Whether the window slows the work it measures: on CPU its dispatch mode runs Python for every
        operator (14% to 37% of a small layer's time); on CUDA it reads the allocator's counters."""
        return torch.device(device).type != "cuda"

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._tracker = _StorageTracker()
            self._tracker.__enter__()
        return self

    def current_bytes(self) -> int:
        """Bytes allocated now above the start of the window (inside the ``with`` block)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) - self._start
        return self._tracker.live

    def peak_until_now(self) -> int:
        """The peak so far above the start of the window (inside the ``with`` block; no device sync)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self._start
        return self._tracker.peak

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        else:
            self._tracker.__exit__(*exc)
            self.peak_bytes = self._tracker.peak


@contextlib.contextmanager
def collective_buffers_freed_promptly() -> Iterator[None]:
    """Inside, a finished gloo send or receive frees its buffer about when the code drops it, as a device's
    would: gloo's worker thread drops its references only once it holds the GIL, so threads switch as
    often as they can (otherwise a measured peak may hold the last exchange's buffers a while longer).
    Collectives need no such luck: the CPU tracker waits for gloo to let go of theirs
    (:func:`_collective_let_go_of`); a point-to-point exchange cannot be waited for inside its operator."""
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(switch_interval)


def device_memory_bytes(device: torch.device) -> int | None:
    """A CUDA device's whole memory; None for the CPU, whose memory no plan is sized by."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def allocator_capacity_bytes(device: torch.device, group: dist.ProcessGroup | None = None) -> int | None:
    """What PyTorch's caching allocator can hold on a CUDA ``device``: its memory less what is in use
    outside the allocator now (the CUDA context, cuBLAS and cuDNN handles, loaded kernels, NCCL's
    communicators, other processes), the least over ``group``'s ranks so that they all plan with one
    budget; None for the CPU. A collective over ``group``, and one host synchronisation: call it at
    start-up, on every rank of ``group``."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    capacity = torch.tensor([free + torch.cuda.memory_reserved(device)], dtype=torch.int64, device=device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(capacity, op=dist.ReduceOp.MIN, group=group)
    return int(capacity.item())


def freeze_what_lives_now() -> None:
    """Moves every object alive now out of the cycle collector's reach (``gc.freeze``): in a process that
    has just imported torch and megatron-core (430K objects), the full collection each measured window
    starts with (:func:`peak_bytes_of`, :meth:`~megatron_paradyse.mcore.trace.RankTracer.trace`) then
    scans only what was made since: 0.26 s a collection otherwise on a CPU machine, more than a small
    step's measurement. An object alive now and dropped later in a reference cycle is never freed: call
    it before building models."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def peak_memory_window(device: torch.device | str = "cpu") -> Iterator[PeakMemory]:
    """A :class:`PeakMemory` window with Python's cycle collector held off (a tensor freed only with a
    reference cycle stays counted until the end, as it stays allocated until a collection runs) and
    gloo's buffers freed promptly."""
    gc.collect()
    gc.disable()
    try:
        with collective_buffers_freed_promptly(), PeakMemory(device) as window:
            yield window
    finally:
        gc.enable()


def peak_bytes_of(work: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """High-water mark of ``work()`` above what was allocated when it started (:func:`peak_memory_window`)."""
    with peak_memory_window(device) as window:
        work()
    return window.peak_bytes


def recurring_least(
    measure: Callable[[], Sequence[int]], *, most_runs: int = 6, group: dist.ProcessGroup | None = None
) -> tuple[int, ...]:
    """Each figure of ``measure()`` (repeatable work, run again and again) at the least it takes, once that
    least has come twice for every figure on every rank of ``group`` (the default group; alone in a
    single process), or after ``most_runs`` runs. On CPU a run's figures can only ever come out higher than
    the work's own (gloo's worker thread, when it gets the GIL late, drops a finished collective's buffer
    late), and two runs alike at the least are the work's own: the least of a fixed number of runs missed
    it now and then. The ranks agree after each run whether to run again (one all-reduce, outside the
    runs), so work with collectives runs as often on every rank."""
    if most_runs < 1:
        raise ValueError(f"most_runs must be at least 1, got {most_runs}")
    runs: list[tuple[int, ...]] = []
    while True:
        runs.append(tuple(measure()))
        settled = len(runs) == most_runs or all(column.count(min(column)) > 1 for column in zip(*runs))
        if _on_every_rank(settled, group):
            return tuple(map(min, zip(*runs)))


def recurring_peak_bytes(
    work: Callable[[], object],
    device: torch.device | str = "cpu",
    *,
    most_runs: int = 6,
    group: dist.ProcessGroup | None = None,
) -> int:
    """The peak of ``work()`` (:func:`peak_bytes_of`) at the least it takes, once it recurs
    (:func:`recurring_least`)."""
    (peak,) = recurring_least(lambda: (peak_bytes_of(work, device),), most_runs=most_runs, group=group)
    return peak


def _on_every_rank(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether ``flag`` holds on every rank of ``group`` (``flag`` itself in a single process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    every = torch.tensor([int(flag)])
    dist.all_reduce(every, op=dist.ReduceOp.MIN, group=group)
    return bool(every.item())


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors`` (views and aliases counted once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


class _GradientRoot(torch.autograd.Function):
    """An empty output (no bytes to count) whose backward gives ``y`` a copy of ``dy``."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(dy)
        return y.new_empty(0)

    @staticmethod
    def backward(ctx, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        (dy,) = ctx.saved_tensors
        return dy.clone(), None


class GradientRoot:
    """``GradientRoot(y, dy).backward()`` runs ``y``'s backward from the gradient ``dy`` as a training step
    gives a layer's output its gradient: made inside the backward (a copy of ``dy``) and freed once used,
    with ``y`` itself not kept (drop the caller's reference to ``y`` before calling ``backward``)."""

    def __init__(self, y: torch.Tensor, dy: torch.Tensor) -> None:
        self._root = _GradientRoot.apply(y, dy)

    def backward(self) -> None:
        self._root.backward(torch.empty_like(self._root))
