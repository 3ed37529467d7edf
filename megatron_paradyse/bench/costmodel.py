"""How well the cost models predict one layer's time and peak memory, against measurements.

    python -m megatron_paradyse.bench costmodel --profile profile.json
    python -m megatron_paradyse.bench costmodel                  # calibrates quickly first, and says so

Measures every (attention, MLP, recompute) option (attention ``tp_sp``/``ulysses``/``ring``/``lean``
x MLP ``tp_sp``/``zero3``/``lean`` x recompute, or the ``--pairs`` given) on ``p`` gloo ranks over a
grid of causal sequence lengths (one layer of h=256, 8 heads, ffn=1024, b=1, fp32:
:data:`REFERENCE_SHAPE`):
forward + backward time (the slowest rank's, median over passes over the grid after a warm-up) and
peak memory above the layer's input and static memory (:class:`PeakMemory`). Compared with:

- the calibrated analytic model (:class:`AnalyticCostModel` on the profile): its headline time MAPE
  leaves out the points its fitted correction (if any) was fitted on; the MAPE over all points, and
  without the correction, is printed before it;
- the paper's empirical model (:class:`EmpiricalCostModel`), leave-one-length-out: each length is
  predicted from the others (forest inside their range, AIC polynomial beyond: the longest length
  is extrapolated).

Prints the table, the MAPEs per option and of the empirical model, then per length how well the
analytic model *ranks* the options (the planner's job): Kendall's tau-b of predicted against measured
times and the share of option pairs ordered correctly (:func:`rank_agreement`, over the points the
correction was not fitted on), and last ``time_mape=<x> mem_mape=<y> rank_tau_min=<t>
pairs_ordered=<f>`` of the analytic model (:func:`summary_line`). Timings are only as quiet as the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Sequence
from typing import NamedTuple

import torch.distributed as dist

from megatron_paradyse.calibration.calibrate import calibrate
from megatron_paradyse.calibration.grid import REFERENCE_SHAPE, correction_layers
from megatron_paradyse.calibration.measure import measure_layer
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.analytic import AnalyticCostModel
from megatron_paradyse.cost.empirical import EmpiricalCostModel, Sample
from megatron_paradyse.cost.fitting import mape
from megatron_paradyse.cost.profile import load_profile, save_profile

__all__ = ["RankAgreement", "length_line", "main", "rank_agreement", "summary_line"]

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class RankAgreement:
    """How well predicted times order the options measured at one length (:func:`rank_agreement`)."""

    options: int
    """Options compared."""
    tau: float
    """Kendall's tau-b of predicted against measured times; nan if undefined."""
    pairs_correct: int
    """Pairs (not tied in measurement) whose order the prediction gets right."""
    pairs: int
    """Pairs not tied in measurement."""


