"""The ParaDySe paper's Algorithm 1, kept for comparison with the exact planner.

Faithful to the paper and the authors' code, on this project's cost model:

1. order the options by (time, memory), memory being each option's uniform-plan peak (the paper's
   profiles measure whole-model peaks), and drop the options another beats on both;
2. walk them fastest first: if the fastest fits every layer, take it; otherwise keep every uniform
   plan that fits, and for an option ``i`` that does not, and each slower option ``k`` whose uniform
   plan fits, try ``j = 1, 2, ...`` layers of ``i`` in front of ``L - j`` layers of ``k``, keeping each
   mix that fits and stopping at the first that does not;
3. return the fastest plan kept.

Fixed on the way (``reference_code_lessons.md`` B4, B5, B11): every candidate is a fresh count
vector evaluated on its own (no list mutated after being recorded); pruning checks every pair, not
only sorted neighbours; no sticky out-of-memory flag (when nothing fits it says so, like the exact
planner, instead of returning the leanest plan regardless); caching is the planner's, keyed by
length bucket. Mixing only two options with one switch point, it can miss the optimum; and mixing an
option only with one whose uniform plan fits, it finds nothing where only mixes fit (a mix can peak
lower than both its options' uniform plans: a layer's working set is beside the saved bytes of the
layers before it only). It is never better than :func:`~megatron_paradyse.planner.exact.solve_exact`.
"""

from __future__ import annotations

from megatron_paradyse.planner.problem import Solution, StageProblem

__all__ = ["solve_heuristic"]


def solve_heuristic(problem: StageProblem) -> Solution | None:
    """Algorithm 1's plan for ``problem``, or None when none of the plans it tries fits."""
    num_layers = problem.num_layers
    uniform = [problem.evaluate(problem.uniform(o)) for o in range(len(problem.options))]
    ranked: list[int] = []  # fastest first, each leaner than the ones before
    for o in sorted(range(len(uniform)), key=lambda o: (uniform[o].time_s, uniform[o].peak_bytes, o)):
        if not any(uniform[k].peak_bytes <= uniform[o].peak_bytes for k in ranked):
            ranked.append(o)  # not beaten by a faster (or equal) option in memory
    kept: list[Solution] = []
    for i, fast in enumerate(ranked):
        if problem.fits(uniform[fast]):
            if i == 0:
                return uniform[fast]  # early termination: the fastest option fits every layer
            kept.append(uniform[fast])
            continue
        for slow in ranked[i + 1 :]:
            if not problem.fits(uniform[slow]):
                continue
            for j in range(1, num_layers):
                counts = [0] * len(uniform)
                counts[fast], counts[slow] = j, num_layers - j
                mix = problem.evaluate(counts)
                if not problem.fits(mix):
                    break
                kept.append(mix)
    if not kept:
        return None
    return min(kept, key=lambda s: s.time_s)
