"""Small least-squares fits shared by calibration and the cost models."""

from __future__ import annotations

import numpy as np

__all__ = ["fit_nonnegative", "mape"]


def fit_nonnegative(features: np.ndarray, target: np.ndarray, floor=None) -> np.ndarray:
    """Coefficients ``c >= floor`` (default 0) minimising the *relative* error of ``features @ c``
    against ``target``.

    Rows are divided by their target (times span orders of magnitude), then an active-set loop drops
    the most negative coefficient (above its floor) and refits until none is below.
    """
    features = np.asarray(features, dtype=np.float64)
    target = np.asarray(target, dtype=np.float64)
    if features.ndim != 2 or features.shape[0] != target.shape[0] or features.shape[0] == 0:
        raise ValueError(f"need a [n, k] feature matrix and n targets, got {features.shape} and {target.shape}")
    floor = np.zeros(features.shape[1]) if floor is None else np.asarray(floor, dtype=np.float64)
    weights = 1.0 / np.maximum(target, 1e-12)
    scaled, rhs = features * weights[:, None], (target - features @ floor) * weights
    active = list(range(features.shape[1]))
    coef = np.zeros(features.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(scaled[:, active], rhs, rcond=None)
        if (solution >= 0).all():
            coef[active] = solution
            break
        del active[int(np.argmin(solution))]
    return coef + floor


def mape(predicted, measured) -> float:
    """Mean absolute percentage error, in percent."""
    predicted, measured = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    return float(np.mean(np.abs(predicted - measured) / np.abs(measured)) * 100.0)
