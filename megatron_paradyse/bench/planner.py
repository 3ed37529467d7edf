"""Planner decision latency: ``python -m megatron_paradyse.bench planner [--layers 96] [--gpu h100]``
(or ``--profile FILE``: a calibrated profile, for ``--p`` ranks; ``--pipeline-stages N``).

One pipeline stage of ``--layers`` layers, every registered strategy for attention and MLP, each
without recompute, with it, and with it keeping the attention core. Prints the plans along a length
sweep (with the paper's Algorithm 1 beside the exact planner), then the median latency of
``Planner.decide``: uncached (the cache cleared before every call, lengths drawn at random) and cached
(every bucket already planned). With ``--pipeline-stages N`` the layers are split over ``N`` stages,
each with its planner, and a call is every stage's ``decide``: what each rank of a pipeline-parallel
job spends on a micro-batch, since every rank plans every stage
(:mod:`megatron_paradyse.run.planned_loader`). Last line: ``planner_us_cached=<x> planner_us_uncached=<y>``.

The planner prices options with the analytic cost model training uses
(:class:`~megatron_paradyse.cost.AnalyticCostModel`), from a profile: by default the one
:func:`~megatron_paradyse.cost.hardware.hardware_profile` builds from the published figures of an
8-GPU node (``--gpu``; simulated, nothing measured), or a profile ``paradyse calibrate`` measured
(``--profile``). The stage holds the transformer layers' weights, gradients and Adam state
(:func:`~megatron_paradyse.cost.hardware.stage_static_bytes`); the budget is 90% of the GPU's memory
(``--budget-gib``). Timings are wall clock on whatever machine runs this; on a shared machine they
are noisy.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.cost import AnalyticCostModel, load_profile
from megatron_paradyse.cost.hardware import HARDWARE, hardware_profile, node_group, stage_static_bytes
from megatron_paradyse.planner import Planner, PlannerConfig, solve_exact, solve_heuristic
from megatron_paradyse.strategies import ModelShape

_GIB = 2**30


def build_cost_model(
    shape: ModelShape, p: int, num_layers: int, *, gpu: str = "h100", profile: str | None = None
) -> tuple[AnalyticCostModel, str]:
    """The cost model the benchmark plans with, and a line saying what it is: priced by ``profile``
    (a calibrated profile's path, this machine or not) or else by ``gpu``'s published figures."""
    if profile is None:
        try:
            rates = hardware_profile(node_group(gpu, p))
        except ValueError as e:
            raise ValueError(f"{e}: pass --profile with a profile calibrated for p={p}") from None
        description = f"analytic, {gpu} node simulated from its figures (megatron_paradyse/cost/hardware.py)"
    else:
        rates = load_profile(profile, p=p, check_machine=False)
        description = f"analytic, calibrated profile {profile}"
    model = AnalyticCostModel(
        rates,
        shape,
        p,
        dtype=getattr(torch, rates["dtype"]),
        static_bytes=stage_static_bytes(shape, num_layers, p),
        bias=False,  # LLaMA's linear layers have no biases
    )
    return model, description


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
    parser.add_argument("--layers", type=int, default=96, help="layers on the stage (on all stages together)")
    parser.add_argument("--pipeline-stages", type=int, default=1, help="pipeline stages the layers are split over")
    parser.add_argument("--p", type=int, default=8, help="ranks of the group")
    parser.add_argument("--gpu", choices=sorted(HARDWARE), default="h100", help="node whose published figures price")
    parser.add_argument("--profile", help="a calibrated cost profile (JSON) to price with instead")
    parser.add_argument("--budget-gib", type=float, help="memory budget per GPU (default: 90%% of --gpu's)")
    parser.add_argument("--uncached-calls", type=int, default=300)
    parser.add_argument("--cached-calls", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)

    shape = bench_shape()
    stages = args.pipeline_stages
    if stages < 1 or args.layers % stages:
        print(f"error: --layers {args.layers} does not split over --pipeline-stages {stages}", file=sys.stderr)
        return 2
    layers = args.layers // stages
    try:
        cost_model, description = build_cost_model(shape, args.p, layers, gpu=args.gpu, profile=args.profile)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    budget = args.budget_gib * _GIB if args.budget_gib else 0.9 * HARDWARE[args.gpu].memory_bytes
    config = PlannerConfig()
    # the stages' models share what they price of the layers, as a job's do (run.stage_planning.stage_cost_models)
    planners = [
        Planner.for_model(
            config,
            cost_model.for_stage(static_bytes=cost_model.static_bytes, vocab_size=0),
            shape=shape,
            p=args.p,
            num_layers=layers,
            budget_bytes=budget,
        )
        for _ in range(stages)
    ]
    planner = planners[0]
    longest = planner.max_feasible_length(args.p, causal=True)
    print(f"cost model: {description}")
    print(
        f"stage: {layers} layers of {shape}, p={args.p}; budget {budget / _GIB:.1f} GiB; "
        f"{len(planner.options)} options: {', '.join(map(str, planner.options))}"
    )
    if stages > 1:
        print(f"{stages} pipeline stages alike: a call below is every stage's decide, as every rank makes them")
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
        "layers": layers,
        "pipeline_stages": stages,
        "p": args.p,
        "options": len(planner.options),
        "longest_feasible": longest,
        "sweep": sweep,
    }
    uncached = _latencies_us(planners, args.p, lengths, clear=True)
    for n in lengths:  # every bucket planned
        for stage_planner in planners:
            stage_planner.decide(SequenceLayout.build(n, args.p, causal=True))
    cached = _latencies_us(planners, args.p, [rng.choice(lengths) for _ in range(args.cached_calls)], clear=False)
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


def _latencies_us(
    planners: list[Planner], p: int, lengths: list[int], *, clear: bool
) -> tuple[list[float], list[float]]:
    """Wall-clock and thread CPU microseconds of every planner's ``decide`` for each length."""
    layouts = [SequenceLayout.build(n, p, causal=True) for n in lengths]
    wall, cpu = [], []
    for layout in layouts:
        if clear:
            for planner in planners:
                planner.clear_cache()
        start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        for planner in planners:
            planner.decide(layout)
        cpu.append((time.thread_time_ns() - start_cpu) / 1e3)
        wall.append((time.perf_counter_ns() - start) / 1e3)
    return wall, cpu


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
