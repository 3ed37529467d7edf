"""A time model that learns from the run: measured micro-batches correct each option's predicted time.

Every micro-batch is measured (forward + backward of the stage's layers). A plan's predicted time is
the sum over its layers of each option's time, times that option's correction factor at the
micro-batch's length bucket. A measurement ``m`` of a plan predicted at ``P`` moves the factor of every
option ``o`` the plan uses by its share of the prediction, in log space::

    w_o = f_o * t_o / P              (the option's share of the predicted time)
    log f_o  +=  sum(w_o * log(m / P)) / (sum(w_o) + prior)

where ``P`` also holds the predicted time of the stage's work outside its layers (the output layer and
loss, :meth:`CostModel.stage_time_s`), which no factor corrects.

summed over the micro-batches measured since the last update. ``prior`` (in micro-batches) keeps one
noisy step from swinging a factor; a plan of one option converges to the geometric mean of measured
over predicted.

The times ``t_o`` are the model's at the micro-batch's own length, not at its bucket's upper edge, where
the planner prices the bucket (a bound for memory): a factor is then the model's error alone. Priced at
the edge, a factor would also hold how far below the edge its measured micro-batches were, and two
options measured at different lengths in one bucket (up to 2x apart in the 512-token buckets of short
sequences) would compare by their lengths, not their speed.

Plans stay identical on every rank without talking during a step: ranks only accumulate their own
measurements, and at an iteration boundary every rank gathers every rank's sums
(:meth:`TimeCorrections.agree`, one all-gather of fixed-size rows), adds them in rank order and key order, and
applies the same update: the same floats in the same order give the same factors on every rank, bit
for bit. A bucket an option was never measured in takes the option's factor at the nearest bucket it
was measured in (by length ratio), else the mean log factor of the options measured at the nearest
bucket, else 1. The factors are saved with the data's position in each checkpoint
(:meth:`state_dict`), so a resumed run plans as an uninterrupted one would.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable

import numpy as np
import torch
import torch.distributed as dist

from megatron_paradyse.core.comm import all_gather_single
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption, Plan
from megatron_paradyse.cost.base import WHOLE_LOSS, CostModel, LayerCost, StageOptions

__all__ = ["CorrectedCostModel", "TimeCorrections"]

_LOG_LIMIT = math.log(100.0)
"""Factors stay within [1/100, 100]: a broken measurement cannot make an option free or unusable."""


@dataclasses.dataclass
class _Sums:
    weighted_log_ratio: float = 0.0
    weight: float = 0.0


class TimeCorrections:
    """Correction factors of predicted layer times, per (option, length bucket), agreed across ranks.

    Args:
        prior: weight, in micro-batches, of the current factor against new measurements (> 0).
    """

    def __init__(self, prior: float = 1.0) -> None:
        if not prior > 0 or not math.isfinite(prior):
            raise ValueError(f"prior must be a positive finite number of micro-batches, got {prior!r}")
        self.prior = float(prior)
        self._log_factor: dict[tuple[str, int], float] = {}
        self._pending: dict[tuple[str, int], _Sums] = {}
        self.version = 0
        """Counts the updates that changed a factor: a planner's cached plans are stale when it moves."""

    # -- factors ----------------------------------------------------------------------------------
    def factor(self, option: LayerOption | str, bucket: int) -> float:
        """The correction of ``option``'s time at the bucket whose upper edge is ``bucket`` tokens."""
        return math.exp(self._log(str(option), bucket))

    def measured(self, option: LayerOption | str, bucket: int) -> bool:
        """Whether ``option`` has run (and been measured) at the bucket whose edge is ``bucket`` tokens."""
        return (str(option), bucket) in self._log_factor

    def _log(self, option: str, bucket: int) -> float:
        known = self._log_factor.get((option, bucket))
        if known is not None:
            return known
        if not self._log_factor:
            return 0.0
        buckets = {b for o, b in self._log_factor if o == option}
        if buckets:
            return self._log_factor[(option, _nearest(buckets, bucket))]
        nearest = _nearest({b for _, b in self._log_factor}, bucket)
        logs = [value for (_, b), value in sorted(self._log_factor.items()) if b == nearest]
        return math.fsum(logs) / len(logs)

    # -- learning ---------------------------------------------------------------------------------
    def observe(
        self, plan: Plan, bucket: int, option_times: dict[str, float], measured_s: float, fixed_s: float = 0.0
    ) -> None:
        """Account one micro-batch of ``plan`` measured at ``measured_s`` (its bucket edge ``bucket``;
        ``option_times``: each option's uncorrected predicted time for one layer of the micro-batch;
        ``fixed_s``: the predicted time of the work the measurement holds outside the layers, the same
        under every plan, which no factor corrects)."""
        if not (measured_s > 0 and math.isfinite(measured_s)):
            raise ValueError(f"a measured time must be a positive finite number of seconds, got {measured_s!r}")
        shares = self._shares(plan, bucket, option_times)
        predicted = self.predicted_s(plan, bucket, option_times, fixed_s)
        if not predicted > 0:
            return
        log_ratio = math.log(measured_s / predicted)
        for option, share in shares.items():
            sums = self._pending.setdefault((option, bucket), _Sums())
            weight = share / predicted
            sums.weighted_log_ratio += weight * log_ratio
            sums.weight += weight

    def predicted_s(self, plan: Plan, bucket: int, option_times: dict[str, float], fixed_s: float = 0.0) -> float:
        """The corrected time of ``plan`` (arguments as :meth:`observe`'s): what a measurement is compared with."""
        return math.fsum(self._shares(plan, bucket, option_times).values()) + fixed_s

    def _shares(self, plan: Plan, bucket: int, option_times: dict[str, float]) -> dict[str, float]:
        """Each option's corrected time in ``plan``, all its layers together, in option order."""
        layers: dict[str, int] = {}
        for option in plan:
            layers[str(option)] = layers.get(str(option), 0) + 1
        return {o: n * option_times[o] * self.factor(o, bucket) for o, n in sorted(layers.items())}

    def agree(self, group=None, *, most_entries: int | None = None) -> bool:
        """Merge every rank's pending measurements and update the factors, the same on every rank (one
        all-gather over ``group``, the default group if None; single process: no collective). True when
        a factor changed.

        ``most_entries`` (needed with ranks): the most (option, bucket) pairs a rank can have measured
        since the last agreement, the same number on every rank (the micro-batches it measured times the
        options a layer may take); it sizes the gathered buffer, so one collective does."""
        mine = sorted((key, (s.weighted_log_ratio, s.weight)) for key, s in self._pending.items())
        self._pending.clear()
        if not (dist.is_available() and dist.is_initialized()):
            return self._update([mine])
        if most_entries is None or most_entries < 0:
            raise ValueError(
                "TimeCorrections.agree across ranks needs most_entries: the most (option, bucket) pairs a rank "
                f"measured since the last agreement, the same on every rank; got {most_entries!r}"
            )
        return self._update(_gather_entries(mine, most_entries, group))

    def _update(self, per_rank: Iterable[list]) -> bool:
        totals: dict[tuple[str, int], _Sums] = {}
        for entries in per_rank:  # rank order, then key order: the same sums on every rank
            for key, (weighted_log_ratio, weight) in entries:
                sums = totals.setdefault(tuple(key), _Sums())
                sums.weighted_log_ratio += weighted_log_ratio
                sums.weight += weight
        # each factor moves from the value the predictions used (a fallback for a key measured first now)
        current = {key: self._log(*key) for key in sorted(totals) if totals[key].weight > 0}
        for key, log_factor in current.items():
            step = totals[key].weighted_log_ratio / (totals[key].weight + self.prior)
            self._log_factor[key] = min(max(log_factor + step, -_LOG_LIMIT), _LOG_LIMIT)
        changed = bool(current)
        if changed:
            self.version += 1
        return changed

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The agreed factors (pending measurements are not kept: a checkpoint is taken between updates)."""
        return {
            "prior": self.prior,
            "log_factors": [[option, bucket, value] for (option, bucket), value in sorted(self._log_factor.items())],
        }

    def load_state_dict(self, state: dict) -> None:
        try:
            factors = {(str(o), int(b)): float(v) for o, b, v in state["log_factors"]}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"time corrections: expected {{'log_factors': [[option, bucket, log], ...]}}: {e}") from e
        self._log_factor = factors
        self._pending.clear()
        self.version += 1

    def summary(self) -> str:
        """One line per option: its factors by bucket, for logs."""
        by_option: dict[str, list[str]] = {}
        for (option, bucket), value in sorted(self._log_factor.items()):
            by_option.setdefault(option, []).append(f"{bucket}:{math.exp(value):.3g}")
        return "; ".join(f"{option} x[{', '.join(items)}]" for option, items in by_option.items()) or "none"


_ENTRY = np.dtype([("option", "S64"), ("bucket", "<i8"), ("weighted_log_ratio", "<f8"), ("weight", "<f8")])
"""One rank's pending sums for one (option, bucket), as gathered: the floats travel bit for bit."""


