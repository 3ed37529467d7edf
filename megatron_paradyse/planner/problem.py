"""The planning problem of one pipeline stage for one micro-batch, and how a solution becomes a plan.

A stage has ``L`` alike layers. Layer option ``o`` costs ``t_o`` seconds, keeps ``m_o`` bytes saved
for backward and needs ``r_o`` transient bytes while it runs (:class:`~megatron_paradyse.cost.LayerCost`).
Layers run their options in one order (:func:`~megatron_paradyse.cost.base.run_order`: by decreasing
transient), so only *how many* layers take each option matters, not which ones. A solution is a count
vector ``n``::

    minimise    T(n) = sum_o n_o t_o
    subject to  sum_o n_o = L,   n_o >= 0 integer,
                peak(sum_o n_o m_o, R(n)) <= budget,   R(n) = max_{o: n_o > 0} (r_o - sum_{o' after o} n_o' m_o')

where ``R(n)`` is what the working set of a layer adds to the saved bytes of the layers before it, at
its largest (:func:`~megatron_paradyse.cost.base.stage_layer_bytes`; at most the largest ``r_o``, and
at least the smallest), ``peak`` is the cost model's stage peak, non-decreasing in both arguments, and
the host memory
of offloaded layers (``sum_o n_o h_o``) stays within the host budget. A problem is posed for
one choice of how the stage runs around its layers (:class:`~megatron_paradyse.cost.base.StageOptions`):
it sets ``peak`` and adds a constant to ``T``; an option it rules out costs infinite working memory, so
no plan that uses it fits.

A stage of Megatron's interleaved schedule runs its layers as several model chunks, and each chunk of a
micro-batch holds its activations from its own forward to its own backward. Such a problem is posed for
one chunk (``L`` its layers, the budget one chunk's share) and every chunk runs its plan: ``T`` counts
the stage's layers, the peak one chunk's. A chunk with fewer layers than the largest runs the plan's
first layers, whose peak is no higher (:meth:`StageProblem.to_plan` orders them for that).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from megatron_paradyse.core.plan import LayerOption, Plan
from megatron_paradyse.cost.base import WHOLE_LOSS, LayerCost, StageOptions, run_order, stage_layer_bytes

__all__ = ["Solution", "StageProblem"]

_ROUNDING = 1e-12
"""Relative slack of the memory bounds: what floating-point rounding of their arithmetic may move them."""

PeakFn = Callable[[float, float], float]
"""``(sum of saved bytes, largest transient bytes) -> predicted stage peak bytes``."""


@dataclasses.dataclass(frozen=True, slots=True)
class Solution:
    """A count vector with its predicted cost."""

    counts: tuple[int, ...]
    """Layers per option, aligned with :attr:`StageProblem.options`."""
    time_s: float
    saved_bytes: float
    transient_bytes: float
    peak_bytes: float
    host_bytes: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class StageProblem:
    """Costs of every option for one micro-batch, the stage's depth and its memory budget."""

    options: tuple[LayerOption, ...]
    costs: tuple[LayerCost, ...]
    num_layers: int
    """Layers a solution counts: the stage's, or its largest model chunk's (:attr:`chunk_layers`)."""
    budget_bytes: float
    peak: PeakFn
    stage: StageOptions = WHOLE_LOSS
    stage_time_s: float = 0.0
    """What ``stage`` adds to every plan's time."""
    host_budget_bytes: float = math.inf
    """Host memory the offloaded layers' inputs may take (per rank)."""
    chunk_layers: tuple[int, ...] = ()
    """Layers of each model chunk of the stage, in layer order, when it runs several (the largest is
    :attr:`num_layers`); empty: one."""
    saved_budget_bytes: float = math.inf
    """The most saved bytes a plan's layers may keep: what the stage holds of it while other forwards
    run (:class:`~megatron_paradyse.planner.planner.Planner`'s forwards in flight)."""
    run_order: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
    """The options in the order the layers run them (:func:`~megatron_paradyse.cost.base.run_order`)."""

    def __post_init__(self) -> None:
        if len(self.options) != len(self.costs) or not self.options:
            raise ValueError(f"need one cost per option, got {len(self.options)} options, {len(self.costs)} costs")
        if self.num_layers < 1:
            raise ValueError(f"a stage needs at least one layer, got num_layers={self.num_layers}")
        if self.chunk_layers and max(self.chunk_layers) != self.num_layers:
            raise ValueError(f"num_layers={self.num_layers} is not the largest of chunk_layers={self.chunk_layers}")
        order = sorted(range(len(self.options)), key=lambda o: (*run_order(self.options[o], self.costs[o]), o))
        object.__setattr__(self, "run_order", tuple(order))

    @property
    def repeats(self) -> int:
        """How many times the stage runs a solution's layers: once per model chunk."""
        return max(1, len(self.chunk_layers))

    def evaluate(self, counts: Sequence[int]) -> Solution:
        """Predicted time and peak of a count vector (sums in option order, so every rank gets the same
        bits). The time and host bytes are every chunk's, as if each had :attr:`num_layers` layers."""
        time_s, host = 0.0, 0.0
        for n, cost in zip(counts, self.costs):
            if n:
                time_s += n * cost.time_s
                host += n * cost.host_bytes
        saved, transient = stage_layer_bytes(((counts[o], self.costs[o]) for o in self.run_order), self.num_layers)
        return Solution(
            tuple(counts),
            self.stage_time_s + self.repeats * time_s,
            saved,
            transient,
            self.peak(saved, transient),
            self.repeats * host,
        )

    def uniform(self, option: int) -> tuple[int, ...]:
        """Count vector of the plan that runs ``options[option]`` on every layer."""
        counts = [0] * len(self.options)
        counts[option] = self.num_layers
        return tuple(counts)

    def leanest(self) -> Solution:
        """The uniform plan of least predicted peak within the host budget and the saved bytes' (if any
        is; else the host budget's alone); an offloaded option takes as many layers as the host budget
        holds, beside one other option on the rest. What a report names as the leanest plan: a mix can
        peak lower still (a working-set-heavy option on a few first layers, beside few saved bytes), so
        whether any plan fits is :func:`~megatron_paradyse.planner.exact.solve_exact`'s answer, not this
        plan's.
        """
        candidates = [self.uniform(o) for o in range(len(self.options))]
        for o, cost in enumerate(self.costs):
            if cost.host_bytes and self.repeats * cost.host_bytes * self.num_layers > self.host_budget_bytes:
                held = int(self.host_budget_bytes // (self.repeats * cost.host_bytes))
                for other, other_cost in enumerate(self.costs):
                    if not other_cost.host_bytes:
                        counts = [0] * len(self.options)
                        counts[o], counts[other] = held, self.num_layers - held
                        candidates.append(tuple(counts))
        best = None
        for counts in candidates:
            candidate = self.evaluate(counts)
            if candidate.host_bytes > self.host_budget_bytes:
                continue
            key = (candidate.saved_bytes > self.saved_budget_bytes, candidate.peak_bytes)
            if best is None or key < best[0]:
                best = key, candidate
        return best[1]

    def fits(self, solution: Solution) -> bool:
        # the saved budget is a difference (the planner's held cap less the stage's own activations): the plan
        # that set the cap meets it again only up to rounding
        return (
            solution.peak_bytes <= self.budget_bytes * (1 + _ROUNDING)
            and solution.host_bytes <= self.host_budget_bytes
            and solution.saved_bytes <= self.saved_budget_bytes * (1 + _ROUNDING)
        )

    def to_plan(self, solution: Solution) -> Plan:
        """The plan of a count vector, its layers in :attr:`run_order`, the order its peak was
        predicted for: the working-set-heavy fast options run on the first layers, the lean ones last
        (in forward, layer ``l`` runs while layers ``1..l-1`` hold their activations; in backward, 1F1B
        included, before they release them: other in-flight micro-batches only add a constant).

        With model chunks, each chunk runs that order, a shorter one its first layers: a prefix of it
        holds no more than the whole (its saved bytes a part, its working sets among the whole's, each
        beside no more than there), and its time is what its layers take.
        """
        order = [o for o in self.run_order for _ in range(solution.counts[o])]
        chunks = self.chunk_layers or (self.num_layers,)
        run = [o for layers in chunks for o in order[:layers]]
        time_s = solution.time_s
        if min(chunks) < self.num_layers:
            time_s = self.stage_time_s + sum(self.costs[o].time_s for o in run)
        return Plan(
            tuple(self.options[o] for o in run),
            loss_chunk_tokens=self.stage.loss_chunk_tokens,
            predicted_time_s=time_s,
            predicted_peak_bytes=solution.peak_bytes,
        )
