"""The training iterator: this data-parallel rank's micro-batches, each with the plan its stage runs.

Megatron's schedules call ``next(data_iterator)`` once per micro-batch on every rank (every pipeline
stage, every tensor-parallel rank). Each rank builds the same micro-batch itself
(:class:`~megatron_paradyse.data.DynamicSequenceLoader`) and plans it itself
(:class:`~megatron_paradyse.planner.Planner`): no broadcast, no collective, the same answer on every
rank of the group (DESIGN.md invariant 5).

A micro-batch no plan fits must be dropped by every pipeline stage or by none, or the stages would
run different micro-batches and wait on each other forever. So every rank checks a micro-batch
against the planners of *all* stages of its pipeline (their layers, static memory and output layer
differ), not only its own:

- ``on_infeasible = "skip"``: the micro-batch is logged and the next one is taken, on every stage (a
  dataset whose shortest sample fits no plan is refused when the iterator is made: nothing would train);
- ``on_infeasible = "stop"``: at the first micro-batch of each step, every micro-batch of the global
  batch (all data-parallel ranks') is checked, so every rank of the job raises the planner's
  :class:`~megatron_paradyse.planner.InfeasibleSequenceError` at the same point, before any forward
  of that step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.cost.correction import TimeCorrections
from megatron_paradyse.data import DynamicSequenceLoader
from megatron_paradyse.planner import Decision, InfeasibleReport, InfeasibleSequenceError, Planner

__all__ = ["PlannedMicroBatch", "PlannedMicroBatches", "ResumeError", "SkippedMicroBatch"]


class ResumeError(ValueError):
    """The data cannot continue from a checkpoint: its position is missing or was saved by another run."""


@dataclasses.dataclass(frozen=True)
class PlannedMicroBatch:
    """A micro-batch (the :mod:`~megatron_paradyse.data.batching` dict) and this stage's decision for it."""

    batch: dict
    decision: Decision
    predicted_time_s: float
    """Its forward and backward on this stage at its own length, as the planner predicts it
    (:meth:`~megatron_paradyse.planner.Planner.predicted_time_s`; the plan was priced at its bucket's edge)."""
    evaluation: bool = False
    """Drawn for validation or test (a forward-only pass), not for training."""

    @property
    def layout(self) -> SequenceLayout:
        return self.batch["layout"]


@dataclasses.dataclass(frozen=True)
class SkippedMicroBatch:
    """A micro-batch left out under ``on_infeasible = "skip"``."""

    layout: SequenceLayout
    stage: int
    """The first pipeline stage no plan fits it on."""
    report: InfeasibleReport