def _gather_entries(mine: list, most_entries: int, group) -> list[list]:
    """Every rank's ``mine`` (sorted ``((option, bucket), (weighted_log_ratio, weight))``), in rank order,
    through one all-gather of ``most_entries + 1`` fixed-size rows per rank. The first row says how many
    entries follow and whether an option's name did not fit, so that a rank over either limit makes every
    rank raise the same error after the collective, instead of leaving the others waiting in it."""
    rows = np.zeros(most_entries + 1, dtype=_ENTRY)
    names = [option.encode() for (option, _), _ in mine]
    too_long = any(len(name) > _ENTRY["option"].itemsize for name in names)
    rows[0]["bucket"], rows[0]["weight"] = len(mine), float(too_long)
    for row, name, ((_, bucket), sums) in zip(rows[1:], names, mine):
        row["option"], row["bucket"] = name, bucket
        row["weighted_log_ratio"], row["weight"] = sums
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    local = torch.from_numpy(rows.view(np.uint8)).to(device or "cpu")
    gathered = torch.empty(dist.get_world_size(group) * local.numel(), dtype=torch.uint8, device=local.device)
    all_gather_single(gathered, local, group=group)
    per_rank = gathered.cpu().numpy().view(_ENTRY).reshape(-1, most_entries + 1)
    problems = [
        f"rank {rank} measured {int(head['bucket'])} (option, bucket) pairs, more than most_entries={most_entries}"
        for rank, head in enumerate(per_rank[:, 0])
        if head["bucket"] > most_entries
    ] + [
        f"rank {rank} measured an option whose name is over {_ENTRY['option'].itemsize} bytes"
        for rank, head in enumerate(per_rank[:, 0])
        if head["weight"]
    ]
    if problems:
        raise ValueError("time corrections: the ranks cannot agree: " + "; ".join(problems))
    return [
        [
            ((row["option"].decode(), int(row["bucket"])), (float(row["weighted_log_ratio"]), float(row["weight"])))
            for row in entries[1 : 1 + int(entries[0]["bucket"])]
        ]
        for entries in per_rank
    ]