def rank_agreement(predicted: Sequence[float], measured: Sequence[float]) -> RankAgreement:
    """Rank agreement of ``predicted`` and ``measured`` times of the same ``n`` options (same order).

    Over the ``n0 = n (n - 1) / 2`` pairs ``(i, j)``, ties by exact equality: a pair is concordant if
    ``predicted`` and ``measured`` order it the same way (both strictly), discordant if opposite ways;
    ``n1`` pairs are tied in ``predicted``, ``n2`` tied in ``measured`` (a pair tied in both counts in
    both). Kendall's tau-b is ``(concordant - discordant) / sqrt((n0 - n1) * (n0 - n2))``, nan where that
    denominator is 0 (every prediction or every measurement equal).

    ``pairs`` counts the pairs not tied in ``measured`` (a tie there has no order to get right: left
    out), ``pairs_correct`` those of them the prediction orders the same strict way: a pair tied in
    ``predicted`` but not in ``measured`` counts as wrong.

    With fewer than 2 options: ``tau`` nan and 0 pairs; callers skip such a length.
    """
    if len(predicted) != len(measured):
        raise ValueError(f"{len(predicted)} predictions for {len(measured)} measurements")
    n = len(measured)
    concordant = discordant = tied_predicted = tied_measured = 0
    for i in range(n):
        for j in range(i + 1, n):
            dp = _sign(predicted[j] - predicted[i])
            dm = _sign(measured[j] - measured[i])
            tied_predicted += dp == 0
            tied_measured += dm == 0
            if dp and dm:
                if dp == dm:
                    concordant += 1
                else:
                    discordant += 1
    n0 = n * (n - 1) // 2
    denominator = math.sqrt((n0 - tied_predicted) * (n0 - tied_measured))
    tau = (concordant - discordant) / denominator if denominator > 0 else math.nan
    return RankAgreement(options=n, tau=tau, pairs_correct=concordant, pairs=n0 - tied_measured)


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def length_line(length: int, agreement: RankAgreement) -> str:
    """``length=<s> options=<n> kendall_tau=<x.xxx> pairs_ordered=<k>/<m> (<pct>%)``."""
    share = f"{agreement.pairs_correct / agreement.pairs * 100:.1f}%" if agreement.pairs else "no pairs"
    line = (
        f"length={length} options={agreement.options} kendall_tau={agreement.tau:.3f} "
        f"pairs_ordered={agreement.pairs_correct}/{agreement.pairs} ({share})"
    )
    return line + ("  (skipped: fewer than 2 options)" if agreement.options < 2 else "")


def summary_line(time_mape: float, mem_mape: float, agreements: Sequence[RankAgreement]) -> str:
    """The last line: ``time_mape=<x> mem_mape=<y> rank_tau_min=<t> pairs_ordered=<f>``.

    ``rank_tau_min``: the smallest tau-b over the lengths (those with 2 options or more and a defined
    tau); ``pairs_ordered``: correctly ordered pairs over all pairs, the lengths' pairs pooled. nan when
    there is nothing to take them over.
    """
    taus = [a.tau for a in agreements if a.options >= 2 and not math.isnan(a.tau)]
    pairs = sum(a.pairs for a in agreements if a.options >= 2)
    correct = sum(a.pairs_correct for a in agreements if a.options >= 2)
    tau_min = min(taus) if taus else math.nan
    share = correct / pairs if pairs else math.nan
    return f"time_mape={time_mape:.1f} mem_mape={mem_mape:.1f} rank_tau_min={tau_min:.3f} pairs_ordered={share:.3f}"


def _measure_grid(rank: int, p: int, lengths, options, repeats: int) -> list[Sample]:
    """Memory once per point, then ``repeats`` passes over the whole grid, one timed run per point and
    pass: a burst of load from elsewhere then hits one run of many points, not every run of one."""
    points = [(SequenceLayout.build(s, p, causal=True), option) for s in lengths for option in options]
    memory = {}
    for layout, option in points:
        m = measure_layer(option, layout, REFERENCE_SHAPE, dist.group.WORLD, repeats=0)
        memory[(layout.padded_len, option)] = m
    times: dict[tuple[int, LayerOption], list[float]] = {}
    for i in range(repeats):
        for layout, option in points:
            m = measure_layer(option, layout, REFERENCE_SHAPE, dist.group.WORLD, warmup=0, repeats=1, memory_runs=0)
            times.setdefault((layout.padded_len, option), []).append(m.time_s)
        if rank == 0:
            print(f"timed pass {i + 1}/{repeats} over {len(points)} points", file=sys.stderr, flush=True)
    return [
        Sample(option, length, statistics.median(times[(length, option)]), m.saved_bytes, m.peak_bytes)
        for (length, option), m in memory.items()
    ]


def _leave_one_length_out(samples: list[Sample]) -> dict[tuple[LayerOption, int], tuple[float, float]]:
    """Empirical (time, peak) of every sample from a model fitted on the other lengths."""
    predictions = {}
    for length in sorted({s.length for s in samples}):
        model = EmpiricalCostModel([s for s in samples if s.length != length])
        for sample in (s for s in samples if s.length == length):
            cost = model.layer_cost(sample.option, _layout(length, 1), 1)
            predictions[(sample.option, length)] = (cost.time_s, cost.saved_bytes + cost.transient_bytes)
    return predictions


