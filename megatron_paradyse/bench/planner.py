"""Planner decision latency: ``python -m megatron_paradyse.bench planner [--layers 96] [--p 8]``.

One pipeline stage of ``--layers`` layers, every registered strategy for attention and MLP, each with
and without recompute. Prints the plans along a length sweep (with the paper's Algorithm 1 beside
the exact planner), then the median latency of ``Planner.decide``: uncached (the cache cleared
before every call, lengths drawn at random) and cached (every bucket already planned). Last line:
``planner_us_cached=<x> planner_us_uncached=<y>``.

The cost model comes from :func:`build_cost_model`. Until a calibrated profile is wired in there it
is :class:`AnalyticStandIn`: textbook FLOP and byte counts for an H100-class node, not measurements,
and the output says so. Timings are wall clock on whatever machine runs this; on a shared machine
they are noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time

from megatron_paradyse.cost.base import CostModel, LayerCost
from megatron_paradyse.layout import SequenceLayout
from megatron_paradyse.plan import LayerOption
from megatron_paradyse.planner import Planner, PlannerConfig, solve_exact, solve_heuristic
from megatron_paradyse.strategies import ModelShape

_GIB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """Rates of one accelerator and its links, for :class:`AnalyticStandIn`."""

    gemm_flops: float = 450e12
    """Achieved dense bf16 GEMM rate."""
    attention_flops: float = 350e12
    """Achieved flash-attention rate."""
    link_bytes_per_s: float = 150e9
    """Per-rank collective bandwidth inside the group."""
    latency_s: float = 15e-6
    """Per message (collectives: per ring step)."""
    memory_bytes: float = 80 * _GIB


@dataclasses.dataclass(frozen=True)
class _Part:
    """One sublayer under one strategy: forward and backward seconds, saved and transient bytes."""

    forward_s: float
    backward_s: float
    saved: float
    transient: float


class AnalyticStandIn:
    """A stand-in for the calibrated cost model, from textbook FLOP and byte counts (bf16).

    Per rank, for ``s`` tokens of ``b`` samples on ``p`` ranks, with ``A = s b h 2 / p`` the bytes of
    one ``[s/p, b, h]`` activation:

    - ``tp_sp`` all-gathers ``[s, b, h]`` and keeps it for backward (``p A`` saved per sublayer, and as
      much transient for the partial output), moving no weights: fastest on short sequences.
    - ``ulysses``/``ring`` (attention) and ``zero3`` (MLP) work on local tokens and all-gather the
      sublayer's weights (transient) and reduce-scatter their gradients; ring hides its ``p - 1`` K/V
      hops behind the attention kernel.
    - ``lean`` streams weight blocks (two in flight) with ``p^2`` latency-bound messages and keeps only
      the sublayer's input (and attention output).
    - Recompute keeps only the layer's input, runs the forward again in backward, and holds the
      recomputed activations while the layer's backward runs (transient).

    Layer time is forward + backward (+ forward again under recompute), without overlap between
    sublayers; the peak is the model state of the stage (``bytes_per_param`` per parameter) plus a
    fixed working set plus 5% allocator slack on activations. Unknown strategy names are an error.
    """

    def __init__(
        self,
        shape: ModelShape,
        p: int,
        num_layers: int,
        *,
        hardware: Hardware = Hardware(),
        bytes_per_param: float = 18.0,
        fixed_bytes: float = 4 * _GIB,
    ) -> None:
        self.shape, self.p, self.hw = shape, p, hardware
        h = shape.hidden_size
        self.qkv_width = (shape.num_attention_heads + 2 * shape.num_query_groups) * shape.kv_channels
        self.core_width = shape.num_attention_heads * shape.kv_channels
        self.fc1_width = shape.ffn_hidden_size * (2 if shape.gated_mlp else 1)
        self.attention_params = h * (self.qkv_width + self.core_width)
        self.mlp_params = h * (self.fc1_width + shape.ffn_hidden_size)
        self.static_bytes = num_layers * (self.attention_params + self.mlp_params) / p * bytes_per_param + fixed_bytes
        self._attention = {
            "tp_sp": self._attention_tp_sp,
            "ulysses": self._ulysses,
            "ring": self._ring,
            "lean": self._attention_lean,
        }
        self._mlp = {"tp_sp": self._mlp_tp_sp, "zero3": self._zero3, "lean": self._mlp_lean}

    # -- the CostModel protocol ---------------------------------------------------------------------
    def layer_cost(self, option: LayerOption, layout: SequenceLayout, micro_batch_size: int) -> LayerCost:
        s, b = layout.padded_len, micro_batch_size
        attention = self._part(self._attention, option.attention, s, b, layout.causal)
        mlp = self._part(self._mlp, option.mlp, s, b, layout.causal)
        forward = attention.forward_s + mlp.forward_s
        time_s = forward + attention.backward_s + mlp.backward_s
        saved = attention.saved + mlp.saved
        transient = max(attention.transient, mlp.transient)
        if option.recompute:
            time_s += forward
            transient += saved
            saved = self._activation(s, b)
        return LayerCost(time_s, saved, transient)

    def peak_bytes(
        self, layout: SequenceLayout, micro_batch_size: int, saved_bytes: float, transient_bytes: float
    ) -> float:
        return self.static_bytes + 1.05 * (saved_bytes + transient_bytes)

    # -- terms ----------------------------------------------------------------------------------------
    def _part(self, table: dict, name: str, s: int, b: int, causal: bool) -> _Part:
        if name not in table:
            raise ValueError(f"the analytic stand-in has no cost terms for strategy {name!r}; known: {sorted(table)}")
        return table[name](s, b, causal)

    def _activation(self, s: int, b: int) -> float:
        return s * b * self.shape.hidden_size * 2 / self.p

    def _gemm(self, s: int, b: int, params: int) -> float:
        return 2 * s * b * params / self.p / self.hw.gemm_flops

    def _core(self, s: int, b: int, causal: bool) -> float:
        flops = 4 * s * s * b * self.core_width / self.p * (0.5 if causal else 1.0)
        return flops / self.hw.attention_flops

    def _collective(self, total_bytes: float) -> float:
        """All-gather or reduce-scatter of ``total_bytes`` (ring algorithm)."""
        p = self.p
        return (p - 1) * self.hw.latency_s + total_bytes * (p - 1) / p / self.hw.link_bytes_per_s

    def _streamed(self, weight_bytes: float) -> float:
        """Weight blocks sent one at a time: ``p^2`` messages carrying ``(p - 1) / p`` of the weights."""
        p = self.p
        return p * p * self.hw.latency_s + weight_bytes * (p - 1) / p / self.hw.link_bytes_per_s

    def _attention_tp_sp(self, s: int, b: int, causal: bool) -> _Part:
        a, p, h = self._activation(s, b), self.p, self.shape.hidden_size
        gemm, core, comm = self._gemm(s, b, self.attention_params), self._core(s, b, causal), self._collective(p * a)
        saved = p * a + a * (self.qkv_width + self.core_width) / h
        return _Part(gemm + core + 2 * comm, 2 * gemm + 2.5 * core + 2 * comm, saved, p * a + a)

    def _ulysses(self, s: int, b: int, causal: bool) -> _Part:
        a, h = self._activation(s, b), self.shape.hidden_size
        gemm, core = self._gemm(s, b, self.attention_params), self._core(s, b, causal)
        weights = 2 * self.attention_params
        a2a = self._collective(a * (self.qkv_width + self.core_width) / h)
        gather = self._collective(weights)
        saved = a + a * (self.qkv_width + 2 * self.core_width) / h
        transient = weights + 2 * a * self.qkv_width / h
        return _Part(gemm + core + a2a + gather, 2 * gemm + 2.5 * core + a2a + 2 * gather, saved, transient)

    def _ring(self, s: int, b: int, causal: bool) -> _Part:
        a, p, h = self._activation(s, b), self.p, self.shape.hidden_size
        gemm, core = self._gemm(s, b, self.attention_params), 1.1 * self._core(s, b, causal)
        kv_block = 2 * a * self.shape.num_query_groups * self.shape.kv_channels / h
        hop = self.hw.latency_s + kv_block / self.hw.link_bytes_per_s
        weights = 2 * self.attention_params
        gather = self._collective(weights)
        forward = gemm + max(core, (p - 1) * hop) + gather
        backward = 2 * gemm + max(2.5 * core, 2 * (p - 1) * hop) + 2 * gather
        saved = a + a * (self.qkv_width + self.core_width) / h
        return _Part(forward, backward, saved, weights + 4 * kv_block)

    def _attention_lean(self, s: int, b: int, causal: bool) -> _Part:
        a, p, h = self._activation(s, b), self.p, self.shape.hidden_size
        gemm, core = 1.15 * self._gemm(s, b, self.attention_params), 1.1 * self._core(s, b, causal)
        kv_block = 2 * a * self.shape.num_query_groups * self.shape.kv_channels / h
        weights = 2 * self.attention_params
        comm = self._streamed(weights) + (p - 1) * kv_block / self.hw.link_bytes_per_s
        saved = a + a * self.core_width / h
        transient = 2 * weights / p + 4 * kv_block + a * self.qkv_width / h / p
        return _Part(gemm + core + comm, 2 * gemm + 2.5 * core + 2 * comm, saved, transient)

    def _mlp_tp_sp(self, s: int, b: int, causal: bool) -> _Part:
        a, p, h = self._activation(s, b), self.p, self.shape.hidden_size
        gemm, comm = self._gemm(s, b, self.mlp_params), self._collective(p * a)
        saved = p * a + a * (self.fc1_width + self.shape.ffn_hidden_size) / h
        return _Part(gemm + 2 * comm, 2 * gemm + 2 * comm, saved, p * a + a * self.fc1_width / h)

    def _zero3(self, s: int, b: int, causal: bool) -> _Part:
        a, h = self._activation(s, b), self.shape.hidden_size
        gemm, weights = self._gemm(s, b, self.mlp_params), 2 * self.mlp_params
        gather = self._collective(weights)
        saved = a + a * (self.fc1_width + self.shape.ffn_hidden_size) / h
        return _Part(gemm + gather, 2 * gemm + 2 * gather, saved, weights + a * self.fc1_width / h)

    def _mlp_lean(self, s: int, b: int, causal: bool) -> _Part:
        a, p, h = self._activation(s, b), self.p, self.shape.hidden_size
        gemm, weights = 1.1 * self._gemm(s, b, self.mlp_params), 2 * self.mlp_params
        comm = self._streamed(weights)
        transient = 2 * weights / p + a * self.fc1_width / h / p
        return _Part(gemm + comm, 2 * gemm + 2 * comm, a, transient)


def build_cost_model(shape: ModelShape, p: int, num_layers: int) -> tuple[CostModel, str]:
    """The cost model the benchmark plans with, and a line saying what it is."""
    return AnalyticStandIn(shape, p, num_layers), "analytic stand-in (textbook FLOP/byte counts, NOT calibrated)"


def bench_shape() -> ModelShape:
    """A LLaMA-3-8B-sized layer (GQA, SwiGLU)."""
    return ModelShape(
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        kv_channels=128,
        ffn_hidden_size=14336,
        gated_mlp=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_paradyse.bench planner", description=__doc__)
    parser.add_argument("--layers", type=int, default=96, help="layers on the stage")
    parser.add_argument("--p", type=int, default=8, help="ranks of the group")
    parser.add_argument("--uncached-calls", type=int, default=300)
    parser.add_argument("--cached-calls", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)

    shape = bench_shape()
    cost_model, description = build_cost_model(shape, args.p, args.layers)
    budget = 0.9 * Hardware().memory_bytes
    config = PlannerConfig()
    planner = Planner.for_model(config, cost_model, shape=shape, p=args.p, num_layers=args.layers, budget_bytes=budget)
    longest = planner.max_feasible_length(args.p, causal=True)
    print(f"cost model: {description}")
    print(
        f"stage: {args.layers} layers of {shape}, p={args.p}; budget {budget / _GIB:.1f} GiB; "
        f"{len(planner.options)} options: {', '.join(map(str, planner.options))}"
    )
    if planner.excluded:
        print(f"excluded: {planner.excluded}")
    print(f"longest feasible sequence: {longest} tokens")
    if longest == 0:
        print("error: no sequence fits the budget", file=sys.stderr)
        return 1

    sweep = _sweep(planner, args.p, longest)
    rng = random.Random(args.seed)
    lengths = [rng.randint(1, longest) for _ in range(args.uncached_calls)]
    result = {
        "cost_model": description,
        "layers": args.layers,
        "p": args.p,
        "options": len(planner.options),
        "longest_feasible": longest,
        "sweep": sweep,
    }
    uncached = _latencies_us(planner, args.p, lengths, clear=True)
    for n in lengths:  # every bucket planned
        planner.decide(SequenceLayout.build(n, args.p, causal=True))
    cached = _latencies_us(planner, args.p, [rng.choice(lengths) for _ in range(args.cached_calls)], clear=False)
    print(f"\n{'decide()':<10} {'calls':>6} {'median us':>10} {'p99 us':>10} {'cpu median us':>14} {'cpu max us':>11}")
    for name, (wall, cpu) in (("uncached", uncached), ("cached", cached)):
        result |= {f"planner_us_{name}": statistics.median(wall), f"planner_us_{name}_p99": _percentile(wall, 0.99)}
        result |= {f"planner_cpu_us_{name}": statistics.median(cpu), f"planner_cpu_us_{name}_max": max(cpu)}
        print(
            f"{name:<10} {len(wall):>6} {statistics.median(wall):>10.1f} {_percentile(wall, 0.99):>10.1f} "
            f"{statistics.median(cpu):>14.1f} {max(cpu):>11.1f}"
        )
    print("wall-clock figures are noisy on a shared machine (CPU time is not): re-measure on a quiet one")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(
        f"planner_us_cached={result['planner_us_cached']:.2f} planner_us_uncached={result['planner_us_uncached']:.0f}"
    )
    return 0


def _sweep(planner: Planner, p: int, longest: int) -> list[dict]:
    """Plans from 1K tokens to the longest feasible length, and how much slower Algorithm 1's are."""
    print(f"\n{'tokens':>8}  {'time s':>8}  {'peak GiB':>8}  {'Alg.1 gap':>9}  plan (exact)")
    rows, n = [], 1024
    while True:
        n = min(n, longest)
        layout = SequenceLayout.build(n, p, causal=True)
        decision = planner.decide(layout)
        problem = planner.stage_problem(layout)
        exact, heuristic = solve_exact(problem), solve_heuristic(problem)
        gap = heuristic.time_s / exact.time_s - 1 if heuristic else float("inf")
        plan = decision.plan
        print(
            f"{n:>8}  {plan.predicted_time_s:>8.4f}  {plan.predicted_peak_bytes / _GIB:>8.2f}  "
            f"{100 * gap:>8.2f}%  {plan.compact()}"
        )
        rows.append({"tokens": n, "plan": plan.compact(), "time_s": plan.predicted_time_s, "heuristic_gap": gap})
        if n == longest:
            return rows
        n *= 2


def _latencies_us(planner: Planner, p: int, lengths: list[int], *, clear: bool) -> tuple[list[float], list[float]]:
    """Wall-clock and thread CPU microseconds of ``decide`` for each length."""
    layouts = [SequenceLayout.build(n, p, causal=True) for n in lengths]
    wall, cpu = [], []
    for layout in layouts:
        if clear:
            planner.clear_cache()
        start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        planner.decide(layout)
        cpu.append((time.thread_time_ns() - start_cpu) / 1e3)
        wall.append((time.perf_counter_ns() - start) / 1e3)
    return wall, cpu


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
