"""The planner: for each micro-batch, every layer's (attention, MLP, recompute) option of least
predicted time whose predicted peak memory fits the budget.

:class:`Planner` caches plans by length bucket and keeps the previous plan within a hysteresis margin;
:func:`solve_exact` finds the optimum of one stage problem; :func:`solve_heuristic` is the paper's
Algorithm 1, for comparison.
"""

from megatron_paradyse.planner.config import LearningConfig, PlanCacheConfig, PlannerConfig, SearchSpace, layer_options
from megatron_paradyse.planner.decision import Decision, InfeasibleReport, InfeasibleSequenceError
from megatron_paradyse.planner.exact import solve_exact
from megatron_paradyse.planner.heuristic import solve_heuristic
from megatron_paradyse.planner.planner import Planner
from megatron_paradyse.planner.problem import Solution, StageProblem

__all__ = [
    "Decision",
    "InfeasibleReport",
    "InfeasibleSequenceError",
    "LearningConfig",
    "PlanCacheConfig",
    "Planner",
    "PlannerConfig",
    "SearchSpace",
    "Solution",
    "StageProblem",
    "layer_options",
    "solve_exact",
    "solve_heuristic",
]
