"""The interface between cost models and the planner.

Layers of a pipeline stage are alike, so a layer option has one cost per micro-batch. The stage's
predicted peak is ``peak_bytes(saved = sum of saved_bytes over layers, transient = max of
transient_bytes over layers)``: activations saved for backward accumulate layer after layer, while
only one layer's working set is alive at a time. ``peak_bytes`` adds what every plan shares (weights,
gradients, optimizer state, embedding and loss working set) and the allocator's slack, and must not
decrease in either argument.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption

__all__ = ["CostModel", "LayerCost"]


@dataclasses.dataclass(frozen=True, slots=True)
class LayerCost:
    """Predicted cost of one layer under one option for one micro-batch, on one rank."""

    time_s: float
    """Forward + backward (+ recompute) time."""
    saved_bytes: float
    """Memory held from the layer's forward until its backward."""
    transient_bytes: float
    """Extra memory alive only while the layer runs (forward, recompute or backward, whichever is largest)."""


class CostModel(Protocol):
    def layer_cost(self, option: LayerOption, layout: SequenceLayout, micro_batch_size: int) -> LayerCost:
        """Cost of one layer running ``option`` on a micro-batch laid out as ``layout``."""
        ...

    def peak_bytes(
        self, layout: SequenceLayout, micro_batch_size: int, saved_bytes: float, transient_bytes: float
    ) -> float:
        """Stage peak given the layers' summed saved bytes and largest transient."""
        ...
