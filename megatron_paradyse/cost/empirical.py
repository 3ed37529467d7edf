"""The paper's empirical cost model (ParaDySe Eq. 9), kept for comparison with the calibrated one.

Per layer option and target (time, saved bytes, peak bytes), fitted on measured runs with the
sequence length as the only input:

    f(s) = RandomForest(s)   if s <= max(measured s)   (50 trees, depth 10, seed 42, as the paper)
           Polynomial(s)     beyond it                  (degree 1..3, the lowest AIC)

It knows nothing of FLOPs or links: it interpolates what it was shown, and its extrapolation is a
polynomial through the measured points. Needs scikit-learn (imported when fitting).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.base import WHOLE_LOSS, LayerCost, StageOptions

__all__ = ["EmpiricalCostModel", "HybridRegressor", "Sample", "aic_polynomial"]


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """One measured layer: option, padded length, time and memory."""

    option: LayerOption
    length: int
    time_s: float
    saved_bytes: float
    peak_bytes: float


def aic_polynomial(x: Sequence[float], y: Sequence[float], max_degree: int = 3) -> np.ndarray:
    """``numpy.polyfit`` coefficients of the degree in ``1..max_degree`` with the lowest AIC,
    ``n ln(RSS/n) + 2(d+1)``; a degree needs at least ``d + 2`` points (an exact fit has no AIC)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    n = len(x)
    if n < 2:
        raise ValueError(f"a polynomial fit needs at least 2 points, got {n}")
    best, best_aic = np.polyfit(x, y, 1) if n == 2 else None, math.inf
    for degree in range(1, min(max_degree, n - 2) + 1):
        coef = np.polyfit(x, y, degree)
        rss = float(np.sum((np.polyval(coef, x) - y) ** 2))
        aic = n * math.log(max(rss, 1e-300) / n) + 2 * (degree + 1)
        if aic < best_aic:
            best, best_aic = coef, aic
    return best


class HybridRegressor:
    """One target of one option: random forest inside the measured lengths, AIC polynomial beyond."""

    def __init__(self, lengths: Sequence[int], values: Sequence[float]):
        from sklearn.ensemble import RandomForestRegressor

        x = np.asarray(lengths, dtype=np.float64)[:, None]
        self.max_length = float(x.max())
        self.forest = RandomForestRegressor(n_estimators=50, max_depth=10, random_state=42).fit(x, values)
        self.poly = aic_polynomial(x[:, 0], values)

    def __call__(self, length: int) -> float:
        if length <= self.max_length:
            return float(self.forest.predict(np.array([[float(length)]]))[0])
        return float(np.polyval(self.poly, float(length)))


class EmpiricalCostModel:
    """:class:`~megatron_paradyse.cost.base.CostModel` fitted on measured layers (no profile needed)."""

    def __init__(self, samples: Iterable[Sample], *, static_bytes: float = 0.0):
        by_option: dict[LayerOption, list[Sample]] = {}
        for sample in samples:
            by_option.setdefault(sample.option, []).append(sample)
        if not by_option:
            raise ValueError("the empirical cost model needs measured samples")
        self._fits = {}
        for option, rows in by_option.items():
            lengths = [r.length for r in rows]
            self._fits[option] = tuple(
                HybridRegressor(lengths, [getattr(r, target) for r in rows])
                for target in ("time_s", "saved_bytes", "peak_bytes")
            )
        self.static_bytes = static_bytes

    def layer_cost(self, option: LayerOption, layout: SequenceLayout, micro_batch_size: int) -> LayerCost:
        if option not in self._fits:
            raise ValueError(f"no measurements of {option}; measured: {', '.join(map(str, self._fits))}")
        time_fit, saved_fit, peak_fit = self._fits[option]
        s = layout.padded_len
        saved = saved_fit(s)
        return LayerCost(time_fit(s), saved, max(peak_fit(s) - saved, 0.0))

    def peak_bytes(
        self,
        layout: SequenceLayout,
        micro_batch_size: int,
        saved_bytes: float,
        transient_bytes: float,
        stage: StageOptions = WHOLE_LOSS,
    ) -> float:
        return self.static_bytes + saved_bytes + transient_bytes

    def stage_options(self, loss_chunk_tokens: int) -> tuple[StageOptions, ...]:
        """Only Megatron's own loss: the fitted whole-step measurements price nothing else."""
        return (WHOLE_LOSS,)

    def stage_time_s(self, layout: SequenceLayout, micro_batch_size: int, stage: StageOptions) -> float:
        return 0.0
