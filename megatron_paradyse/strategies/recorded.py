"""A strategy's memory as its own code allocates it: recorded once, replayed for any length.

The memory of a sublayer strategy is not written again by hand: its forward and backward run once under
fake tensors on a fake process group (a recorder that the Megatron adapter installs,
:func:`install_recorder`), and every storage they create and free is kept in order as a
:class:`Recording`. Every size is a linear function of the rank's token count ``t`` (a whole micro-batch's
row count at a fixed micro-batch size): the recorder runs the code at two lengths, fits each size and
checks the fit at a third, so a recording serves every length. :func:`replay` runs it through
:class:`~megatron_paradyse.strategies.allocations.Allocations` at ``d.t``, which adds what the calling
layer decides (gradients that autograd holds for a tiled MLP's later tiles, those held before).

A recording is made per :class:`RecordingKey`: what the code's allocations depend on other than ``t``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal

from megatron_paradyse.strategies.allocations import MEMO_SIZE, Allocations, SublayerMemory, sublayer_memory_of
from megatron_paradyse.strategies.base import ModelShape, Sublayer
from megatron_paradyse.strategies.dims import Dims

__all__ = ["Event", "Recording", "RecordingKey", "install_recorder", "recorded_memory", "replay"]

EventKind = Literal["alloc", "free", "grad", "read", "return", "backward"]


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    """One step of a recording. ``alloc``: storage ``storage`` made, ``per_token * t + constant`` bytes;
    ``free``: it dies; ``grad``: it is a weight (or bias) gradient, handed to autograd here; ``read``: the
    backward first reads a tensor the forward saved; ``return``: the forward has returned ``storage``
    (its output); ``backward``: the backward starts (what died between ``return`` and here the forward
    handed on to the next sublayer)."""

    kind: EventKind
    storage: int = 0
    per_token: float = 0.0
    constant: float = 0.0


@dataclasses.dataclass(frozen=True)
class RecordingKey:
    """What a sublayer strategy's allocations depend on besides the rank's token count."""

    sublayer: Sublayer
    name: str
    shape: ModelShape
    p: int
    """The ranks sharing the micro-batch."""
    shards: int
    """The ranks holding the weights' TP shards (``p``, or more where ``p`` is a sub-group of them)."""
    e: int
    """Bytes per element: 4 (fp32) or 2 (bf16; fp16 allocates alike)."""
    b: int
    bias: bool
    mlp_weight_ahead: bool
    rank: int
    """The rank recorded (0 where the strategy's memory is the same on every rank)."""


@dataclasses.dataclass(frozen=True)
class Recording:
    """A sublayer's forward and backward on one rank as storages: inputs made first (``x_local``, and
    the MLP's weight gathered ahead), then :attr:`events`."""

    inputs: tuple[Event, ...]
    events: tuple[Event, ...]
    x_storage: int
    """The input ``x_local``."""
    dy_storage: int
    """The output's gradient, given to the backward (the caller counts it: 0 bytes here); its death is
    where the backward's first node has used it."""
    dx_storage: int
    """The input's gradient, alive at the end."""


Recorder = Callable[[RecordingKey], Recording]
_recorder: list[Recorder] = []


def install_recorder(recorder: Recorder) -> None:
    """Set what records a strategy's code (the Megatron adapter's, at its import: recording runs
    Megatron's linear modules, which ``tp_sp`` calls)."""
    _recorder[:] = [recorder]
    _recording.cache_clear()
    recorded_memory.cache_clear()


@functools.cache
def _recording(key: RecordingKey) -> Recording:
    if not _recorder:
        raise RuntimeError(
            f"the memory of {key.sublayer} strategy {key.name!r} is recorded from its code, which needs "
            "megatron-core: import megatron_paradyse.mcore first"
        )
    return _recorder[0](key)


@functools.lru_cache(maxsize=MEMO_SIZE)
def recorded_memory(d: Dims, rank: int, *, sublayer: Sublayer, name: str) -> SublayerMemory:
    """Strategy ``name``'s memory on ``rank``, recorded from its code (once per :class:`RecordingKey`);
    memoised: a planner decision asks for the same sublayer under several options."""
    e = 4 if d.e == 4 else 2
    key = RecordingKey(sublayer, name, d.shape, d.p, d.weight_ranks, e, d.b, d.bias, d.mlp_weight_ahead, rank)
    return replay(_recording(key), d)


def replay(recording: Recording, d: Dims) -> SublayerMemory:
    """The :class:`SublayerMemory` of ``recording`` at ``d.t`` tokens, with the weight-gradient setting of
    ``d`` (:attr:`Dims.grads_held`, :attr:`Dims.grads_before`)."""
    t = d.t

    def named(n: int) -> str:
        return "x_local" if n == recording.x_storage else "dx_local" if n == recording.dx_storage else f"s{n}"

    fwd = Allocations(**{named(ev.storage): ev.per_token * t + ev.constant for ev in recording.inputs})
    events = iter(recording.events)
    for ev in events:
        if ev.kind == "return":
            output = ev.storage
            break
        _apply(fwd, ev, named, t)
    handed_on = 0.0  # what the forward leaves beside its output for the next sublayer: it dies here
    for ev in events:
        if ev.kind == "backward":
            break
        handed_on += fwd.sizes[named(ev.storage)] if ev.storage != output else 0.0
        fwd.free(named(ev.storage))
    saved = dict(fwd.sizes)

    bwd = Allocations(d, **saved)
    # what the backward makes before it first reads a saved tensor (a recompute rebuilds on top of it),
    # a weight gradient gone once handed over, whatever autograd holds
    made, prelude, handed = 0.0, None, set()
    for ev in events:
        if ev.storage == recording.dy_storage:  # the caller counts it
            bwd.alloc(dy_local=0.0) if ev.kind == "alloc" else bwd.output_gradient_used()
        elif ev.kind == "read":
            prelude = made if prelude is None else prelude
        elif ev.kind == "grad":
            handed.add(ev.storage)
            made -= bwd.sizes[named(ev.storage)]
            bwd.to_autograd(named(ev.storage))
        elif ev.storage not in handed:
            made += _apply(bwd, ev, named, t)
    return sublayer_memory_of(fwd.peak, bwd, saved, prelude=prelude or 0.0, handed_on=handed_on)


def _apply(m: Allocations, ev: Event, named: Callable[[int], str], t: int) -> float:
    """An allocation or a free, run on ``m``: the bytes it adds (negative: frees)."""
    name = named(ev.storage)
    if ev.kind == "alloc":
        nbytes = ev.per_token * t + ev.constant
        m.alloc(**{name: nbytes})
        return nbytes
    nbytes = m.sizes[name]
    m.free(name)
    return -nbytes