def _nearest(buckets: set[int], bucket: int) -> int:
    """The bucket of ``buckets`` nearest to ``bucket`` by length ratio (the shorter on a tie)."""
    return min(buckets, key=lambda b: (abs(math.log(b / bucket)), b))


class CorrectedCostModel:
    """A cost model whose layer times are ``base``'s times the corrections; memory is ``base``'s.

    The planner evaluates costs at a bucket's upper edge (``layout.padded_len``): the key of the factor
    (a micro-batch's own time: :meth:`~megatron_paradyse.planner.Planner.predicted_time_s`).
    Every agreement that moves a factor makes the planner plan again; ``base``'s costs do not move, so
    the last ``cache_size`` of them are kept and re-planning only multiplies.
    """

    def __init__(self, base: CostModel, corrections: TimeCorrections, cache_size: int = 1 << 16) -> None:
        self.base = base
        self.corrections = corrections
        self._base_costs: collections.OrderedDict[tuple, LayerCost] = collections.OrderedDict()
        self._cache_size = cache_size

    def layer_cost(self, option: LayerOption, layout: SequenceLayout, micro_batch_size: int) -> LayerCost:
        cost = self._base_cost(option, layout, micro_batch_size)
        factor = self.corrections.factor(option, layout.padded_len)
        return dataclasses.replace(cost, time_s=cost.time_s * factor)

    def _base_cost(self, option: LayerOption, layout: SequenceLayout, micro_batch_size: int) -> LayerCost:
        key = (option, layout.value, micro_batch_size)
        cost = self._base_costs.get(key)
        if cost is None:
            cost = self._base_costs[key] = self.base.layer_cost(option, layout, micro_batch_size)
            if len(self._base_costs) > self._cache_size:
                self._base_costs.popitem(last=False)
        else:
            self._base_costs.move_to_end(key)
        return cost

    def peak_bytes(
        self,
        layout: SequenceLayout,
        micro_batch_size: int,
        saved_bytes: float,
        transient_bytes: float,
        stage: StageOptions = WHOLE_LOSS,
    ) -> float:
        return self.base.peak_bytes(layout, micro_batch_size, saved_bytes, transient_bytes, stage)

    def held_bytes(
        self, layout: SequenceLayout, micro_batch_size: int, saved_bytes: float, stage: StageOptions = WHOLE_LOSS
    ) -> float:
        return self.base.held_bytes(layout, micro_batch_size, saved_bytes, stage)

    def option_times(self, plan: Plan, layout: SequenceLayout, micro_batch_size: int) -> dict[str, float]:
        """The uncorrected time of one layer of each option of ``plan`` at ``layout``."""
        return {str(o): self._base_cost(o, layout, micro_batch_size).time_s for o in set(plan)}

    def __getattr__(self, name: str):
        return getattr(self.base, name)  # the rest of the base model's interface (shape, profile, ...)