def _layout(length: int, p: int) -> SequenceLayout:
    return SequenceLayout.build(length, p, causal=True)


class _Point(NamedTuple):
    """One measured (option, length) beside the models' predictions of it."""

    sample: Sample
    time_s: float
    """The analytic model's."""
    peak_bytes: float
    empirical_time_s: float
    empirical_peak_bytes: float
    held_out: bool
    """The profile's correction was not fitted on it."""


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.profile and args.save_profile:
        parser.error("--save-profile keeps the profile calibrated here; with --profile nothing is calibrated")
    lengths = [int(v) for v in args.lengths.split(",")]
    options = [
        dataclasses.replace(LayerOption.parse(pair), recompute=rc)
        for pair in args.pairs.split(",")
        for rc in (False, True)
    ]
    profile = _profile(args)
    model = AnalyticCostModel(profile, REFERENCE_SHAPE, args.p)
    uncorrected = AnalyticCostModel(profile, REFERENCE_SHAPE, args.p, use_correction=False)
    samples = run_on_ranks(_measure_grid, args.p, args=(lengths, options, args.repeats), timeout_s=3600)[0]
    fitted_on = set((profile.get("correction") or {}).get("fitted_on", ()))
    points = _print_points(samples, model, args.p, profile["grid"], fitted_on)
    _print_option_mapes(points, options)
    agreements = _print_rank_agreement(points)
    _print_overall_mapes(points, uncorrected, args.p)
    if args.json:
        _write_json(points, args.json)
    held = [pt for pt in points if pt.held_out]
    time_mape = mape([pt.time_s for pt in held], [pt.sample.time_s for pt in held])
    mem_mape = mape([pt.peak_bytes for pt in points], [pt.sample.peak_bytes for pt in points])
    print(summary_line(time_mape, mem_mape, agreements))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_paradyse.bench costmodel", description=__doc__)
    parser.add_argument("--p", type=int, default=4)
    parser.add_argument("--lengths", default="256,512,1024,2048,4096,8192")
    parser.add_argument("--profile", help="cost profile from `paradyse calibrate` (default: calibrate quickly)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes over the grid (median)")
    parser.add_argument(
        "--pairs",
        default=",".join(str(option) for option in correction_layers()),
        help="attention/mlp pairs, each with and without recompute (default: every pair of the library)",
    )
    parser.add_argument("--json", help="write every measurement and prediction here")
    parser.add_argument("--save-profile", help="without --profile: keep the profile calibrated here (for --profile)")
    return parser


def _profile(args: argparse.Namespace) -> dict:
    """``--profile``'s, or one calibrated quickly here (kept where ``--save-profile`` says)."""
    if args.profile:
        return load_profile(args.profile, p=args.p)
    print(
        f"no --profile: calibrating quickly on {args.p} ranks (`paradyse calibrate --grid quick --fit-correction`)",
        file=sys.stderr,
    )
    profile = calibrate([args.p], grid="quick", fit_correction=True)
    if args.save_profile:
        save_profile(profile, args.save_profile)
    return profile


