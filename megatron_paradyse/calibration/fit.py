"""A profile's rates fitted on its raw samples (:func:`fit_profile`), and the correction fitted on whole
layers measured against the cost model's terms (:func:`fitted_correction`, DESIGN §4)."""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.analytic import AnalyticCostModel
from megatron_paradyse.cost.fitting import fit_nonnegative
from megatron_paradyse.strategies import ModelShape
from megatron_paradyse.strategies.terms import AttentionCall

__all__ = ["MIN_SCALE", "fit_profile", "fitted_correction"]


MIN_SCALE = 0.5
"""Smallest correction scale of the compute and communication terms."""


def fit_profile(samples: dict[str, Any], element_size: int) -> dict[str, Any]:
    """The fitted parameters of a profile from raw samples."""
    gemm = samples["gemm"]
    gemm_features = np.array(
        [
            [1.0, 2.0 * g["m"] * g["n"] * g["k"], element_size * (g["m"] * g["k"] + g["n"] * g["k"] + g["m"] * g["n"])]
            for g in gemm
        ]
    )
    fitted: dict[str, Any] = {
        "gemm": {
            d: {
                "coef": fit_nonnegative(gemm_features, [g[f"{d}_s"] for g in gemm]).tolist(),
                "by_shape": _gemm_rates(gemm, f"{d}_s"),
            }
            for d in ("forward", "backward")
        },
        "attention": {"forward": {}, "backward": {}},
    }
    for causal, mask in ((True, "causal"), (False, "full")):
        rows = [a for a in samples["attention"] if a["causal"] == causal]
        for d in ("forward", "backward"):
            fitted["attention"][d][mask] = _fit_attention(rows, f"{d}_s")
    ew = samples["elementwise"]
    c0, c1 = fit_nonnegative(np.array([[1.0, e["bytes"]] for e in ew]), [e["seconds"] for e in ew])
    fitted["elementwise"] = {"per_op_s": float(c0), "per_byte_s": float(c1)}
    fitted["collectives"] = {}
    for p, kinds in samples["collectives"].items():
        fitted["collectives"][p] = {}
        for kind, points in kinds.items():
            latency, per_byte = fit_nonnegative(np.array([[1.0, b] for b, _ in points]), [s for _, s in points])
            fitted["collectives"][p][kind] = {"latency_s": float(latency), "per_byte_s": float(per_byte)}
    fitted["ring_overlap"] = samples["ring_overlap"]
    if "host_link" in samples:  # profiles calibrated before offload have none
        link = samples["host_link"]
        sizes, seconds = zip(*link["points"])
        latency, per_byte = fit_nonnegative(np.array([[1.0, b] for b in sizes]), list(seconds))
        fitted["host_link"] = {"latency_s": float(latency), "per_byte_s": float(per_byte), "overlap": link["overlap"]}
    return fitted


def _gemm_rates(samples: list[dict], key: str) -> dict[str, dict[str, list[float]]]:
    """Per measured ``(n, k)`` (key ``"<n>x<k>"``), the seconds per FLOP at each measured ``m``. On a GPU
    a GEMM's efficiency changes with its shape, and not linearly: on an H200 the linear fit over a
    Llama-3-8B layer's own GEMMs priced them at 820 TFLOP/s, where they ran at 645 to 801; a shape that
    was measured is interpolated (:meth:`~megatron_paradyse.cost.pricing.TermPrices.gemm`), the fit
    prices the others."""
    rates: dict[str, dict[int, list[float]]] = {}
    for g in samples:
        flops = 2 * g["m"] * g["n"] * g["k"]
        rates.setdefault(f"{g['n']}x{g['k']}", {}).setdefault(g["m"], []).append(g[key] / flops)
    return {
        shape: {"m": sorted(by_m), "per_flop_s": [float(np.mean(by_m[m])) for m in sorted(by_m)]}
        for shape, by_m in sorted(rates.items())
    }


def _fit_attention(rows: list[dict], key: str) -> dict[str, Any]:
    """Per-call overhead, and per head dim the time per (pair x head dim) at each measured block
    length: the rate changes with the length (how far K/V outgrow the caches) and the head dim (how
    much work each loaded row carries), so it is interpolated, not fitted."""
    calls = [AttentionCall(1, a["heads"], a["sq"], a["sk"], a["hn"], a["causal"]) for a in rows]
    units = np.array([c.flops / 4 for c in calls])
    seconds = np.array([a[key] for a in rows])
    per_call = fit_nonnegative(np.stack([np.ones_like(units), units], axis=1), seconds)[0]
    rates: dict[int, dict[float, list[float]]] = {}
    for call, unit, t in zip(calls, units, seconds):
        rates.setdefault(call.hn, {}).setdefault(call.length, []).append(max(t - per_call, 0.1 * t) / unit)
    return {
        "per_call_s": float(per_call),
        "by_head_dim": {
            str(hn): {
                "lengths": sorted(by_length),
                "per_unit_s": [float(np.mean(by_length[g])) for g in sorted(by_length)],
            }
            for hn, by_length in sorted(rates.items())
        },
    }


def fitted_correction(
    profile, measured, p: int, dtype, shape: ModelShape, *, comm_measured: bool = True, metered: bool = False
) -> dict:
    """Fit ``time = k_compute * compute + k_comm * comm + per_sync_s * syncs + per_layer_s`` on the
    ``measured`` layers of ``shape`` at ``p`` ranks (``syncs``: collectives and ring hops, each a point
    where ranks wait for each other: on an oversubscribed CPU a rank that arrives early waits for the
    scheduler to run the rest). Where the layers' collectives took no time (``comm_measured=False``:
    a fake group), on the compute terms alone: ``k_comm`` 1, no time per synchronisation. ``metered``:
    the layers were timed under the memory meter (recorded, so that a profile says what its times hold)."""
    model = AnalyticCostModel(profile, shape, p, dtype=dtype, use_correction=False)
    features, target = [], []
    for option, s, seconds in measured:
        b = model.time_breakdown(LayerOption.parse(option), SequenceLayout.build(s, p, causal=True), 1)
        features.append([b.compute_s, b.comm_s, b.syncs, 1.0])
        target.append(seconds)
    features, target = np.array(features), np.array(target)
    # The scales may stretch the calibrated terms, not delete them: a noisy fit on few layers must not
    # leave a model in which longer sequences cost nothing more.
    if comm_measured:
        k_compute, k_comm, per_sync, per_layer = fit_nonnegative(features, target, floor=[MIN_SCALE, MIN_SCALE, 0, 0])
    else:  # the layers' collectives took no time: nothing to fit their terms on
        k_compute, per_layer = fit_nonnegative(features[:, [0, 3]], target, floor=[MIN_SCALE, 0])
        k_comm, per_sync = 1.0, 0.0
    return {
        "compute": float(k_compute),
        "comm": float(k_comm),
        "per_sync_s": float(per_sync),
        "per_layer_s": float(per_layer),
        "fitted_on": [f"{option}@{s}" for option, s, _ in measured],
        "metered": metered,
    }
