"""How much a planner that learns from measured steps loses or gains, on a machine whose truth is known.

    python -m megatron_paradyse.bench learning
    python -m megatron_paradyse.bench learning --noise 0.02,0.09 --model-error 0.03 --steps 1000

`bench e2e` measures the learning arm on real steps of the 2-core CPU machine, whose jitter (about 9% a
step) is larger than the differences it is after, in a run too short to average it out. Here the
machine is simulated, so that the best plan is known and every step can be compared with it. The
planners are the project's own (:class:`~megatron_paradyse.planner.Planner` over a stage of ``--layers``
Llama-3-8B layers on an H100 node's published figures, p=8, every option, a 40 GiB budget, with
:class:`~megatron_paradyse.cost.correction.TimeCorrections` and its exploration where it learns, at
the planner's defaults unless given); only the measured time is made up:

- the machine's true time of a plan is the model's, each layer's time multiplied by a hidden factor of
  its attention strategy times one of its MLP strategy (lognormal, ``--model-error`` wide: the model's
  error between options; `bench costmodel` measured options predicted up to 28% slow on the CPU
  machine), times a trend in length common to every option (``(length / 8K) ** beta``, beta ~ N(0, 0.1));
- each measured step is that times lognormal noise (``--noise`` wide: 0.09 is the 2-core CPU
  machine's, 0.02 a quiet machine's).

Per seed the three planners see the same stream of sequence lengths (log-uniform in ``--min-len``
..``--max-len``) and the same noise: ``model`` plans on the cost model alone, ``learn`` learns from
each step (one agreement a step, as in a run with one micro-batch per iteration), and ``oracle`` plans
on the true times. Printed per noise level: the mean and the 90th percentile over seeds of the true
time of each planner's steps over the oracle's, over all steps and over the second half (once learned);
last ``learn_vs_oracle=<x> model_vs_oracle=<y> learn_vs_model=<z>`` over all steps at the largest noise.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence

import numpy as np

from megatron_paradyse.bench.planner import bench_shape, build_cost_model
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption, Plan
from megatron_paradyse.cost.base import StageOptions
from megatron_paradyse.cost.correction import CorrectedCostModel, TimeCorrections
from megatron_paradyse.planner import Planner, PlannerConfig
from megatron_paradyse.strategies import strategy_names

GIB = 2**30
P = 8
ARMS = ("model", "learn")


class _Machine:
    """True layer-time factors of one seed: per attention strategy times per MLP strategy, times a trend
    in length common to every option. Answers ``factor(option, bucket)`` as learned corrections do."""

    def __init__(self, rng: np.random.Generator, model_error: float) -> None:
        self._attention = {a: math.exp(rng.normal(0, model_error)) for a in strategy_names("attention")}
        self._mlp = {m: math.exp(rng.normal(0, model_error)) for m in strategy_names("mlp")}
        self._trend = rng.normal(0, 0.1)  # factor (bucket / 8192) ** trend: the model's error in length

    def factor(self, option: LayerOption | str, bucket: int) -> float:
        option = LayerOption.parse(str(option))
        return self._attention[option.attention] * self._mlp[option.mlp] * (bucket / 8192) ** self._trend


def _true_time(planner: Planner, machine: _Machine, plan: Plan, layout: SequenceLayout) -> float:
    """The step time of ``plan`` on ``machine`` at ``layout`` without noise (``planner``: one that plans on
    the model alone)."""
    base = planner.cost_model
    bucket = planner.bucket_layout(layout).padded_len
    layers = math.fsum(base.layer_cost(o, layout, 1).time_s * machine.factor(o, bucket) for o in plan)
    return layers + base.stage_time_s(layout, 1, StageOptions.of(plan))


def run_seed(
    seed: int,
    noise: float,
    model_error: float,
    steps: int,
    lengths: tuple[int, int],
    layers: int,
    config: PlannerConfig,
) -> dict[str, tuple[float, float]]:
    """True step times of each arm over the oracle's, over all steps and over the second half."""
    rng = np.random.default_rng(seed)
    machine = _Machine(rng, model_error)
    stream = np.exp(rng.uniform(math.log(lengths[0]), math.log(lengths[1]), steps)).astype(int)
    noises = np.exp(rng.normal(0, noise, steps))
    base, _ = build_cost_model(bench_shape(), P, layers, gpu="h100")
    kwargs = dict(shape=bench_shape(), p=P, num_layers=layers, budget_bytes=40 * GIB)
    planners = {
        "model": Planner.for_model(config, base, **kwargs),
        "learn": Planner.for_model(
            config, base, **kwargs, time_corrections=TimeCorrections(config.learning.learn_prior)
        ),
        "oracle": Planner.for_model(config, CorrectedCostModel(base, machine), **kwargs),
    }
    times: dict[str, list[float]] = {name: [] for name in planners}
    for tokens, step_noise in zip(stream, noises):
        layout = SequenceLayout.build([int(tokens)], P, causal=True)
        for name, planner in planners.items():
            plan = planner.decide(layout).plan
            true = _true_time(planners["model"], machine, plan, layout)
            times[name].append(true)
            if name == "learn":
                planner.observe_time(layout, plan, true * step_noise)
                if planner.cost_model.corrections.agree():
                    planner.clear_cache()
    half = steps // 2
    return {
        arm: (
            math.fsum(times[arm]) / math.fsum(times["oracle"]),
            math.fsum(times[arm][half:]) / math.fsum(times["oracle"][half:]),
        )
        for arm in ARMS
    }


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_paradyse.bench learning", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--noise", type=_floats, default=[0.02, 0.09], help="step noise widths (default 0.02,0.09)")
    parser.add_argument("--model-error", type=float, default=0.1, help="width of the model's error per strategy")
    parser.add_argument("--seeds", type=int, default=20, help="simulated runs per noise level (default 20)")
    parser.add_argument("--steps", type=int, default=300, help="micro-batches per run (default 300)")
    parser.add_argument("--min-len", type=int, default=2048, help="shortest sequence, tokens (default 2048)")
    parser.add_argument("--max-len", type=int, default=131072, help="longest sequence, tokens (default 131072)")
    parser.add_argument("--layers", type=int, default=8, help="layers in the stage (default 8)")
    defaults = PlannerConfig().learning
    for name in ("learn_prior", "explore_share", "explore_margin"):
        flag = "--" + name.replace("_", "-")
        parser.add_argument(
            flag, type=float, default=getattr(defaults, name), help=f"planner.{name} (default %(default)s)"
        )
    args = parser.parse_args(argv)
    try:
        config = PlannerConfig(
            learn_time=True,
            learn_prior=args.learn_prior,
            explore_share=args.explore_share,
            explore_margin=args.explore_margin,
        )
    except ValueError as e:
        parser.error(str(e))
    if not args.noise or min(args.noise) < 0 or args.model_error < 0 or args.seeds < 1 or args.steps < 2:
        parser.error("--noise and --model-error must be >= 0, --seeds >= 1, --steps >= 2")
    if not 0 < args.min_len <= args.max_len:
        parser.error(f"need 0 < --min-len <= --max-len, got {args.min_len} and {args.max_len}")

    print(f"{'noise':>6} {'arm':>6} {'all steps: mean':>16} {'p90':>6} {'second half: mean':>18} {'p90':>6}")
    summary = {}
    for noise in args.noise:
        runs = [
            run_seed(seed, noise, args.model_error, args.steps, (args.min_len, args.max_len), args.layers, config)
            for seed in range(args.seeds)
        ]
        for arm in ARMS:
            whole = [r[arm][0] for r in runs]
            late = [r[arm][1] for r in runs]
            summary[noise, arm] = statistics.fmean(whole)
            print(
                f"{noise:>6.2f} {arm:>6} {statistics.fmean(whole):>16.4f} {np.quantile(whole, 0.9):>6.4f}"
                f" {statistics.fmean(late):>18.4f} {np.quantile(late, 0.9):>6.4f}"
            )
    worst = max(args.noise)
    learn, model = summary[worst, "learn"], summary[worst, "model"]
    print(f"learn_vs_oracle={learn:.4f} model_vs_oracle={model:.4f} learn_vs_model={learn / model:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