def _print_points(
    samples: list[Sample], model: AnalyticCostModel, p: int, grid: str, fitted_on: set[str]
) -> list[_Point]:
    """Every measured point beside the analytic model's and the empirical model's predictions, printed."""
    empirical = _leave_one_length_out(samples)
    header = (
        f"{'option':<20} {'s':>6} | {'time ms':>9} {'model':>9} {'err%':>6} {'empir.':>9} {'err%':>6} | "
        f"{'peak MiB':>9} {'model':>9} {'err%':>6} {'empir.':>9} {'err%':>6}"
    )
    print(
        f"p={p}, layer h={REFERENCE_SHAPE.hidden_size} heads={REFERENCE_SHAPE.num_attention_heads} "
        f"ffn={REFERENCE_SHAPE.ffn_hidden_size} b=1 fp32 causal; profile grid={grid}, "
        f"correction={'fitted on ' + ', '.join(sorted(fitted_on)) if fitted_on else 'none'}"
    )
    print(header)
    print("-" * len(header))
    points = []
    for sample in samples:
        cost = model.layer_cost(sample.option, _layout(sample.length, p), 1)
        peak = cost.saved_bytes + cost.transient_bytes
        emp_time, emp_peak = empirical[(sample.option, sample.length)]
        held_out = f"{sample.option}@{sample.length}" not in fitted_on
        points.append(_Point(sample, cost.time_s, peak, emp_time, emp_peak, held_out))
        print(
            f"{str(sample.option):<20} {sample.length:>6} | {sample.time_s * 1e3:>9.1f} {cost.time_s * 1e3:>9.1f} "
            f"{_err(cost.time_s, sample.time_s):>6} {emp_time * 1e3:>9.1f} {_err(emp_time, sample.time_s):>6} | "
            f"{sample.peak_bytes / MIB:>9.2f} {peak / MIB:>9.2f} {_err(peak, sample.peak_bytes):>6} "
            f"{emp_peak / MIB:>9.2f} {_err(emp_peak, sample.peak_bytes):>6}"
            + ("" if held_out else "  (correction fitted here)")
        )
    return points


def _print_option_mapes(points: list[_Point], options: list[LayerOption]) -> None:
    print(f"{'option':<20} {'time_mape':>9} {'mem_mape':>9}   (analytic, over lengths)")
    for option in options:
        mine = [pt for pt in points if pt.sample.option == option]
        time_mape = mape([pt.time_s for pt in mine], [pt.sample.time_s for pt in mine])
        mem_mape = mape([pt.peak_bytes for pt in mine], [pt.sample.peak_bytes for pt in mine])
        print(f"{str(option):<20} {time_mape:>9.1f} {mem_mape:>9.1f}")


def _print_rank_agreement(points: list[_Point]) -> list[RankAgreement]:
    """How well the analytic times order the options at each length, over the held-out points."""
    print("rank agreement, analytic vs measured time, per length (points the correction was not fitted on):")
    agreements = []
    for length in sorted({pt.sample.length for pt in points}):
        here = [pt for pt in points if pt.held_out and pt.sample.length == length]
        agreement = rank_agreement([pt.time_s for pt in here], [pt.sample.time_s for pt in here])
        agreements.append(agreement)
        print(length_line(length, agreement))
    return agreements


def _print_overall_mapes(points: list[_Point], uncorrected: AnalyticCostModel, p: int) -> None:
    """The analytic model's time MAPE over every point, with and without its fitted correction; the
    empirical model's time and memory MAPEs."""
    measured_t = [pt.sample.time_s for pt in points]
    raw = [uncorrected.layer_cost(pt.sample.option, _layout(pt.sample.length, p), 1).time_s for pt in points]
    print(
        f"analytic, all {len(points)} points: time_mape={mape([pt.time_s for pt in points], measured_t):.1f}; "
        f"without the fitted correction: time_mape={mape(raw, measured_t):.1f}"
    )
    empirical_time = mape([pt.empirical_time_s for pt in points], measured_t)
    empirical_mem = mape([pt.empirical_peak_bytes for pt in points], [pt.sample.peak_bytes for pt in points])
    print(
        f"empirical (paper's RF + AIC polynomial, leave one length out): "
        f"time_mape={empirical_time:.1f} mem_mape={empirical_mem:.1f}"
    )


def _write_json(points: list[_Point], path: str) -> None:
    rows = [
        {
            "option": str(pt.sample.option),
            "length": pt.sample.length,
            "time_s": pt.sample.time_s,
            "peak_bytes": pt.sample.peak_bytes,
            "saved_bytes": pt.sample.saved_bytes,
            "model_time_s": pt.time_s,
            "model_peak_bytes": pt.peak_bytes,
            "empirical_time_s": pt.empirical_time_s,
            "empirical_peak_bytes": pt.empirical_peak_bytes,
            "held_out": pt.held_out,
        }
        for pt in points
    ]
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


def _err(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured * 100:+.0f}"
