"""A run's curve over a length-sorted dataset: the sequences a planner trains, in order, until the first
that no plan fits, and the predicted time so far after each (:mod:`megatron_paradyse.bench.simulate`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.planner import InfeasibleSequenceError, Planner, PlannerConfig

__all__ = ["Curve", "Run", "longest_fitting", "simulate_curve"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """One curve: a name, the paper's name for it, and the planner that plans its sequences."""

    name: str
    paper_name: str
    planner: PlannerConfig
    static: bool


@dataclasses.dataclass(kw_only=True)
class Curve:
    """What one run did over the length-sorted dataset."""

    run: Run
    lengths: list[int]
    """Sequences trained, in order."""
    cumulative_s: list[float]
    """Predicted time of the sequences so far, after each one."""
    stopped_at: int | None
    """The first sequence no plan fits (the curve ends before it), or None: the dataset finished."""
    max_feasible: int | None
    """Longest padded length some plan fits (a bucket edge: a multiple of 512, the paper's rounding);
    None when every sequence fit (the longest is beyond the dataset's longest and not searched)."""
    plans: dict[str, int]
    """Sequences per plan (compact form)."""

    @property
    def reached(self) -> int:
        return self.lengths[-1] if self.lengths else 0

    @property
    def longest(self) -> float:
        """:attr:`max_feasible`, infinite when every sequence fit: for comparisons."""
        return math.inf if self.max_feasible is None else self.max_feasible

    @property
    def total_s(self) -> float:
        return self.cumulative_s[-1] if self.cumulative_s else 0.0

    def cumulative_at(self, length: int) -> float | None:
        """Time up to the last sequence of at most ``length`` tokens; None if the curve ended before it."""
        if self.stopped_at is not None and self.stopped_at <= length:
            return None
        i = int(np.searchsorted(self.lengths, length, side="right"))
        return self.cumulative_s[i - 1] if i else 0.0


def longest_fitting(planner: Planner, p: int, *, causal: bool, fits: int, limit: int) -> int | None:
    """The longest bucket edge some plan of ``planner`` fits (as :meth:`Planner.max_feasible_length`),
    searched from the bucket of ``fits`` tokens (known to fit; 0: none known) up to that of ``limit``;
    None when that one fits too. Bounded, so that a model fitting millions of tokens is not searched
    beyond the dataset."""
    buckets = planner.buckets

    def index(n: int) -> int:
        """Of the bucket holding ``n`` tokens: the first whose edge is at least ``n``."""
        if buckets.edge_at(0, 2 * p) >= n:
            return 0
        lo, hi = 0, 1  # edge(lo) < n; gallop until edge(hi) >= n, then bisect
        while buckets.edge_at(hi, 2 * p) < n:
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if buckets.edge_at(mid, 2 * p) < n else (lo, mid)
        return hi

    def fit(i: int) -> bool:
        return planner.fits(SequenceLayout.build(buckets.edge_at(i, 2 * p), p, causal=causal))

    top = index(limit)
    if fit(top):
        return None
    lo, hi = (index(fits), top) if fits else (-1, top)  # fit(lo) (or lo = -1), not fit(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fit(mid) else (lo, mid)
    return buckets.edge_at(lo, 2 * p) if lo >= 0 else 0


def simulate_curve(run: Run, planner: Planner, lengths: Sequence[int], p: int, *, causal: bool) -> Curve:
    """Plan ``lengths`` in order (the caller sorts them) until the first that no plan fits."""
    cumulative, trained, plans, stopped = 0.0, [], {}, None
    times = []
    for n in lengths:
        try:
            decision = planner.decide(SequenceLayout.build(int(n), p, causal=causal))
        except InfeasibleSequenceError:
            decision = None
        if decision is None:  # no plan fits: raised under on_infeasible=stop, None under skip
            stopped = int(n)
            break
        cumulative += decision.plan.predicted_time_s
        trained.append(int(n))
        times.append(cumulative)
        plan = decision.plan.compact()
        plans[plan] = plans.get(plan, 0) + 1
    longest = longest_fitting(planner, p, causal=causal, fits=trained[-1] if trained else 0, limit=int(lengths[-1]))
    return Curve(run=run, lengths=trained, cumulative_s=times, stopped_at=stopped, max_feasible=longest, plans=plans)
