"""The interface between cost models and the planner.

Layers of a pipeline stage are alike, so a layer option has one cost per micro-batch. The stage's
predicted peak is ``peak_bytes(saved, transient)`` (:func:`stage_layer_bytes`): ``saved`` is the sum of
saved_bytes over layers, ``transient`` what a layer's working set adds to them at its highest. Layer
``l`` runs (forward, recompute, backward) while layers ``1..l-1`` hold their saved activations and
later layers hold none (not yet made in forward, released in backward), so the stage's layers peak at
``max_l (saved by layers 1..l + transient of layer l)``: the working set of a layer counts beside the
saved activations of the layers before it only. ``peak_bytes`` adds what every plan shares (weights,
gradients, optimizer state, embedding and loss working set) and the allocator's slack, and must not
decrease in either argument. Around its layers a stage has a choice that changes both (a
:class:`StageOptions`): its output layer and loss at once or in chunks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Protocol

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption, Plan
from megatron_paradyse.strategies import get_strategy

__all__ = ["WHOLE_LOSS", "CostModel", "LayerCost", "StageOptions", "run_order", "stage_layer_bytes"]


@dataclasses.dataclass(frozen=True, slots=True)
class StageOptions:
    """How a stage runs around its layers, where that changes its cost.

    With ``loss_chunk_tokens`` the output layer and loss run over chunks of that many gathered tokens
    and are recomputed in backward (:mod:`megatron_paradyse.mcore.chunked_loss`): their working set is
    one chunk's, for one more output-layer forward. Megatron's sequence-parallel linears (``tp_sp``'s,
    and an unchunked output layer's) gather the whole sequence into one buffer that the step keeps;
    ``sequence_buffer=False`` prices a stage none of whose layers runs ``tp_sp`` (it rules those options
    out): its buffer then holds what its output layer gathers, the whole sequence, one chunk, or nothing.
    """

    loss_chunk_tokens: int = 0
    sequence_buffer: bool = True

    @classmethod
    def of(cls, plan: Plan) -> StageOptions:
        """The stage options ``plan`` runs with."""
        if not plan.loss_chunk_tokens:
            return WHOLE_LOSS
        return cls(plan.loss_chunk_tokens, any(map(_gathers_sequence, plan)))

    def rules_out(self, option: LayerOption) -> bool:
        """The option gathers the whole sequence, which this stage has no buffer for."""
        return not self.sequence_buffer and _gathers_sequence(option)


def _gathers_sequence(option: LayerOption) -> bool:
    """A strategy that calls Megatron's sequence-parallel linears gathers the whole sequence into
    Megatron's buffer."""
    return get_strategy("attention", option.attention).calls_linears or get_strategy("mlp", option.mlp).calls_linears


WHOLE_LOSS = StageOptions()
"""Megatron's own output layer and loss, over the whole sequence at once."""


@dataclasses.dataclass(frozen=True, slots=True)
class LayerCost:
    """Predicted cost of one layer under one option for one micro-batch, on one rank."""

    time_s: float
    """Forward + backward (+ recompute) time."""
    saved_bytes: float
    """Memory held from the layer's forward until its backward."""
    transient_bytes: float
    """Extra memory alive only while the layer runs (forward, recompute or backward, whichever is largest)."""
    host_bytes: float = 0.0
    """Host memory held from the layer's forward until its backward (an offloaded layer's input)."""


def run_order(option: LayerOption, cost: LayerCost) -> tuple:
    """Sort key of the order a stage runs its layers' options in: offloaded layers last, the others by
    decreasing transient (then saved) bytes. The stage peak, ``max_l (saved by layers 1..l + transient
    of layer l)``, is lowest in this order: swapping two adjacent layers so that the larger transient
    comes first never raises it (an exchange argument). Offloaded layers run last so that their saved
    bytes are right (:func:`stage_layer_bytes`)."""
    return (option.offload, -cost.transient_bytes, -cost.saved_bytes)


def stage_layer_bytes(layers: Iterable[tuple[int, LayerCost]], num_layers: int) -> tuple[float, float]:
    """The summed saved bytes of a stage's ``num_layers`` layers, given as (how many, cost) pairs in the
    order they run, and the transient their working sets add at the highest: ``max_l (transient of
    layer l - saved by the layers after l)``, so that ``saved + transient`` is the layers' peak (module
    docstring), for :meth:`CostModel.peak_bytes`.

    An offloaded layer's saved bytes leave out one activation, which stands for its input (the same
    size): another layer's output, which that layer counts. Plans run offloaded layers last
    (:func:`run_order`), so that holds unless every layer is offloaded: the first layer's input is then
    the stage's own, which the model keeps on the device through the forward (GPTModel holds its
    embedding's output), one activation more until the backward, by when it is on the host. An
    offloaded layer's transient holds the next offloaded layer's input, prefetched, which a lone
    offloaded layer has none of.
    """
    layers = [(n, cost) for n, cost in layers if n]
    saved, offloaded, activation = 0.0, 0, 0.0
    for n, cost in layers:
        saved += n * cost.saved_bytes
        if cost.host_bytes:
            offloaded += n
            activation = max(activation, cost.host_bytes)
    transient, after = -math.inf, 0.0
    for n, cost in reversed(layers):  # the last layer of each run of alike ones has the most before it
        own = cost.transient_bytes - (cost.host_bytes if offloaded == 1 else 0.0)
        transient = max(transient, own - after)
        after += n * cost.saved_bytes
    if offloaded == num_layers:  # in peak_bytes: beside the loss, not beside the layers' working sets
        return saved + activation, transient - activation
    return saved, transient


class CostModel(Protocol):
    def layer_cost(self, option: LayerOption, layout: SequenceLayout, micro_batch_size: int) -> LayerCost:
        """Cost of one layer running ``option`` on a micro-batch laid out as ``layout``."""
        ...

    def peak_bytes(
        self,
        layout: SequenceLayout,
        micro_batch_size: int,
        saved_bytes: float,
        transient_bytes: float,
        stage: StageOptions = WHOLE_LOSS,
    ) -> float:
        """Stage peak given the layers' summed saved bytes and largest transient."""
        ...

    def held_bytes(
        self, layout: SequenceLayout, micro_batch_size: int, saved_bytes: float, stage: StageOptions = WHOLE_LOSS
    ) -> float:
        """What a forward keeps above the static bytes until its backward, given the layers' summed saved
        bytes: while other forwards run, that is all it takes of the stage's memory."""
        ...

    def stage_options(self, loss_chunk_tokens: int) -> tuple[StageOptions, ...]:
        """The stage options worth pricing when the loss may run in chunks of ``loss_chunk_tokens``
        (0: never), :data:`WHOLE_LOSS` first."""
        ...

    def stage_time_s(self, layout: SequenceLayout, micro_batch_size: int, stage: StageOptions) -> float:
        """What ``stage`` adds to the step's time beyond :data:`WHOLE_LOSS`."""
        ...
