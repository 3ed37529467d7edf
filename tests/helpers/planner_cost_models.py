"""Synthetic cost models and a brute-force oracle for the planner tests.

The physical model (strategies' real trade-offs) is the analytic cost model on an H100 node's published
figures, as the planner benchmark builds it; here are the models that stress the solver: random option
costs (integer-valued, so sums are exact and ties are common, or real-valued), under affine, stepped
(allocator granularity) or convex peaks.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable

import numpy as np

from megatron_paradyse.bench.planner import bench_shape, build_cost_model
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.base import WHOLE_LOSS, LayerCost, StageOptions
from megatron_paradyse.planner import Planner, PlannerConfig, StageProblem

PEAK_KINDS = ("affine", "stepped", "convex")


def physical_planner(num_layers: int, budget_bytes: float, p: int = 8, **config) -> Planner:
    """A planner over every strategy (``lean`` included), 24 options, on the benchmark's physical costs:
    a LLaMA-3-8B-sized layer on an H100 node (``p`` must be 8, the node's size)."""
    options = tuple(
        LayerOption(a, m, rc)
        for a in ("tp_sp", "ulysses", "ring", "lean")
        for m in ("tp_sp", "zero3", "lean")
        for rc in (False, True)
    )
    model, _ = build_cost_model(bench_shape(), p, num_layers, gpu="h100")
    return Planner(PlannerConfig(**config), model, options=options, num_layers=num_layers, budget_bytes=budget_bytes)


def llama3_8b_head_planner(loss_chunk_tokens: int = 8192, host_memory_gib: float = 0.0) -> Planner:
    """The last stage of Llama-3-8B at TP=8 on an H100 node (published figures): 32 layers, the output
    layer and loss of a 129,024-token vocabulary, every strategy and recompute (offloaded too, with host
    memory), a 72 GB budget."""
    import torch

    from megatron_paradyse.cost import AnalyticCostModel
    from megatron_paradyse.cost.hardware import HARDWARE, hardware_profile, stage_static_bytes

    shape = bench_shape()
    vocab = 129_024
    model = AnalyticCostModel(
        hardware_profile(HARDWARE["h100"]),
        shape,
        8,
        dtype=torch.bfloat16,
        static_bytes=stage_static_bytes(shape, 32, 8, vocab_size=vocab),
        vocab_size=vocab,
        rotary_dim=128,
        bias=False,
        normalization="RMSNorm",
    )
    config = PlannerConfig(loss_chunk_tokens=loss_chunk_tokens, host_memory_gib=host_memory_gib, bucket="geometric")
    return Planner.for_model(config, model, shape=shape, p=8, num_layers=32, budget_bytes=0.9 * 80e9)


def synthetic_options(count: int) -> tuple[LayerOption, ...]:
    """``count`` distinct options (names need not be registered strategies)."""
    return tuple(LayerOption(f"a{i // 2}", f"m{i // 2}", bool(i % 2)) for i in range(count))


def peak_function(kind: str, static: float, transient_weight: float, step: float):
    """A peak non-decreasing in (saved, transient) that works on floats and on numpy arrays."""
    if kind == "affine":
        return lambda saved, transient: static + saved + transient_weight * transient
    if kind == "stepped":  # allocator rounding: whole steps
        return lambda saved, transient: static + step * np.ceil((saved + transient_weight * transient) / step)
    if kind == "convex":
        return lambda saved, transient: static + saved + transient_weight * transient + (saved + transient) ** 2 / 50
    raise ValueError(kind)


def random_problem(rng: random.Random, *, num_options: int, num_layers: int, integer: bool, peak: str) -> StageProblem:
    """Random option costs and a budget between the leanest and the heaviest uniform plans."""
    if integer:
        costs = [LayerCost(rng.randint(1, 12), rng.randint(0, 12), rng.randint(0, 12)) for _ in range(num_options)]
    else:
        costs = [LayerCost(rng.uniform(1, 3), rng.uniform(0, 4), rng.uniform(0, 4)) for _ in range(num_options)]
    peak_fn = peak_function(peak, static=5.0, transient_weight=rng.choice([1.0, 2.0]), step=rng.choice([2.0, 5.0]))
    uniform = [float(peak_fn(num_layers * c.saved_bytes, c.transient_bytes)) for c in costs]
    low, high = min(uniform), max(uniform)
    budget = rng.uniform(low - 0.1 * (high - low + 1), high)  # sometimes below the leanest: infeasible
    if integer:
        budget = float(round(budget))
    return StageProblem(synthetic_options(num_options), tuple(costs), num_layers, budget, peak_fn)


def brute_force(problem: StageProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every per-layer assignment, in the order its layers run (a layer's working set beside the saved
    bytes of the layers before it): (assignments [K^L, L], time, peak, fits)."""
    k, n = len(problem.options), problem.num_layers
    assignments = np.array(list(itertools.product(range(k), repeat=n)), dtype=np.int64).reshape(-1, n)
    t = np.array([c.time_s for c in problem.costs])[assignments]
    m = np.array([c.saved_bytes for c in problem.costs])[assignments]
    r = np.array([c.transient_bytes for c in problem.costs])[assignments]
    after = m[:, ::-1].cumsum(axis=1)[:, ::-1] - m  # saved by the layers after each position
    peak = np.asarray(problem.peak(m.sum(axis=1), (r - after).max(axis=1)), dtype=float)
    return assignments, t.sum(axis=1), peak, peak <= problem.budget_bytes


def best_multiset(problem: StageProblem) -> float | None:
    """Least time over every count vector that fits (for stages too deep for :func:`brute_force`)."""
    best = None
    for combo in itertools.combinations_with_replacement(range(len(problem.options)), problem.num_layers):
        counts = [0] * len(problem.options)
        for o in combo:
            counts[o] += 1
        solution = problem.evaluate(counts)
        if problem.fits(solution) and (best is None or solution.time_s < best):
            best = solution.time_s
    return best


class FunctionCostModel:
    """A cost model from ``costs(option, padded_len) -> LayerCost`` and ``peak(saved, transient)``.

    Counts its ``layer_cost`` calls, so tests can tell a cached decision from a solved one.
    """

    def __init__(self, costs: Callable[[LayerOption, int], LayerCost], peak: Callable[[float, float], float]) -> None:
        self.costs, self.peak = costs, peak
        self.calls = 0
        self.layouts: list[SequenceLayout] = []

    def layer_cost(self, option: LayerOption, layout: SequenceLayout, micro_batch_size: int) -> LayerCost:
        self.calls += 1
        self.layouts.append(layout)
        cost = self.costs(option, layout.padded_len)
        return LayerCost(cost.time_s * micro_batch_size, cost.saved_bytes * micro_batch_size, cost.transient_bytes)

    def peak_bytes(
        self,
        layout: SequenceLayout,
        micro_batch_size: int,
        saved_bytes: float,
        transient_bytes: float,
        stage: StageOptions = WHOLE_LOSS,
    ) -> float:
        return self.peak(saved_bytes, transient_bytes)

    def held_bytes(
        self, layout: SequenceLayout, micro_batch_size: int, saved_bytes: float, stage: StageOptions = WHOLE_LOSS
    ) -> float:
        return saved_bytes

    def stage_options(self, loss_chunk_tokens: int) -> tuple[StageOptions, ...]:
        return (WHOLE_LOSS,)

    def stage_time_s(self, layout: SequenceLayout, micro_batch_size: int, stage: StageOptions) -> float:
        return 0.0


def random_scaling_model(rng: random.Random, options: tuple[LayerOption, ...]) -> FunctionCostModel:
    """Costs non-decreasing in length: time ``a s^2 + b s + c``, saved ``d s``, transient ``e s + f``."""
    coefficients = {o: [rng.uniform(0, 1) * 10.0**e for e in (-9, -5, -3, -4, -5, 0)] for o in options}

    def costs(option: LayerOption, s: int) -> LayerCost:
        a, b, c, d, e, f = coefficients[option]
        return LayerCost(a * s * s + b * s + c, d * s, e * s + f)

    return FunctionCostModel(costs, lambda saved, transient: 1.0 + saved + transient)


def is_close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
