"""The exact planner against brute force, and the paper's Algorithm 1 against the exact planner.

Brute force enumerates every per-layer assignment, positions included, of stages of at most 6
layers, each priced in its own order (a layer's working set beside the saved bytes of the layers
before it): the planner's count vector must be feasible and as fast as the fastest fitting
assignment, and the order its plan runs must peak no higher than any other order of its layers.
Deeper stages are checked against every count vector. Algorithm 1 must never beat the exact planner; it mixes an
option only with one whose uniform plan fits, so where only mixes fit it finds nothing. Its gap and
misses are printed (``pytest -s``) and recorded as a test property.
"""

from __future__ import annotations

import logging
import random
import statistics

import numpy as np
import pytest

from megatron_paradyse.cost.base import LayerCost
from megatron_paradyse.planner import StageProblem, exact, solve_exact, solve_heuristic

from helpers.planner_cost_models import (
    PEAK_KINDS,
    best_multiset,
    brute_force,
    is_close,
    random_problem,
    synthetic_options,
)

CASES_PER_FAMILY = 120
FAMILIES = [(integer, peak) for integer in (True, False) for peak in PEAK_KINDS]


@pytest.mark.parametrize(("integer", "peak"), FAMILIES, ids=[f"{'int' if i else 'real'}-{p}" for i, p in FAMILIES])
def test_exact_matches_brute_force_and_beats_algorithm_1(integer, peak, record_property):
    rng = random.Random(f"{integer}-{peak}")
    gaps, infeasible, missed = [], 0, 0
    for case in range(CASES_PER_FAMILY):
        num_layers = rng.randint(1, 6)
        num_options = rng.randint(1, max(1, min(8, int(40000 ** (1 / num_layers)))))
        problem = random_problem(rng, num_options=num_options, num_layers=num_layers, integer=integer, peak=peak)
        where = f"case {case}: {num_layers} layers, {problem.costs}, budget {problem.budget_bytes}"
        assignments, time_s, peak_bytes, fits = brute_force(problem)
        solution = solve_exact(problem)
        heuristic = solve_heuristic(problem)
        if not fits.any():
            infeasible += 1
            assert solution is None and heuristic is None, where
            continue
        best = time_s[fits].min()
        assert solution is not None, where
        assert problem.fits(solution) and sum(solution.counts) == num_layers, where
        assert is_close(solution.time_s, best), (where, solution, best)
        # the plan's order is one of its layers' orderings, and none peaks lower
        orderings = np.all(
            np.stack([(assignments == o).sum(axis=1) for o in range(num_options)], 1) == np.array(solution.counts),
            axis=1,
        )
        plan = problem.to_plan(solution)
        own = np.all(assignments == [problem.options.index(option) for option in plan], axis=1)
        assert np.allclose(time_s[orderings], solution.time_s) and np.isclose(peak_bytes[own][0], solution.peak_bytes)
        assert peak_bytes[orderings].min() >= solution.peak_bytes * (1 - 1e-12), where
        assert len(plan) == num_layers and plan.predicted_time_s == solution.time_s, where
        if heuristic is None:  # only mixes fit
            missed += 1
            continue
        assert problem.fits(heuristic), where
        assert heuristic.time_s >= solution.time_s * (1 - 1e-12), (where, heuristic, solution)
        gaps.append(heuristic.time_s / solution.time_s - 1)
    summary = _gap_summary(gaps, infeasible, missed)
    print(summary)
    record_property("heuristic_gap", summary)


@pytest.mark.parametrize("integer", [True, False], ids=["int", "real"])
def test_exact_on_deeper_stages(integer, record_property):
    rng = random.Random(7 + integer)
    gaps, missed = [], 0
    for case in range(40):
        problem = random_problem(
            rng,
            num_options=rng.randint(2, 5),
            num_layers=rng.randint(7, 16),
            integer=integer,
            peak=rng.choice(PEAK_KINDS),
        )
        best = best_multiset(problem)
        solution = solve_exact(problem)
        if best is None:
            assert solution is None, case
            continue
        assert problem.fits(solution) and is_close(solution.time_s, best), (case, solution, best)
        heuristic = solve_heuristic(problem)
        if heuristic is None:  # only mixes fit
            missed += 1
            continue
        assert problem.fits(heuristic) and heuristic.time_s >= solution.time_s * (1 - 1e-12), case
        gaps.append(heuristic.time_s / solution.time_s - 1)
    summary = _gap_summary(gaps, 40 - len(gaps) - missed, missed)
    print(summary)
    record_property("heuristic_gap", summary)


def _gap_summary(gaps: list[float], infeasible: int, missed: int) -> str:
    return (
        f"Algorithm 1 vs exact over {len(gaps)} feasible cases ({infeasible} infeasible, {missed} where only "
        f"mixes fit and it found none): slower in {sum(g > 1e-9 for g in gaps)}, mean gap "
        f"{100 * statistics.mean(gaps):.2f}%, max {100 * max(gaps):.1f}%"
    )


def test_same_plan_every_time():
    rng = random.Random(3)
    problem = random_problem(rng, num_options=8, num_layers=96, integer=False, peak="affine")
    first = solve_exact(problem)
    assert all(solve_exact(problem) == first for _ in range(3))


def test_search_budget_returns_a_feasible_plan_and_says_so(monkeypatch, caplog):
    """A search cut short by MAX_CANDIDATES still returns a fitting plan and logs its proven gap."""
    rng = random.Random(11)
    costs = []
    for _ in range(16):  # a convex frontier of many options: the subset-sum-like worst case
        x = rng.uniform(0.2, 1.2)
        costs.append(LayerCost(1 / x, x, x * rng.uniform(0.5, 1)))
    problem = StageProblem(
        synthetic_options(16), tuple(costs), 96, 5 + 96 * 0.7, lambda saved, transient: 5 + saved + transient
    )
    optimum = solve_exact(problem)
    monkeypatch.setattr(exact, "MAX_CANDIDATES", 2)
    with caplog.at_level(logging.WARNING, logger="megatron_paradyse.planner.exact"):
        cut = solve_exact(problem)
    assert problem.fits(cut) and cut.time_s >= optimum.time_s * (1 - 1e-12)
    assert "search stopped after 2 candidates" in caplog.text and "slower than optimal" in caplog.text


def test_the_order_search_finds_what_the_bound_misses_and_stops_within_its_budget(monkeypatch, caplog):
    """FAST (t=1, saved 4, transient 3) and LEAN (2, 1, 1) on 4 layers, peak saved + transient, budget 11.
    Under the order-free bound (all saved + the largest transient) one FAST layer fits (4 + 3 + 3 = 10).
    Run first, a FAST layer's working set is beside its own saved bytes only: two fit (10 saved; its 3
    beside all but the LEAN layers' 2: 11). Cut short, the search keeps the bound's plan and says so."""
    costs = (LayerCost(1.0, 4.0, 3.0), LayerCost(2.0, 1.0, 1.0))
    problem = StageProblem(synthetic_options(2), costs, 4, 11.0, lambda saved, transient: saved + transient)
    best = solve_exact(problem)
    assert (best.counts, best.time_s, best.peak_bytes) == ((2, 2), 6.0, 11.0)
    monkeypatch.setattr(exact, "REFINE_CANDIDATES", 1)
    with caplog.at_level(logging.DEBUG, logger="megatron_paradyse.planner.exact"):
        cut = solve_exact(problem)
    assert (cut.counts, cut.time_s) == ((1, 3), 7.0) and problem.fits(cut)
    assert "the search under the layers' order stopped after 1 candidates" in caplog.text
