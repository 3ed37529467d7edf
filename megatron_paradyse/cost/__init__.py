"""Cost models of time and memory per layer option, calibrated on the machine's kernels and links."""

from megatron_paradyse.cost.base import CostModel, LayerCost

__all__ = ["CostModel", "LayerCost"]
