"""The exact planner: the count vector of least predicted time whose predicted peak fits.

**Order.** A vector's peak is ``peak(S, R(n))``, ``R(n)`` what a layer's working set adds to the saved
bytes of the layers before it, at its largest (:mod:`~megatron_paradyse.planner.problem`): at most the
largest transient ``max r_o``. The search below prices with that bound, ``peak(S, max r_o)``; every
vector it accepts fits. A depth-first refinement then makes the result exact under ``R(n)`` itself
(:func:`_refine`), starting from that incumbent, within :data:`REFINE_CANDIDATES` candidates.

**Transient bound.** The largest transient makes the bound non-additive. Fix a bound
``R`` (each distinct ``r_o`` in turn) and keep the options with ``r_o <= R`` under the constraint
``peak(S, R) <= budget``. Every solution of that subproblem is feasible for the real problem (its
own largest transient is ``<= R`` and ``peak`` is non-decreasing), and the real optimum solves the
subproblem whose ``R`` is its own largest transient; so the best subproblem optimum is the real
optimum. Within a subproblem transients no longer matter: options beaten in both time and saved
bytes are dropped, leaving a frontier ``t_1 < ... < t_q``, ``m_1 > ... > m_q``, and since ``peak``
is monotone, ``peak(S, R) <= budget`` implies ``S < C`` for a capacity ``C`` found by a few calls to
``peak`` (regula falsi), or the problem's own cap on saved bytes where that is lower. What remains
is a knapsack with a cardinality constraint::

    min T(n) = sum_j n_j t_j   s.t.  sum_j n_j = L,  sum_j n_j m_j <= C,  n_j >= 0 integer.

**LP duality.** Its LP relaxation is solved by two adjacent vertices ``a`` (faster, heavier) and
``b`` of the lower convex envelope of the points ``(m_j, t_j)`` around ``m = C / L``; the slope
``lambda = (t_b - t_a) / (m_a - m_b)`` and ``mu = min_j (t_j + lambda m_j)`` are dual feasible, and for
every count vector::

    T(n) = D + sum_j n_j rho_j + lambda (C - sum_j n_j m_j),    D = mu L - lambda C,
    rho_j = t_j + lambda m_j - mu >= 0   (zero for a and b).

Both added terms are non-negative for a feasible ``n``, so ``D`` is a lower bound and a vector can
beat an incumbent of time ``T*`` only if ``sum_j n_j rho_j <= T* - D``. The search enumerates the
counts of the non-basis options under that budget (cheapest reduced cost first; the budget shrinks
as the incumbent improves) and completes each with the basis pair in closed form: given ``l`` layers
and capacity ``c`` left, the best mix of ``a`` and ``b`` takes as many ``a`` as fit. Every vector
better than the incumbent is some enumerated non-basis part plus a basis completion no better than
the closed-form one, so nothing better is missed. Candidates are checked against ``peak`` itself,
so ``C`` only has to be an upper bound. Subproblems are searched in order of their bound ``D`` and
skipped once it exceeds the incumbent.

The result is exact up to floating-point rounding: bounds are compared with a relative slack of
``1e-12``; ties in time (within it) go to the smaller peak, then to the first found. The search
order depends only on the costs, so every rank returns the same plan.

The enumeration is exponential in the worst case (the problem is a knapsack). The budget ``T* - D``
is below one basis swap ``t_b - t_a`` from the first candidate on, which keeps it to tens or hundreds
of candidates on physical costs; only options nearly collinear with the basis pair (a random convex
frontier of 24 options, say) make it fill the capacity by a subset-sum-like search. A search stops
after ``MAX_CANDIDATES`` candidates and logs a warning with the proven gap (incumbent vs. the
smallest bound not yet excluded); the plan is then the best found, not a proven optimum.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable

from megatron_paradyse.planner.problem import Solution, StageProblem

__all__ = ["MAX_CANDIDATES", "REFINE_CANDIDATES", "solve_exact"]

logger = logging.getLogger(__name__)

MAX_CANDIDATES = 20_000
"""Candidates (search nodes) one solve may try before settling for its best (~50 ms in CPython)."""
REFINE_CANDIDATES = 2_000
"""Of those, the most the search under the layers' order may try (:func:`_refine`): a few milliseconds. Deep
stages of several nearly tied options exceed it (96 layers of 6 to 8 options: 26 of 1,081 problems of
``bench planner``) and keep the best plan found, never slower than the fastest under the order-free
bound; a debug message gives the proven gap."""

_SLACK = 1e-12
"""Relative slack of bound comparisons (float rounding, not an optimality gap)."""
_BRACKET = 1e-9
"""Relative width at which the capacity bracket stops narrowing."""


def solve_exact(problem: StageProblem) -> Solution | None:
    """The optimal count vector of ``problem``, or None when no plan fits the budget."""
    t = [c.time_s for c in problem.costs]
    m = [c.saved_bytes for c in problem.costs]
    r = [c.transient_bytes for c in problem.costs]
    num_layers, budget = problem.num_layers, problem.budget_bytes
    live = _undominated(t, m, r)
    best = _Search(problem)
    subproblems = []
    for transient in sorted({r[o] for o in live}, reverse=True):
        allowed = [o for o in live if r[o] <= transient]  # sorted by time, then saved
        if num_layers * t[allowed[0]] > best.limit():
            continue
        frontier = _frontier(allowed, m)
        fastest, leanest = frontier[0], frontier[-1]
        peak_at = lambda saved, transient=transient: problem.peak(saved, transient)  # noqa: E731
        lean_peak = peak_at(num_layers * m[leanest])
        if lean_peak > budget or num_layers * m[leanest] > problem.saved_budget_bytes:
            continue  # no plan with transients <= this one fits
        fast_peak = peak_at(num_layers * m[fastest])
        if fast_peak <= budget and num_layers * m[fastest] <= problem.saved_budget_bytes:
            best.offer(problem.uniform(fastest))  # the subproblem's unconstrained optimum fits
            continue
        capacity = problem.saved_budget_bytes
        if fast_peak > budget:
            capacity = min(
                capacity,
                _capacity(peak_at, budget, num_layers * m[leanest], lean_peak, num_layers * m[fastest], fast_peak),
            )
        subproblems.append(_Subproblem(frontier, t, m, num_layers, capacity))
    subproblems.sort(key=lambda sub: sub.lower_bound)
    for i, sub in enumerate(subproblems):
        if sub.lower_bound > best.limit():
            break
        try:
            sub.search(best)
        except _Exhausted:
            bound = min(s.lower_bound for s in subproblems[i:])
            logger.warning(
                "planner: search stopped after %d candidates (%d layers, %d options); the plan is at most "
                "%.3g%% slower than optimal",
                MAX_CANDIDATES,
                num_layers,
                len(problem.options),
                100 * (best.limit() / bound - 1) if best.solution else math.inf,
            )
            return best.solution
    best.candidates_left = min(best.candidates_left, REFINE_CANDIDATES)
    try:
        _refine(problem, best, live)
    except _Exhausted as stopped:  # a refinement of a plan that fits: said at debug level only
        (bound,) = stopped.args
        logger.debug(
            "planner: the search under the layers' order stopped after %d candidates (%d layers, %d options); "
            "the plan is at most %.3g%% slower than optimal",
            REFINE_CANDIDATES,
            num_layers,
            len(problem.options),
            100 * (best.limit() / bound - 1) if best.solution else math.inf,
        )
    return best.solution


def _refine(problem: StageProblem, best: _Search, live: list[int]) -> None:
    """Every count vector that could beat the incumbent under the exact peak ``peak(S, R(n))``.

    Depth first over the options in reverse run order, the last-running first: when an option's count
    is chosen, the saved bytes of the layers after it are known, so its term of ``R(n)``, ``r_o -
    after``, is final. ``R(n)`` only rises as options are added, and is at least ``r_min`` (the last
    layer's term is its own transient; with offloaded options, whose inputs leave the device, less the
    largest of those inputs). So with ``R`` so far, every completion keeps ``S <= C(R)``, the most saved
    bytes that fit at ``R`` (known at each option's transient, and ``C`` does not rise with ``R``). A
    node is cut when its layers left cannot fit under it even as the leanest option, or when its time so
    far plus the LP bound of its layers left cannot beat the incumbent: the least time of ``left``
    layers of the options still to choose whose saved bytes stay under ``C - after``, the lower convex
    envelope of those options' ``(m_o, t_o)`` at ``(C - after) / left``; each option's count is limited
    to the range that the same bounds with the options after it allow. A vector is priced only if its
    own ``(S, R(n))`` fits. Options beaten in time, saved and transient bytes are left out (replacing one
    by its better never raises a term), as in the search above.
    """
    costs = problem.costs
    kept = set(live)
    order = [o for o in reversed(problem.run_order) if o in kept]
    t = [costs[o].time_s for o in order]
    m = [costs[o].saved_bytes for o in order]
    r = [costs[o].transient_bytes for o in order]
    host = [problem.repeats * costs[o].host_bytes for o in order]
    shift = max(host) / problem.repeats if any(host) else 0.0
    budget = problem.budget_bytes * (1 + _SLACK)
    num_layers = problem.num_layers
    least_t = [min(t[i:]) for i in range(len(order))]
    least_m = [min(m[i:]) for i in range(len(order))]
    envelopes = [_Envelope(m[i:], t[i:]) for i in range(len(order))]
    # C at each option's transient, lowest first: C(R) for any R is at most C at the largest level <= R
    levels = sorted({v - shift for v in r})
    lo, hi = num_layers * min(m), num_layers * max(m)
    capacities = []
    for level in levels:
        peak_at = lambda saved, level=level: problem.peak(saved, level)  # noqa: E731
        peak_lo, peak_hi = peak_at(lo), peak_at(hi)
        fit = (
            -math.inf
            if peak_lo > budget
            else hi
            if peak_hi <= budget
            else _capacity(peak_at, budget, lo, peak_lo, hi, peak_hi)
        )
        capacities.append(min(fit * (1 + _SLACK), problem.saved_budget_bytes * (1 + _SLACK)))
    if capacities[0] == -math.inf:
        return  # no vector fits
    counts = [0] * len(problem.options)

    def fits(saved: float, transient: float) -> bool:
        return bool(shift) or problem.peak(saved, transient) <= budget  # offloaded: stage_layer_bytes decides

    def node(i: int, left: int, after: float, transient: float, time_s: float, held: float) -> None:
        best.candidates_left -= 1
        if best.candidates_left < 0:
            raise _Exhausted
        if left == 0:
            if fits(after, transient):
                best.offer(tuple(counts))
            return
        room = capacities[max(bisect.bisect_right(levels, transient - shift) - 1, 0)] - after
        if (
            room < left * least_m[i]
            or held > problem.host_budget_bytes
            or time_s + left * envelopes[i].least_time(room / left) > best.limit()
        ):
            return
        o = order[i]
        if i == len(order) - 1:  # the first-running option takes the layers left
            counts[o] = left
            if fits(after + left * m[i], max(transient, r[i] - after)):
                best.offer(tuple(counts))
            counts[o] = 0
            return
        # the counts of this option that, with the layers left at the least time and saved bytes of the
        # options still to choose, stay within the incumbent's time and the room
        low, high = 0, left
        for gap, step in (
            (best.limit() - time_s - left * least_t[i + 1], t[i] - least_t[i + 1]),
            (room - left * least_m[i + 1], m[i] - least_m[i + 1]),
        ):
            if gap == math.inf:
                continue  # no incumbent yet
            if step > 0:
                high = min(high, math.floor(gap / step * (1 + _SLACK) + _SLACK))
            elif step < 0:
                low = max(low, math.ceil(gap / step * (1 + _SLACK) - _SLACK))
            elif gap < 0:
                high = -1
        for n in range(high, low - 1, -1):
            counts[o] = n
            term = max(transient, r[i] - after) if n else transient
            node(i + 1, left - n, after + n * m[i], term, time_s + n * t[i], held + n * host[i])
        counts[o] = 0

    try:
        node(0, num_layers, 0.0, -math.inf, 0.0, 0.0)
    except _Exhausted:
        raise _Exhausted(num_layers * envelopes[0].least_time(capacities[0] / num_layers)) from None


class _Envelope:
    """The lower convex envelope of options' ``(saved, time)`` points: the least time per layer of a
    mix whose saved bytes per layer average at most ``x``."""

    def __init__(self, saved: list[float], times: list[float]) -> None:
        options = sorted(range(len(saved)), key=lambda o: (times[o], saved[o]))
        vertices = _lower_envelope(_frontier(options, saved), times, saved)  # leanest first
        self.chain = [(saved[o], times[o]) for o in vertices]

    def least_time(self, x: float) -> float:
        chain = self.chain
        if x >= chain[-1][0]:
            return chain[-1][1]
        if x < chain[0][0]:
            return math.inf
        for (x0, y0), (x1, y1) in zip(chain, chain[1:]):
            if x < x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return chain[-1][1]


def _undominated(t: list[float], m: list[float], r: list[float]) -> list[int]:
    """Options not beaten in (time, saved, transient), sorted by (time, saved, transient, index).

    A later option in that order can only beat an earlier one by being identical, and identical
    options keep the first; so comparing each option with the kept earlier ones is enough.
    """
    kept: list[int] = []
    for o in sorted(range(len(t)), key=lambda o: (t[o], m[o], r[o], o)):
        if not any(m[k] <= m[o] and r[k] <= r[o] for k in kept):
            kept.append(o)
    return kept


def _frontier(allowed: list[int], m: list[float]) -> list[int]:
    """The (time, saved) Pareto front of ``allowed`` (sorted by time): time up, saved strictly down."""
    front: list[int] = []
    for o in allowed:
        if not front or m[o] < m[front[-1]]:
            front.append(o)
    return front


def _capacity(
    peak_at: Callable[[float], float], budget: float, lo: float, peak_lo: float, hi: float, peak_hi: float
) -> float:
    """Saved bytes no fitting plan reaches (``peak_at(hi) > budget``), within ``1e-9 hi`` of an amount
    known to fit.

    Starts from ``peak_at(lo) <= budget < peak_at(hi)`` and narrows by Illinois regula falsi: an
    affine peak is bracketed in two or three calls; any monotone one (allocator rounding makes steps)
    still converges, since every step keeps a valid bracket.
    """
    f_lo, f_hi = peak_lo - budget, peak_hi - budget
    width = _BRACKET * hi
    side = 0
    for _ in range(100):
        if hi - lo <= width:
            break
        x = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        x = min(max(x, lo + 0.5 * width), hi - 0.5 * width)  # shrink by at least half a width
        f_x = peak_at(x) - budget
        if f_x <= 0:
            lo, f_lo = x, f_x
            if side < 0:
                f_hi *= 0.5
            side = -1
        else:
            hi, f_hi = x, f_x
            if side > 0:
                f_lo *= 0.5
            side = 1
    return hi


def _lower_envelope(frontier: list[int], t: list[float], m: list[float]) -> list[int]:
    """Vertices of the lower convex envelope of the frontier's ``(m, t)`` points, leanest first."""
    chain: list[int] = []
    for c in reversed(frontier):  # saved increasing
        while len(chain) >= 2:
            a, b = chain[-2], chain[-1]
            if (t[b] - t[a]) * (m[c] - m[a]) >= (t[c] - t[a]) * (m[b] - m[a]):
                chain.pop()  # b is not below the segment a-c
            else:
                break
        chain.append(c)
    return chain


class _Exhausted(Exception):
    """The search tried ``MAX_CANDIDATES`` candidates."""


class _Search:
    """The best feasible count vector found so far, and the candidates left to try."""

    def __init__(self, problem: StageProblem) -> None:
        self.problem = problem
        self.solution: Solution | None = None
        self._limit = math.inf
        self.candidates_left = MAX_CANDIDATES

    def limit(self) -> float:
        """Layer times of one chunk (the problem's constant ``stage_time_s`` left out) above this cannot
        beat (or tie) the incumbent."""
        return (self._limit - self.problem.stage_time_s) / self.problem.repeats

    def offer(self, counts: tuple[int, ...]) -> bool | None:
        """Keep ``counts`` if it fits and beats the incumbent. None: too slow to matter; else: whether it fits."""
        problem = self.problem
        time_s = sum(n * c.time_s for n, c in zip(counts, problem.costs) if n)
        if time_s > self.limit():
            return None
        candidate = problem.evaluate(counts)
        if not problem.fits(candidate):
            return False
        incumbent = self.solution
        if (
            incumbent is None
            or candidate.time_s < incumbent.time_s - _SLACK * abs(incumbent.time_s)
            or candidate.peak_bytes < incumbent.peak_bytes
        ):
            self.solution = candidate
            self._limit = min(self._limit, candidate.time_s + _SLACK * abs(candidate.time_s))
        return True


class _Subproblem:
    """One transient bound's knapsack, with its LP duals (see the module docstring)."""

    def __init__(self, frontier: list[int], t: list[float], m: list[float], num_layers: int, capacity: float) -> None:
        self.t, self.m, self.num_layers = t, m, num_layers
        self.capacity = capacity * (1 + _SLACK)
        envelope = _lower_envelope(frontier, t, m)
        x = self.capacity / num_layers
        # basis: the envelope edge over x (the last one when x reaches the fastest option's m)
        self.b, self.a = next(
            ((lean, heavy) for lean, heavy in zip(envelope, envelope[1:]) if x < m[heavy]), envelope[-2:]
        )
        a, b = self.a, self.b
        lam = (t[b] - t[a]) / (m[a] - m[b])
        mu = min(t[o] + lam * m[o] for o in frontier)
        self.lam = lam
        self.lower_bound = mu * num_layers - lam * self.capacity
        # D is a difference of two large terms: pad comparisons against it by their rounding error
        self.margin = _SLACK * (abs(mu * num_layers) + abs(lam * self.capacity))
        rho = {o: max(0.0, t[o] + lam * m[o] - mu) for o in frontier if o not in (a, b)}
        self.others = sorted(rho, key=lambda o: (rho[o], o))
        self.rho = [rho[o] for o in self.others]
        self.m_min = min(m[o] for o in frontier)
        self.counts: list[int] = []

    def search(self, best: _Search) -> None:
        self.best = best
        self.counts = [0] * len(best.problem.options)
        self._node(0, self.num_layers, self.capacity, 0.0)

    def _budget(self, reduced: float) -> float:
        """Reduced cost still affordable by a vector that could beat the incumbent."""
        return self.best.limit() - self.lower_bound + self.margin - reduced

    def _node(self, first: int, layers: int, capacity: float, reduced: float) -> None:
        """Complete the current non-basis counts, then extend them with options ``others[first:]``."""
        self.best.candidates_left -= 1
        if self.best.candidates_left < 0:
            raise _Exhausted
        self._complete(layers, capacity, reduced)
        m, counts = self.m, self.counts
        for idx in range(first, len(self.others)):
            rho, o = self.rho[idx], self.others[idx]
            budget = self._budget(reduced)
            if rho > budget:
                break  # sorted by reduced cost: the later options cost more
            n_max = layers if budget >= layers * rho else int(budget / rho)
            for n in range(1, n_max + 1):
                room = capacity - n * m[o]
                if room < (layers - n) * self.m_min:
                    break  # the remaining layers cannot fit even as the leanest option
                counts[o] = n
                self._node(idx + 1, layers - n, room, reduced + n * rho)
                if (n + 1) * rho > self._budget(reduced):
                    break  # the incumbent improved meanwhile
            counts[o] = 0

    def _complete(self, layers: int, capacity: float, reduced: float) -> None:
        """Offer the current counts filled with the basis pair: as many of the faster ``a`` as fit."""
        a, b, m, counts = self.a, self.b, self.m, self.counts
        spare = capacity - layers * m[b]
        if spare < 0:
            return
        # C is an upper bound on what fits: step down until the real peak fits (or it is too slow)
        for n_a in range(min(layers, int(spare / (m[a] - m[b]))), -1, -1):
            unused = spare - n_a * (m[a] - m[b])
            if self.lam * unused > self._budget(reduced):
                return  # T(n) = D + reduced + lambda * unused capacity: too slow, and more so below
            counts[a], counts[b] = n_a, layers - n_a
            fits = self.best.offer(tuple(counts))
            if fits is not False:
                break
        counts[a] = counts[b] = 0
