"""Trying, now and then, a plan the time model cannot tell from the chosen one, so that learning sees it.

A learned time model (:mod:`megatron_paradyse.cost.correction`) corrects only the options that ran. An
option never measured at a length keeps a neutral guess (its nearest measured factor, or the mean of
the options measured there), so when the model predicts it within ``margin`` of the chosen plan, only
running it can tell which is faster. :class:`Exploration` lets the planner run, instead of its
choice, the fastest such option (as a plan of that option on every layer, if it fits the memory
budget) on at most ``share`` of its decisions; once an option has been measured at a bucket it is not
explored there again.

Every input is the same on every rank of a group (the agreed corrections, the planner's own count of
decisions), so the ranks explore the same micro-batches without talking; the counts are saved with the
planner's state.
"""

from __future__ import annotations

from megatron_paradyse.cost.correction import TimeCorrections
from megatron_paradyse.planner.problem import Solution, StageProblem

__all__ = ["Exploration"]


class Exploration:
    """Which plan to try instead of the optimum, for a planner whose time model learns.

    Args:
        corrections: what the time model has learned (its measured weight per option and bucket).
        share: the most decisions that may explore (a fraction; 0 turns exploring off).
        margin: explore options predicted at most this fraction slower than the optimum.
    """

    def __init__(self, corrections: TimeCorrections, *, share: float, margin: float) -> None:
        self.corrections = corrections
        self.share = share
        self.margin = margin
        self.decisions = 0
        self.explored = 0

    def alternative(self, problem: StageProblem, best: Solution, bucket: int) -> Solution | None:
        """A plan to run instead of ``best`` at the bucket whose edge is ``bucket`` tokens, or None."""
        self.decisions += 1
        if self.explored + 1 > self.share * self.decisions:
            return None
        candidates = []
        for index, option in enumerate(problem.options):
            if best.counts[index] == problem.num_layers or self.corrections.measured(option, bucket):
                continue
            uniform = problem.evaluate(problem.uniform(index))
            if problem.fits(uniform) and uniform.time_s <= (1 + self.margin) * best.time_s:
                candidates.append(uniform)
        if not candidates:
            return None
        self.explored += 1
        return min(candidates, key=lambda solution: (solution.time_s, solution.counts))

    def state_dict(self) -> dict:
        return {"decisions": self.decisions, "explored": self.explored}

    def load_state_dict(self, state: dict) -> None:
        self.decisions, self.explored = int(state["decisions"]), int(state["explored"])
