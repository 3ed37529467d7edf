"""What :meth:`~megatron_paradyse.planner.Planner.decide` answers: a micro-batch's plan and how it was
reached (:class:`Decision`), or why no plan fits it (:class:`InfeasibleReport`, raised under
``planner.on_infeasible = stop`` as :class:`InfeasibleSequenceError`)."""

from __future__ import annotations

import dataclasses
import math

from megatron_paradyse.core.plan import Plan

__all__ = ["Decision", "InfeasibleReport", "InfeasibleSequenceError"]

_GIB = 2**30


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """The plan of one micro-batch and how it was reached."""

    plan: Plan
    """One option per layer; ``predicted_time_s`` and ``predicted_peak_bytes`` are set."""
    cached: bool
    """The bucket's optimum came from the plan cache."""
    kept_previous: bool
    """Hysteresis kept the previous micro-batch's plan (it fits and is within gamma of the optimum)."""
    bucket_length: int
    """Padded length the costs were evaluated at."""
    optimal_time_s: float
    """Predicted time of the bucket's optimum (``plan.predicted_time_s`` unless ``kept_previous``)."""
    explored: bool = False
    """The plan is a trial of an option the learned time model has not measured at this length
    (:mod:`~megatron_paradyse.planner.exploration`), run instead of the optimum."""

    def log_fields(self) -> dict[str, object]:
        """Flat fields for a step log."""
        return {
            "plan": self.plan.compact(),
            "predicted_time_s": self.plan.predicted_time_s,
            "predicted_peak_gib": self.plan.predicted_peak_bytes / _GIB,
            "bucket_length": self.bucket_length,
            "cached": self.cached,
            "kept_previous": self.kept_previous,
            "explored": self.explored,
        }


@dataclasses.dataclass(frozen=True, slots=True)
class InfeasibleReport:
    """Why a micro-batch cannot run: no plan's predicted peak fits the budget."""

    length: int
    """Real tokens of the micro-batch's sequence."""
    padded_length: int
    bucket_length: int
    micro_batch_size: int
    budget_bytes: float
    leanest_peak_bytes: float
    """Predicted peak of the leanest plan at ``bucket_length``."""
    leanest_plan: str
    longest_feasible_length: int
    """Longest padded length (a bucket edge, one document) some plan fits; 0 if none does."""
    forwards_in_flight: int = 1
    """With several (:class:`Planner`), ``budget_bytes`` is what one may peak at beside the others."""
    held_cap_bytes: float = math.inf
    """What each forward in flight may hold until its backward."""
    leanest_held_bytes: float = 0.0
    stage_budget_bytes: float = 0.0
    """The whole stage's budget, which the forwards in flight share."""

    def __str__(self) -> str:
        longest = (
            f"the longest that fits is {self.longest_feasible_length} tokens"
            if self.longest_feasible_length
            else "no length fits"
        )
        if self.forwards_in_flight == 1:
            why = (
                f"is predicted to peak at {self.leanest_peak_bytes / _GIB:.2f} GiB, over the budget of "
                f"{self.budget_bytes / _GIB:.2f} GiB"
            )
        elif self.budget_bytes <= 0:
            why = (
                f"is predicted to hold {self.leanest_held_bytes / _GIB:.2f} GiB until its backward and to peak at "
                f"{self.leanest_peak_bytes / _GIB:.2f} GiB, and the stage's budget of "
                f"{self.stage_budget_bytes / _GIB:.2f} GiB holds none of its {self.forwards_in_flight} forwards in "
                f"flight at any length"
            )
        else:
            why = (
                f"is predicted to hold {self.leanest_held_bytes / _GIB:.2f} GiB until its backward and to peak at "
                f"{self.leanest_peak_bytes / _GIB:.2f} GiB, where each of the stage's {self.forwards_in_flight} "
                f"forwards in flight may hold {self.held_cap_bytes / _GIB:.2f} GiB and peak at "
                f"{self.budget_bytes / _GIB:.2f} GiB beside the others (its budget of "
                f"{self.stage_budget_bytes / _GIB:.2f} GiB shared as the longest micro-batch needs)"
            )
        return (
            f"a sequence of {self.length} tokens (padded to {self.padded_length}, planned at "
            f"{self.bucket_length}) with micro-batch size {self.micro_batch_size} fits no plan: the leanest "
            f"({self.leanest_plan}) {why}; {longest} with this micro-batch size"
        )


class InfeasibleSequenceError(ValueError):
    """A micro-batch no plan fits, under ``planner.on_infeasible = stop``."""

    def __init__(self, report: InfeasibleReport) -> None:
        super().__init__(
            f"{report}. Shorten or split such sequences, enable a memory-lean strategy or recompute, "
            f"or set planner.on_infeasible=skip to skip them"
        )
        self.report = report
