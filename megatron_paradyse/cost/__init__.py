"""Cost models of time and memory per layer option, calibrated on the machine's kernels and links.

- :mod:`~megatron_paradyse.cost.base`: the interface the planner consumes (:class:`CostModel`,
  :class:`LayerCost`).
- :mod:`~megatron_paradyse.cost.terms`: what each strategy computes, sends and keeps (formulas).
- :mod:`~megatron_paradyse.cost.profile`: the versioned JSON profile ``paradyse calibrate`` writes.
- :mod:`~megatron_paradyse.cost.calibrate`: the measurements and fits behind a profile.
- :mod:`~megatron_paradyse.cost.analytic`: :class:`AnalyticCostModel`, terms priced by a profile.
- :mod:`~megatron_paradyse.cost.empirical`: :class:`EmpiricalCostModel`, the paper's fitted mode.
- :mod:`~megatron_paradyse.cost.measure`: one layer's measured time and memory.
"""

from megatron_paradyse.cost.analytic import AnalyticCostModel
from megatron_paradyse.cost.base import CostModel, LayerCost
from megatron_paradyse.cost.empirical import EmpiricalCostModel
from megatron_paradyse.cost.profile import ProfileError, load_profile

__all__ = ["AnalyticCostModel", "CostModel", "EmpiricalCostModel", "LayerCost", "ProfileError", "load_profile"]