class PlannedMicroBatches:
    """Megatron's train data iterator (``--dataloader-type external``) for one rank.

    Args:
        loader: this data-parallel rank's micro-batches.
        planners: one planner per pipeline stage, in stage order (all with the same config).
        stage: this rank's pipeline stage; its planner's decisions are the plans returned.
        evaluation: the micro-batches are for validation or test (forward-only passes, planned by
            forward-only planners); :meth:`restart` starts each evaluation from the same one.
        time_corrections: what the planners' cost models learned from the run (saved and restored with
            the data's position).
    """

    def __init__(
        self,
        loader: DynamicSequenceLoader,
        planners: Sequence[Planner],
        stage: int,
        *,
        evaluation: bool = False,
        time_corrections: TimeCorrections | None = None,
    ) -> None:
        if not 0 <= stage < len(planners):
            raise ValueError(f"stage must be in [0, {len(planners)}), got {stage}")
        policies = {planner.config.on_infeasible for planner in planners}
        if len(policies) != 1:
            raise ValueError(f"every stage's planner needs the same on_infeasible policy, got {sorted(policies)}")
        self.loader = loader
        self.planners = tuple(planners)
        self.stage = stage
        self.policy = policies.pop()
        self.evaluation = evaluation
        self.time_corrections = time_corrections
        # Feasibility is asked of separate planners, so the checks never move the hysteresis of the
        # planner that makes this stage's plans.
        self._checkers = tuple(_checker(planner) for planner in planners)
        self.skipped: list[SkippedMicroBatch] = []
        """Micro-batches skipped since the caller last cleared this list."""
        if self.policy == "skip":
            self._check_the_shortest_fits()

    def __iter__(self) -> PlannedMicroBatches:
        return self

    def check_step(self) -> None:
        """Under ``stop``, at a step's start: the planners hold the step's forwards in flight, and reserve what a
        stage keeps between them, for its longest micro-batch (:meth:`Planner.set_step_longest`; the global
        batch's longest, the same on every rank), and raise if a micro-batch of the step (every data-parallel
        rank's) fits no plan on some stage. Called before the pipeline schedule starts, every rank raises
        before a stage waits on another; :meth:`__next__` checks again where nobody called it. Under ``skip`` a
        skipped micro-batch's place goes to one of the next step, so a step's micro-batches are not known
        before it runs: any step's longest (``--seq-length``) sets both."""
        sampler = self.loader.sampler
        if self.policy == "stop" and sampler.consumed == 0:
            layouts = [
                sampler.layout(micro_batch) for micro_batch in sampler.global_batch(sampler.position).micro_batches
            ]
            longest = max(layout.padded_len for layout in layouts)
            for planner in (*self.planners, *self._checkers):
                planner.set_step_longest(longest)
            self._check_global_batch(layouts)

    def __next__(self) -> PlannedMicroBatch:
        self.check_step()
        while True:
            batch = next(self.loader)
            problem = self._first_infeasible(batch["layout"])
            if problem is None:
                # every stage's planner decides, on every rank: Megatron saves the data's position, and
                # with it the planners' state (:meth:`save_state`), from the first stage's ranks only, so
                # theirs must hold each later stage's planner as that stage's own ranks left it
                decisions = [planner.decide(batch["layout"]) for planner in self.planners]
                planner, decision = self.planners[self.stage], decisions[self.stage]
                predicted_s = planner.predicted_time_s(decision.plan, batch["layout"])
                return PlannedMicroBatch(batch, decision, predicted_s, self.evaluation)
            stage, error = problem
            if self.policy == "stop":  # reached only when resuming in the middle of a step
                raise self._staged(error, stage)
            self.skipped.append(SkippedMicroBatch(batch["layout"], stage, error.report))

    def _first_infeasible(self, layout: SequenceLayout) -> tuple[int, InfeasibleSequenceError] | None:
        for stage, checker in enumerate(self._checkers):
            try:
                checker.decide(layout)
            except InfeasibleSequenceError as e:
                return stage, e
        return None

    def _check_the_shortest_fits(self) -> None:
        """Where no plan fits even the data's shortest sample alone, skipping would never end: every rank
        (each reads the same samples and checks every stage) raises instead, before any step."""
        sampler = self.loader.sampler
        problem = self._first_infeasible(sampler.layout((int(sampler.lengths.argmin()),)))
        if problem is None:
            return
        stage, error = problem
        nothing = InfeasibleSequenceError(error.report)
        where = f" on pipeline stage {stage}" if len(self.planners) > 1 else ""
        levers = error.report.unused_levers()
        nothing.args = (
            f"no plan fits even the data's shortest sample{where}, so planner.on_infeasible=skip would skip every "
            f"micro-batch: {error.report}. Give the plans more memory (memory.budget_gib, more tensor- or "
            f"pipeline-parallel ranks, fewer micro-batches in flight)" + (f", or {levers}" if levers else ""),
        )
        raise nothing

    def _check_global_batch(self, layouts: list[SequenceLayout]) -> None:
        for layout in layouts:
            problem = self._first_infeasible(layout)
            if problem is not None:
                stage, error = problem
                raise self._staged(error, stage)

    def _staged(self, error: InfeasibleSequenceError, stage: int) -> InfeasibleSequenceError:
        if len(self.planners) == 1:
            return error
        staged = InfeasibleSequenceError(error.report)
        staged.args = (f"pipeline stage {stage}: {error}",)
        return staged

    def set_budget(self, budget_bytes: float) -> None:
        """Plan every stage under ``budget_bytes`` from the next micro-batch on (the pre-flight shrank it); under
        ``skip``, where no plan fits even the data's shortest sample any more, raise as at the start."""
        for planner in (*self.planners, *self._checkers):
            planner.set_budget(budget_bytes)
        if self.policy == "skip":
            self._check_the_shortest_fits()

    def restart(self) -> None:
        """Back to the first micro-batch, with no previous plan: each evaluation then runs the same
        micro-batches under the same plans, and its losses compare from one evaluation to the next."""
        self.loader.sampler.load_state_dict(self.loader.sampler.state_dict() | {"position": (0, 0, 0), "consumed": 0})
        for planner in self.planners:
            planner.forget_previous()
        self.skipped.clear()

    # -- Megatron's checkpoint hook (``--dataloader-save``) -----------------------------------------
    def save_state(self) -> dict:
        """Where the next micro-batch comes from and how it will be planned: the data's position, the
        planners' previous plans and the learned time corrections (Megatron saves it with each checkpoint)."""
        state = {"loader": self.loader.state_dict(), "planners": [planner.state_dict() for planner in self.planners]}
        if self.time_corrections is not None:
            state["time_corrections"] = self.time_corrections.state_dict()
        return state

    def load_state(self, state: dict) -> None:
        """Continue from ``state`` (a position saved before the planners' state was: their previous plans
        start empty)."""
        try:
            self.loader.load_state_dict(state["loader"])
            for planner, saved in zip(self.planners, state.get("planners", ()), strict=False):
                planner.load_state_dict(saved)
            if self.time_corrections is not None and "time_corrections" in state:
                self.time_corrections.load_state_dict(state["time_corrections"])
                for planner in self.planners:
                    planner.clear_cache()
        except ValueError as e:
            raise ResumeError(str(e)) from e


def _checker(planner: Planner) -> Planner:
    """A planner like ``planner`` that raises on a micro-batch no plan fits."""
    return planner.with_config(dataclasses.replace(planner.config, on_infeasible="stop"))
