"""What :meth:`~megatron_paradyse.planner.Planner.decide` answers: a micro-batch's plan and how it was
reached (:class:`Decision`), or why no plan fits it (:class:`InfeasibleReport`, raised under
``planner.on_infeasible = stop`` as :class:`InfeasibleSequenceError`)."""

from __future__ import annotations

import dataclasses
import math

from megatron_paradyse.core.plan import Plan

__all__ = ["Decision", "InfeasibleReport", "InfeasibleSequenceError", "byte_sizes"]

_GIB = 2**30
_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))
_LEVERS = (
    ("a memory-lean strategy", lambda option: "tp_sp" not in (option.attention, option.mlp)),
    ("recompute", lambda option: option.recompute),
)
"""What may make a plan leaner, and whether a layer's option has it: Megatron's TP+SP keeps its weight
shards and gathers the whole sequence; every other strategy keeps less of one or the other."""


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
    leanest_plan: Plan
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
        peak, budget = byte_sizes(self.leanest_peak_bytes, self.budget_bytes)
        if self.forwards_in_flight == 1:
            why = f"is predicted to peak at {peak}, over the budget of {budget}"
        elif self.budget_bytes <= 0:
            held, peak, stage = byte_sizes(self.leanest_held_bytes, self.leanest_peak_bytes, self.stage_budget_bytes)
            why = (
                f"is predicted to hold {held} until its backward and to peak at {peak}, and the stage's budget of "
                f"{stage} holds none of its {self.forwards_in_flight} forwards in flight at any length"
            )
        else:
            held, cap = byte_sizes(self.leanest_held_bytes, self.held_cap_bytes)
            (stage,) = byte_sizes(self.stage_budget_bytes)
            why = (
                f"is predicted to hold {held} until its backward and to peak at {peak}, where each of the stage's "
                f"{self.forwards_in_flight} forwards in flight may hold {cap} and peak at {budget} beside the "
                f"others (its budget of {stage} shared as the longest micro-batch needs)"
            )
        return (
            f"a sequence of {self.length} tokens (padded to {self.padded_length}, planned at "
            f"{self.bucket_length}) with micro-batch size {self.micro_batch_size} fits no plan: the leanest "
            f"({self.leanest_plan.compact()}) {why}; {longest} with this micro-batch size"
        )

    def unused_levers(self) -> str:
        """What may make a plan leaner that some layer of the leanest plan does not have yet, as a
        suggestion ("a memory-lean strategy or recompute"); empty where its layers have them all."""
        levers = [lever for lever, has in _LEVERS if not all(map(has, self.leanest_plan.layers))]
        return " or ".join(levers)


class InfeasibleSequenceError(ValueError):
    """A micro-batch no plan fits, under ``planner.on_infeasible = stop``."""

    def __init__(self, report: InfeasibleReport) -> None:
        levers = report.unused_levers()
        enable = f"enable {levers}, " if levers else ""
        super().__init__(
            f"{report}. Shorten or split such sequences, {enable}or set planner.on_infeasible=skip to skip them"
        )
        self.report = report


def byte_sizes(*counts: float) -> tuple[str, ...]:
    """Byte counts in one unit that tells apart the ones that differ: the largest of GiB, MiB and KiB in
    which each (0 aside) is at least 1 and they print apart with two decimals; else in bytes."""

    def suits(size: int) -> bool:
        apart = len({f"{n / size:.2f}" for n in counts}) == len(set(counts))
        return apart and all(n >= size for n in counts if n)

    size, unit = next(((size, unit) for size, unit in _UNITS if suits(size)), (1, "bytes"))
    return tuple(f"{n / size:.2f} {unit}" for n in counts)
