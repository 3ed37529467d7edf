"""The per-micro-batch planner of one pipeline stage.

``Planner.decide(layout, micro_batch_size)`` returns the plan a micro-batch runs: one
``(attention, MLP, recompute, offload)`` option per layer, and on the stage that holds the output layer whether
its loss runs in chunks, of least predicted time whose predicted peak fits the memory budget. A chunked
loss only adds time, so it is priced (:meth:`CostModel.stage_options`) only where memory keeps the
layers from their fastest options. It is a pure function of the micro-batch's lengths, the configuration, the cost
model and the previous plan (hysteresis), so every rank of a group computes the same plan without
talking (the start-up check of :mod:`megatron_paradyse.run.agreement` makes sure their inputs agree).

Plans are cached by length bucket (:mod:`~megatron_paradyse.planner.cache`): a micro-batch is planned as
if it filled its bucket (costs at the bucket's upper edge, which over-estimates memory, never
under-estimates it). A micro-batch no plan fits is reported before anything runs, with the longest
length that does fit (:mod:`~megatron_paradyse.planner.decision`), and skipped or stopped on as
configured.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Sequence

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption, Plan
from megatron_paradyse.cost.base import WHOLE_LOSS, CostModel, LayerCost, StageOptions
from megatron_paradyse.cost.correction import CorrectedCostModel, TimeCorrections
from megatron_paradyse.planner.buckets import LengthBuckets
from megatron_paradyse.planner.cache import BucketKey, PlanCache, PlannedBucket, Previous
from megatron_paradyse.planner.config import PlannerConfig, layer_options
from megatron_paradyse.planner.decision import Decision, InfeasibleReport, InfeasibleSequenceError
from megatron_paradyse.planner.exact import solve_exact
from megatron_paradyse.planner.exploration import Exploration
from megatron_paradyse.planner.heuristic import solve_heuristic
from megatron_paradyse.planner.problem import StageProblem
from megatron_paradyse.strategies import ModelShape

__all__ = ["ForwardOnlyCost", "Planner"]

logger = logging.getLogger(__name__)

_GIB = 2**30
_LONGEST_SEARCHED = 2**31
"""Tokens beyond which the longest-feasible-length search stops and reports this bound."""


class Planner:
    """Chooses every layer's option of one pipeline stage for each micro-batch.

    Args:
        config: the ``planner`` section of the config.
        cost_model: predicts each option's :class:`~megatron_paradyse.cost.LayerCost` and the stage peak.
        options: the options a layer may take (see :func:`layer_options`, or :meth:`for_model`).
        num_layers: transformer layers on this stage.
        budget_bytes: memory the stage's predicted peak may reach (device memory minus a margin).
        chunk_layers: layers of each model chunk of the stage, in layer order, where it runs several
            (Megatron's interleaved schedule); the plan is one chunk's, run by each
            (:class:`~megatron_paradyse.planner.problem.StageProblem`).
        forwards_in_flight: the most forwards (of micro-batches, or of one model chunk of them) whose
            backward has not run that the stage holds at once
            (:func:`~megatron_paradyse.run.stage_planning.forwards_in_flight`); with several,
            ``longest_tokens`` is the longest micro-batch a step may have (:meth:`set_step_longest`
            narrows it to the step about to run).
        reserved_bytes_per_token: what the stage keeps beside its forwards, per token of the step's
            longest micro-batch, out of ``budget_bytes`` (a receiving pipeline stage keeps the previous
            micro-batch's input and its gradient: :func:`~megatron_paradyse.run.stage_planning.step_stage_budgets`).
        bucket_cap: the longest micro-batch the planner will see, in tokens (a job's ``--seq-length``): the
            last length bucket ends there, so no plan is priced past it (:class:`LengthBuckets`); None:
            the buckets run on as the config's series puts them.

    **Forwards in flight.** The stage peaks while one forward runs and the ``n - 1`` others hold what
    they keep for their backward (:meth:`CostModel.held_bytes`). Every forward is planned to hold at
    most ``A`` and to peak at most at the budget less ``(n - 1) A``, so the stage keeps within the
    budget whatever lengths and plans its forwards have. ``A`` is what a micro-batch of
    ``longest_tokens`` holds under the fastest plan that fits ``n`` of it at once: the longest
    micro-batch gets the plan it would have if every forward in flight were as long, and one working
    set is counted beside the held activations, not ``n``. A pipeline drains at the end of each step, so
    only one step's forwards are ever in flight together: where the step's micro-batches are known before
    it runs, ``A`` is its longest one's (:meth:`set_step_longest`), and a step of short micro-batches
    leaves each of them the room a step with a ``longest_tokens`` one would not; so does what the stage
    keeps beside them (``reserved_bytes_per_token``).
    """

    def __init__(
        self,
        config: PlannerConfig,
        cost_model: CostModel,
        *,
        options: Sequence[LayerOption],
        num_layers: int,
        budget_bytes: float,
        chunk_layers: Sequence[int] = (),
        forwards_in_flight: int = 1,
        longest_tokens: int | None = None,
        reserved_bytes_per_token: float = 0.0,
        bucket_cap: int | None = None,
    ) -> None:
        options = tuple(options)
        if not options or len(set(options)) != len(options):
            raise ValueError(f"options must be distinct and non-empty, got {[str(o) for o in options]}")
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        chunk_layers = tuple(chunk_layers)
        if chunk_layers and (sum(chunk_layers) != num_layers or min(chunk_layers) < 1):
            raise ValueError(f"chunk_layers {chunk_layers} must be positive and add up to num_layers={num_layers}")
        if not isinstance(forwards_in_flight, int) or forwards_in_flight < 1:
            raise ValueError(f"forwards_in_flight must be a positive int, got {forwards_in_flight!r}")
        if forwards_in_flight > 1 and not (isinstance(longest_tokens, int) and longest_tokens > 0):
            raise ValueError(
                f"with {forwards_in_flight} forwards in flight the planner needs the longest micro-batch's tokens "
                f"(longest_tokens), got {longest_tokens!r}"
            )
        if not 0 <= reserved_bytes_per_token < math.inf:
            raise ValueError(f"reserved_bytes_per_token must be finite and >= 0, got {reserved_bytes_per_token!r}")
        if reserved_bytes_per_token and not (isinstance(longest_tokens, int) and longest_tokens > 0):
            raise ValueError(
                f"a reserve per token needs the longest micro-batch's tokens (longest_tokens), got {longest_tokens!r}"
            )
        self.config = config
        self.cost_model = cost_model
        self.options = options
        self.num_layers = num_layers
        self.chunk_layers = chunk_layers if len(chunk_layers) > 1 else ()
        self.forwards_in_flight = forwards_in_flight
        self.longest_tokens = longest_tokens
        self.reserved_bytes_per_token = float(reserved_bytes_per_token)
        self._step_longest: int | None = None
        self._held_caps: dict[tuple, float] = {}
        self.excluded: dict[str, str] = {}
        """Strategies (or pairs) left out of the plan space, with the reason (set by :meth:`for_model`)."""
        self._solve = solve_exact if config.space.method == "exact" else solve_heuristic
        self._cache = PlanCache(config.cache, bucket_cap)
        self._longest: dict[tuple, int] = {}
        self._stage_options = cost_model.stage_options(config.space.loss_chunk_tokens)
        self._previous: Previous | None = None
        self.exploration: Exploration | None = None
        """Set where the time model learns: now and then a plan it cannot tell from the optimum."""
        self.set_budget(budget_bytes)

    @classmethod
    def for_model(
        cls,
        config: PlannerConfig,
        cost_model: CostModel,
        *,
        shape: ModelShape,
        p: int,
        num_layers: int,
        budget_bytes: float,
        chunk_layers: Sequence[int] = (),
        forwards_in_flight: int = 1,
        longest_tokens: int | None = None,
        reserved_bytes_per_token: float = 0.0,
        bucket_cap: int | None = None,
        time_corrections: TimeCorrections | None = None,
    ) -> Planner:
        """A planner over the options ``config`` enables for ``shape`` on ``p`` ranks.

        Strategies the model cannot use are logged once, here, and kept in :attr:`excluded`. With
        ``time_corrections`` the planner learns: it prices time with ``cost_model``'s times corrected by
        them (:meth:`observe_time` feeds them), and explores as ``config.learning.explore_share`` allows.
        """
        options, excluded = layer_options(config, shape, p)
        for what, why in excluded.items():
            logger.warning("planner: %s is left out of the plan space: %s", what, why)
        if time_corrections is not None:
            cost_model = CorrectedCostModel(cost_model, time_corrections)
        planner = cls(
            config,
            cost_model,
            options=options,
            num_layers=num_layers,
            budget_bytes=budget_bytes,
            chunk_layers=chunk_layers,
            forwards_in_flight=forwards_in_flight,
            longest_tokens=longest_tokens,
            reserved_bytes_per_token=reserved_bytes_per_token,
            bucket_cap=bucket_cap,
        )
        planner.excluded = excluded
        learning = config.learning
        if time_corrections is not None and learning.explore_share > 0:
            share, margin = learning.explore_share, learning.explore_margin
            planner.exploration = Exploration(time_corrections, share=share, margin=margin)
        return planner

    @property
    def budget_bytes(self) -> float:
        return self._budget

    @property
    def buckets(self) -> LengthBuckets:
        """The length buckets micro-batches are planned at the upper edge of."""
        return self._cache.buckets

    def with_config(self, config: PlannerConfig) -> Planner:
        """A new planner like this one (cost model, options, layers, budget, buckets), planning by ``config``."""
        return Planner(
            config,
            self.cost_model,
            options=self.options,
            num_layers=self.num_layers,
            budget_bytes=self.budget_bytes,
            chunk_layers=self.chunk_layers,
            forwards_in_flight=self.forwards_in_flight,
            longest_tokens=self.longest_tokens,
            reserved_bytes_per_token=self.reserved_bytes_per_token,
            bucket_cap=self.buckets.cap,
        )

    def set_budget(self, budget_bytes: float) -> None:
        """Change the memory budget (e.g. shrink it after a real out-of-memory error); drops cached plans."""
        if not budget_bytes > 0 or math.isinf(budget_bytes):
            raise ValueError(f"budget_bytes must be a positive finite number, got {budget_bytes!r}")
        self._budget = float(budget_bytes)
        self.clear_cache()

    def clear_cache(self) -> None:
        """Forget cached plans (the previous plan stays, for hysteresis)."""
        self._cache.clear()
        self._longest.clear()
        self._held_caps.clear()

    def set_step_longest(self, tokens: int | None) -> None:
        """The tokens of the longest micro-batch of the step about to run, which every forward in flight
        with the ones planned next belongs to, and what the stage keeps beside them is no longer than (None:
        any step's, ``longest_tokens``). Plans and the held cap are cached per step length (its bucket's
        edge), so steps alike reuse them."""
        if tokens is not None and not (isinstance(tokens, int) and tokens > 0):
            raise ValueError(f"the step's longest micro-batch must be a positive number of tokens, got {tokens!r}")
        self._step_longest = tokens

    def step_budget_bytes(self, p: int) -> float:
        """What the stage's forwards may hold at once in the step (:meth:`set_step_longest`) on ``p`` ranks:
        the budget less the reserve."""
        return self._budget - self.reserved_bytes_per_token * (self._step_edge(p) or 0)

    def forget_previous(self) -> None:
        """Start a new run of decisions: no previous plan for hysteresis (cached plans stay)."""
        self._previous = None

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the planner: the previous plan (hysteresis), so that a resumed run
        plans its first micro-batch as the uninterrupted run would."""
        state: dict = {"previous": None}
        if self._previous is not None:
            stage, counts = self._previous
            state["previous"] = list(counts)
            state["previous_stage"] = dataclasses.asdict(stage)
        if self.exploration is not None:
            state["exploration"] = self.exploration.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        previous = state.get("previous")
        if previous is not None and len(previous) != len(self.options):
            raise ValueError(
                f"the saved previous plan counts {len(previous)} layer options, this planner has {len(self.options)}"
            )
        stage = StageOptions(**state.get("previous_stage", {}))
        self._previous = None if previous is None else (stage, tuple(int(n) for n in previous))
        if self.exploration is not None and "exploration" in state:
            self.exploration.load_state_dict(state["exploration"])

    def observe_time(self, layout: SequenceLayout, plan: Plan, measured_s: float, micro_batch_size: int = 1) -> None:
        """Account a micro-batch laid out as ``layout`` that ran ``plan`` in ``measured_s`` (its forward and
        backward on this stage, as :class:`~megatron_paradyse.run.log.MicroBatchMeter` measures it) in the
        time corrections of a planner built to learn; the ranks then agree on them
        (:meth:`TimeCorrections.agree`) before any plan uses them."""
        if not isinstance(self.cost_model, CorrectedCostModel):
            raise TypeError(
                "observe_time: this planner does not learn; build it with Planner.for_model(..., time_corrections=...)"
            )
        bucket = self.bucket_layout(layout, micro_batch_size).padded_len
        times = self.cost_model.option_times(plan, layout, micro_batch_size)
        fixed = self.cost_model.stage_time_s(layout, micro_batch_size, StageOptions.of(plan))
        self.cost_model.corrections.observe(plan, bucket, times, measured_s, fixed)

    def predicted_time_s(self, plan: Plan, layout: SequenceLayout, micro_batch_size: int = 1) -> float:
        """What a micro-batch laid out as ``layout`` that runs ``plan`` should take: the plan's time at
        ``layout`` as it is (:meth:`decide` priced its bucket's upper edge, a bound for memory, not the
        time to expect), with the corrections learned at its bucket where this planner learns."""
        model = self.cost_model
        fixed = model.stage_time_s(layout, micro_batch_size, StageOptions.of(plan))
        if isinstance(model, CorrectedCostModel):
            bucket = self.bucket_layout(layout, micro_batch_size).padded_len
            return model.corrections.predicted_s(
                plan, bucket, model.option_times(plan, layout, micro_batch_size), fixed
            )
        return math.fsum(model.layer_cost(option, layout, micro_batch_size).time_s for option in plan) + fixed

    def bucket_layout(self, layout: SequenceLayout, micro_batch_size: int = 1) -> SequenceLayout:
        """The layout :meth:`decide` costs ``layout`` at: its bucket's upper edge."""
        return self._cache.layout(self._key(layout, micro_batch_size))

    def decide(self, layout: SequenceLayout, micro_batch_size: int = 1) -> Decision | None:
        """The plan for a micro-batch of ``micro_batch_size`` samples laid out as ``layout``.

        None when no plan fits and ``on_infeasible`` is ``skip`` (logged as a warning); with ``stop``
        that raises :class:`InfeasibleSequenceError` instead.
        """
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
        key = self._key(layout, micro_batch_size)
        bucket, cached = self._cache.get_or_plan(key, self._plan_bucket)
        if bucket.solution is None:
            return self._infeasible(layout, micro_batch_size, key[0], bucket.problem)
        problem, solution, plan, kept = bucket.problem, bucket.solution, bucket.plan, False
        previous = self._cache.previous_kept(bucket, self._previous)
        if previous is not None:
            problem, solution = previous
            plan, kept = problem.to_plan(solution), True
        self._previous = (problem.stage, solution.counts)  # hysteresis follows the planner's choice, not a trial
        if self.exploration is not None:
            trial = self.exploration.alternative(problem, solution, key[0])
            if trial is not None:
                return Decision(problem.to_plan(trial), cached, False, key[0], bucket.solution.time_s, True)
        return Decision(plan, cached, kept, key[0], bucket.solution.time_s)

    def stage_problem(
        self, layout: SequenceLayout, micro_batch_size: int = 1, stage: StageOptions = WHOLE_LOSS
    ) -> StageProblem:
        """The problem :meth:`decide` solves for ``layout`` and ``stage``: option costs at its bucket's
        upper edge."""
        layout = self.bucket_layout(layout, micro_batch_size)
        return self._problem(layout, micro_batch_size, self._costs(layout, micro_batch_size), stage)

    def fits(self, layout: SequenceLayout, micro_batch_size: int = 1) -> bool:
        """Whether some plan fits ``layout`` (costed as it is, not at its bucket's edge)."""
        problems = self._problems(layout, micro_batch_size, stop_when_fastest=False)
        return any(solve_exact(problem) is not None for problem in problems.values())

    def leanest_peak_bytes(self, layout: SequenceLayout, micro_batch_size: int = 1) -> float:
        """The least predicted peak of any plan for ``layout`` (costed as it is)."""
        problems = self._problems(layout, micro_batch_size, stop_when_fastest=False)
        return min(problem.leanest().peak_bytes for problem in problems.values())

    def max_feasible_length(self, p: int, *, causal: bool, micro_batch_size: int = 1) -> int:
        """Longest padded length of one document some plan fits (a bucket edge); 0 if none does.

        Binary search over bucket edges, assuming the leanest plan's peak grows with length.
        """
        key = (p, causal, micro_batch_size, self._step_edge(p))
        if key not in self._longest:
            self._longest[key] = self._search_longest(p, causal, lambda layout: self.fits(layout, micro_batch_size))
        return self._longest[key]

    def past_longest(self, layout: SequenceLayout, micro_batch_size: int = 1) -> bool:
        """Whether :meth:`decide` would plan ``layout`` at a bucket past :meth:`max_feasible_length`, where
        no plan fits (as that search assumes): known without pricing it. False past the search's bound."""
        longest = self.max_feasible_length(layout.p, causal=layout.causal, micro_batch_size=micro_batch_size)
        return longest < _LONGEST_SEARCHED and self.bucket_layout(layout, micro_batch_size).padded_len > longest

    # -- internals --------------------------------------------------------------------------------
    def _key(self, layout: SequenceLayout, micro_batch_size: int) -> BucketKey:
        """The plan cache's key of ``layout``, with the step's length (:meth:`_step_edge`)."""
        return self._cache.key(layout, micro_batch_size, self._step_edge(layout.p))

    def _step_edge(self, p: int) -> int | None:
        """The step's longest micro-batch (or any step's) at its bucket's edge: what sets the held cap
        (:meth:`_held_cap`) and the reserve; None where neither is (one forward in flight, no reserve)."""
        if self.forwards_in_flight == 1 and not self.reserved_bytes_per_token:
            return None
        tokens = self._step_longest or self.longest_tokens
        return self._cache.buckets.edge(-(-tokens // (2 * p)) * 2 * p, 2 * p)

    def _plan_bucket(self, key: BucketKey) -> PlannedBucket:
        edge, micro_batch_size = key[:2]
        layout = self._cache.layout(key)
        problems = self._problems(layout, micro_batch_size, stop_when_fastest=True)
        solutions = {stage: self._solve(problem) for stage, problem in problems.items()}
        feasible = [stage for stage in problems if solutions[stage] is not None]
        if not feasible:
            lean = min(problems.values(), key=lambda problem: problem.leanest().peak_bytes)
            return PlannedBucket(problems, lean, None, None)
        # ties go to the first stage option (the whole loss)
        stage = min(feasible, key=lambda stage: solutions[stage].time_s)
        problem, solution = problems[stage], solutions[stage]
        plan = problem.to_plan(solution)
        logger.debug(
            "planner: bucket %d x %d: %s (%.4g s, %.2f GiB)",
            edge,
            micro_batch_size,
            plan.compact(),
            plan.predicted_time_s,
            plan.predicted_peak_bytes / _GIB,
        )
        return PlannedBucket(problems, problem, solution, plan)

    def _problems(
        self, layout: SequenceLayout, micro_batch_size: int, *, stop_when_fastest: bool
    ) -> dict[StageOptions, StageProblem]:
        """The problem of each stage option, in the cost model's order (the whole loss first). With
        ``stop_when_fastest``, none after a problem whose fastest plan fits: every further option adds
        time to the same layers, so none can beat it."""
        costs = self._costs(layout, micro_batch_size)
        problems = {}
        for stage in self._stage_options:
            problem = problems[stage] = self._problem(layout, micro_batch_size, costs, stage)
            fastest = min(range(len(costs)), key=lambda o: (costs[o].time_s, costs[o].saved_bytes))
            if stop_when_fastest and problem.fits(problem.evaluate(problem.uniform(fastest))):
                break
        return problems

    def _costs(self, layout: SequenceLayout, micro_batch_size: int) -> tuple[LayerCost, ...]:
        costs = tuple(self.cost_model.layer_cost(o, layout, micro_batch_size) for o in self.options)
        for option, cost in zip(self.options, costs):
            values = (cost.time_s, cost.saved_bytes, cost.transient_bytes)
            if not all(math.isfinite(v) and v >= 0 for v in values):
                raise ValueError(
                    f"the cost model returned {cost} for {option} at {layout.padded_len} tokens; "
                    f"costs must be finite and non-negative"
                )
        return costs

    def _problem(
        self,
        layout: SequenceLayout,
        micro_batch_size: int,
        costs: tuple[LayerCost, ...],
        stage: StageOptions,
        *,
        in_flight_alike: bool = False,
    ) -> StageProblem:
        """The problem of one forward of ``layout``; ``in_flight_alike``: of one while the other forwards in
        flight are alike (what sets the held cap, :meth:`_held_cap`)."""
        # an option the stage option rules out needs infinite working memory: no plan with it fits
        costs = tuple(
            dataclasses.replace(cost, transient_bytes=math.inf) if stage.rules_out(option) else cost
            for option, cost in zip(self.options, costs)
        )
        peak = functools.partial(self.cost_model.peak_bytes, layout, micro_batch_size, stage=stage)
        budget, saved_budget = self.step_budget_bytes(layout.p), math.inf
        others = self.forwards_in_flight - 1
        if others and in_flight_alike:
            held = functools.partial(self.cost_model.held_bytes, layout, micro_batch_size, stage=stage)
            peak = lambda saved, transient, alone=peak: alone(saved, transient) + others * held(saved)  # noqa: E731
        elif others:
            cap = self._held_cap(layout.p, layout.causal, micro_batch_size)
            budget -= others * cap
            saved_budget = cap - self.cost_model.held_bytes(layout, micro_batch_size, 0.0, stage)
        stage_time = self.cost_model.stage_time_s(layout, micro_batch_size, stage)
        host_budget = self.config.space.host_memory_gib * _GIB
        return StageProblem(
            self.options,
            costs,
            max(self.chunk_layers, default=self.num_layers),
            budget,
            peak,
            stage,
            stage_time,
            host_budget,
            self.chunk_layers,
            saved_budget,
        )

    def _held_cap(self, p: int, causal: bool, micro_batch_size: int) -> float:
        """``A`` of the class docstring: what the longest micro-batch holds under the fastest plan that fits
        all forwards in flight alike; where none fits it, the longest micro-batch for which one does is
        taken instead (then the longest ones are reported, and as many others as can be train)."""
        edge = self._step_edge(p)
        key = (p, causal, micro_batch_size, edge)
        if key not in self._held_caps:
            layout = SequenceLayout((edge,), p, causal, edge)

            def alike_fits(layout: SequenceLayout) -> bool:
                problems = self._alike_problems(layout, micro_batch_size)
                return any(solve_exact(problem) is not None for problem in problems)

            if not alike_fits(layout):
                edge = self._search_longest(p, causal, alike_fits) or layout.padded_len
                layout = SequenceLayout((edge,), p, causal, edge)
            problems = self._alike_problems(layout, micro_batch_size)
            solved = [(solution, problem) for problem in problems if (solution := self._solve(problem)) is not None]
            if solved:  # ties go to the first stage option, as in decide
                solution, problem = min(solved, key=lambda pair: pair[0].time_s)
            else:  # not even the shortest fits: nothing will
                solution, problem = min(
                    ((problem.leanest(), problem) for problem in problems), key=lambda pair: pair[0].peak_bytes
                )
            self._held_caps[key] = self.cost_model.held_bytes(
                layout, micro_batch_size, solution.saved_bytes, problem.stage
            )
        return self._held_caps[key]

    def _alike_problems(self, layout: SequenceLayout, micro_batch_size: int) -> list[StageProblem]:
        """The problems of one forward of ``layout`` (a bucket's edge) while every other forward in flight is
        alike, one per stage option."""
        costs = self._costs(layout, micro_batch_size)
        return [
            self._problem(layout, micro_batch_size, costs, stage, in_flight_alike=True) for stage in self._stage_options
        ]

    def _infeasible(self, layout: SequenceLayout, micro_batch_size: int, edge: int, problem: StageProblem) -> None:
        leanest = problem.leanest()
        held = {}
        if self.forwards_in_flight > 1:
            bucket = self.bucket_layout(layout, micro_batch_size)
            held = dict(
                forwards_in_flight=self.forwards_in_flight,
                held_cap_bytes=self._held_cap(layout.p, layout.causal, micro_batch_size),
                leanest_held_bytes=self.cost_model.held_bytes(
                    bucket, micro_batch_size, leanest.saved_bytes, problem.stage
                ),
                stage_budget_bytes=self.step_budget_bytes(layout.p),
            )
        report = InfeasibleReport(
            length=layout.valid_len,
            padded_length=layout.padded_len,
            bucket_length=edge,
            micro_batch_size=micro_batch_size,
            budget_bytes=problem.budget_bytes,
            leanest_peak_bytes=leanest.peak_bytes,
            leanest_plan=problem.to_plan(leanest),
            longest_feasible_length=self.max_feasible_length(
                layout.p, causal=layout.causal, micro_batch_size=micro_batch_size
            ),
            **held,
        )
        if self.config.on_infeasible == "stop":
            raise InfeasibleSequenceError(report)
        logger.warning("planner: skipping a micro-batch: %s", report)
        return None

    def _search_longest(self, p: int, causal: bool, layout_fits: Callable[[SequenceLayout], bool]) -> int:
        """The longest bucket edge of one document on ``p`` ranks that ``layout_fits``; 0 if none."""

        def fits(index: int) -> bool:
            edge = self._cache.buckets.edge_at(index, 2 * p)
            return layout_fits(SequenceLayout((edge,), p, causal, edge))

        if not fits(0):
            return 0
        lo, hi = 0, 1  # fits(lo); gallop until not fits(hi)
        while fits(hi):
            lo, hi = hi, 2 * hi
            if self._cache.buckets.edge_at(lo, 2 * p) >= _LONGEST_SEARCHED:
                return self._cache.buckets.edge_at(lo, 2 * p)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return self._cache.buckets.edge_at(lo, 2 * p)


class ForwardOnlyCost:
    """A training cost model's prices for forward-only passes (evaluation, under ``torch.no_grad()``),
    for a :class:`Planner` of evaluation micro-batches.

    Nothing is kept for a backward: besides what every plan holds (static bytes, the stage's input and
    tables), a stage holds one activation ``[s/p, b, h]`` between layers (the input of the layer that
    runs, or the last layer's output while the output layer runs) and the working set of one layer.
    That working set is priced as the layer's whole training high-water mark, forward and backward
    (its saved plus transient bytes), an upper bound of its forward alone, which the cost models do
    not price apart (``tests/ranks/test_evaluation.py`` measures every option's no-grad forward against
    it). Times stay the training pass's (forward and backward): they rank the plans, they do not
    predict an evaluation step.

    Args:
        training: the stage's :class:`~megatron_paradyse.cost.AnalyticCostModel` (its ``shape``,
            ``p`` and ``element_size`` give the activation's size).
    """

    def __init__(self, training) -> None:
        self.training = training
        self.shape = training.shape

    def activation_bytes(self, layout: SequenceLayout, micro_batch_size: int) -> float:
        tokens = layout.padded_len * micro_batch_size // self.training.p
        return tokens * self.shape.hidden_size * self.training.element_size

    def layer_cost(self, option: LayerOption, layout: SequenceLayout, micro_batch_size: int) -> LayerCost:
        cost = self.training.layer_cost(option, layout, micro_batch_size)
        return LayerCost(cost.time_s, saved_bytes=0.0, transient_bytes=cost.saved_bytes + cost.transient_bytes)

    def peak_bytes(
        self,
        layout: SequenceLayout,
        micro_batch_size: int,
        saved_bytes: float,
        transient_bytes: float,
        stage: StageOptions = WHOLE_LOSS,
    ) -> float:
        """``saved_bytes`` is 0 (no layer keeps anything); one activation stands in for it."""
        held = self.activation_bytes(layout, micro_batch_size)
        return self.training.peak_bytes(layout, micro_batch_size, held, transient_bytes, stage)

    def stage_options(self, loss_chunk_tokens: int) -> tuple[StageOptions, ...]:
        return self.training.stage_options(loss_chunk_tokens)

    def stage_time_s(self, layout: SequenceLayout, micro_batch_size: int, stage: StageOptions) -> float:
        return self.training.stage_time_s(layout, micro_batch_size, stage)
