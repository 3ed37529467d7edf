"""Cost models of time and memory per layer option, calibrated on the machine's kernels and links
(:mod:`megatron_paradyse.calibration` measures them).

- :mod:`~megatron_paradyse.cost.base`: the interface the planner consumes (:class:`CostModel`,
  :class:`LayerCost`).
- :mod:`~megatron_paradyse.cost.terms`, :mod:`~megatron_paradyse.cost.layer_memory`: a layer's time terms and
  memory, composed from each strategy's own (its record in the library).
- :mod:`~megatron_paradyse.cost.profile`: the versioned JSON profile ``paradyse calibrate`` writes.
- :mod:`~megatron_paradyse.cost.analytic`: :class:`AnalyticCostModel`, terms priced by a profile.
- :mod:`~megatron_paradyse.cost.empirical`: :class:`EmpiricalCostModel`, the paper's fitted mode.
"""

from megatron_paradyse.cost.analytic import AnalyticCostModel
from megatron_paradyse.cost.base import CostModel, LayerCost
from megatron_paradyse.cost.empirical import EmpiricalCostModel
from megatron_paradyse.cost.profile import ProfileError, load_profile

__all__ = ["AnalyticCostModel", "CostModel", "EmpiricalCostModel", "LayerCost", "ProfileError", "load_profile"]
