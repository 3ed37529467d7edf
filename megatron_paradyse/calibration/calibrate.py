"""``paradyse calibrate``: measure this machine's kernels and links, fit them, return a profile.

Everything runs on ``p`` real ranks at once (gloo on CPU, NCCL on CUDA), because that is how a
layer runs: on a CPU shared by the ranks, a kernel timed alone is ~p/cores times faster than inside
the job. :func:`calibrate` starts the ranks; :func:`calibrate_on_group` runs in ranks that exist (a
job's tensor-parallel group at start-up, :func:`startup_profile`; or one process standing for rank 0 of
a fake group on one GPU, its collectives taken from another profile). Measured:

- GEMMs (``F.linear`` forward and backward) over a grid of shapes, fitted as
  ``c0 + c1 * FLOPs + c2 * bytes``;
- the attention kernel, causal and full, square and rectangular blocks, forward and backward: a
  per-call overhead and the time per (visible pair x head dim) at each block length;
- memory-bound elementwise work (bytes/s and per-op overhead);
- every collective the strategies use, for each requested group size, over message sizes, fitted as
  ``latency + bytes * per_byte``;
- how much of a ring hop hides behind a kernel running at the same time;
- optionally (``fit_correction``) a few whole layers, to fit the correction of DESIGN §4.

Given the model (``shape``, ``longest``: its layer and longest micro-batch), the grid also measures
that model's own work (:func:`model_grid`): every GEMM the strategies' cost terms run for its layer
at ``p`` ranks, at token counts up to the longest micro-batch, and its attention at its head dim up
to that length. The generic grid alone stops at 4096x3072x1024 GEMMs and 8K-token blocks: on an H200
its GEMMs are all launch overhead, the fit found no time per FLOP, and a 64K-token micro-batch of
four Llama-3-8B layers was predicted at 11.2 s against 2.7 s measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_paradyse.attention import get_kernel
from megatron_paradyse.calibration.fit import fit_profile, fitted_correction
from megatron_paradyse.calibration.grid import REFERENCE_SHAPE, Grid, correction_layers, named_grid
from megatron_paradyse.calibration.samples import measure_samples
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.cost.profile import fingerprint
from megatron_paradyse.strategies import ModelShape

__all__ = ["calibrate", "calibrate_on_group"]


def _rank_device(rank: int, device_type: str) -> torch.device:
    """This rank's device: its own GPU (set as current, as NCCL wants), or the CPU."""
    if device_type != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    return device


def _measure_on_rank(rank: int, world: int, grid: Grid, p_values, device_type: str, dtype_name: str, show: bool):
    device = _rank_device(rank, device_type)
    link_groups = {p: dist.new_group(list(range(p))) for p in p_values}  # every rank makes every group
    samples = measure_samples(
        dist.group.WORLD, grid, link_groups, device, getattr(torch, dtype_name), show and rank == 0
    )
    return samples if rank == 0 else None


def calibrate(
    p_values: Sequence[int] = (4,),
    *,
    device: str = "cpu",
    grid: str = "quick",
    dtype: torch.dtype = torch.float32,
    fit_correction: bool = False,
    show_progress: bool = True,
    timeout_s: float = 1800.0,
    shape: ModelShape | None = None,
    longest: int | None = None,
) -> dict[str, Any]:
    """Measure and fit on ``max(p_values)`` ranks started for it; returns the profile (see
    :mod:`cost.profile`). With ``shape`` and ``longest``, the grid has that model's own work at
    ``max(p_values)`` ranks too (:func:`model_grid`). A job's ranks calibrate on themselves with
    :func:`calibrate_on_group`."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    p_values = sorted({int(p) for p in p_values})
    if not p_values or p_values[0] < 1:
        raise ValueError(f"group sizes must be >= 1, got {p_values}")
    world = max(p_values)
    measured = named_grid(grid, shape, world, longest, device)
    if device == "cuda" and world > torch.cuda.device_count():
        raise ValueError(
            f"calibrating p={world} on CUDA needs {world} GPUs (one per rank), this machine has "
            f"{torch.cuda.device_count()}"
        )
    backend = "nccl" if device == "cuda" else "gloo"
    dtype_name = str(dtype).removeprefix("torch.")
    samples = run_on_ranks(
        _measure_on_rank,
        world,
        args=(measured, [p for p in p_values if p > 1], device, dtype_name, show_progress),
        timeout_s=timeout_s,
        backend=backend,
    )[0]
    profile = _profile_of(samples, grid, device, dtype, world, shape, longest)
    if fit_correction:
        layers = REFERENCE_SHAPE if shape is None else shape
        times = run_on_ranks(
            _correction_layers_on_rank,
            world,
            args=(layers, measured.correction_lengths, device, dtype_name),
            timeout_s=timeout_s,
            backend=backend,
        )[0]
        profile["correction"] = fitted_correction(profile, times, world, dtype, layers)
    return profile


def calibrate_on_group(
    group,
    *,
    device: torch.device,
    dtype: torch.dtype,
    grid: str = "quick",
    fit_correction: bool = True,
    shape: ModelShape | None = None,
    longest: int | None = None,
    links: dict[str, Any] | None = None,
    show_progress: bool = False,
    metered: bool = False,
) -> dict[str, Any]:
    """:func:`calibrate` in the processes of ``group``, which all call it (a collective over it); returns
    its first rank's profile on every rank.

    It starts no process: a job's tensor-parallel group measures itself at start-up, on the GPUs and the
    links it trains on, beside what it already holds. A process alone in a fake group of ``p``
    (:func:`~megatron_paradyse.mcore.trace.fake_world`) measures one rank's compute at ``p`` ranks' shapes
    on one GPU. A fake group's collectives move nothing in no time, so it needs ``links``: a profile with
    collectives for ``group.size()`` (calibrated on the real cluster, or a published node's,
    :func:`~megatron_paradyse.cost.hardware.hardware_profile`), whose collectives and ring overlap the
    profile takes instead of measuring them; its correction is then fitted on the compute terms alone.
    ``metered``: the correction's layers timed under the memory meter, as a job with ``log.measure`` runs
    its layers (where the meter slows them, :meth:`~megatron_paradyse.core.memory.PeakMemory.slows_work`,
    the correction takes its cost in).
    """
    p = group.size()
    if links is not None and p > 1 and str(p) not in links.get("collectives", {}):
        raise ValueError(
            f"the links profile has no collectives for p={p} (it has p in "
            f"{sorted(links.get('collectives', {}), key=int)}); calibrate them on the cluster with `paradyse "
            f"calibrate --p {p}`"
        )
    measured = named_grid(grid, shape, p, longest, device.type)
    link_groups = {} if links is not None or p == 1 else {p: group}
    first = dist.get_rank(group) == 0
    # the job's RNG untouched; gradients on even inside a recomputed forward (a drop-in layer's first call)
    rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
    with rng, torch.enable_grad():
        samples = measure_samples(group, measured, link_groups, device, dtype, show_progress and first)
        profile = _profile_of(samples, grid, device.type, dtype, p, shape, longest)
        if links is not None:
            profile["collectives"] = {str(p): links["collectives"][str(p)]} if p > 1 else {}
            profile["ring_overlap"] = links["ring_overlap"]
            profile["links"] = {"fingerprint": links["fingerprint"], "grid": links["grid"]}
        if fit_correction:
            layers = REFERENCE_SHAPE if shape is None else shape
            times = _correction_layers(group, layers, measured.correction_lengths, device, dtype, metered=metered)
            profile["correction"] = fitted_correction(
                profile, times, p, dtype, layers, comm_measured=links is None, metered=metered
            )
    if device.type == "cuda":  # the job's allocator starts from its own blocks, not the samples'
        torch.cuda.empty_cache()
    message = [profile]
    dist.broadcast_object_list(message, group_src=0, group=group)
    return message[0]


def _profile_of(
    samples: dict[str, Any],
    grid: str,
    device: str,
    dtype: torch.dtype,
    concurrency: int,
    shape: ModelShape | None,
    longest: int | None,
) -> dict[str, Any]:
    """The profile of ``samples`` measured by ``concurrency`` ranks at once, without its correction."""
    profile = {
        "grid": grid,
        "fingerprint": fingerprint(device),
        "dtype": str(dtype).removeprefix("torch."),
        "concurrency": concurrency,
        "attention": {"kernel": get_kernel("auto", torch.device(device), dtype).name},
        # the CUDA caching allocator rounds and fragments; the CPU tracker counts tensor bytes exactly,
        # but gloo's worker thread frees finished collectives' buffers when it gets the GIL, and the
        # model's small tensors outside the terms (RoPE's temporaries, norms' gradients) add up
        "allocator_slack": 0.05,
        "correction": None,
        "model": None if shape is None else {"shape": dataclasses.asdict(shape), "p": concurrency, "longest": longest},
        "samples": samples,
    }
    fitted = fit_profile(samples, torch.empty((), dtype=dtype).element_size())
    profile["attention"].update(fitted.pop("attention"))
    profile.update(fitted)
    return profile


def _correction_layers(
    group, shape: ModelShape, lengths, device: torch.device, dtype: torch.dtype, *, metered: bool = False
):
    """``(option, tokens, seconds)`` of each correction layer at each length, on ``group`` (a collective)."""
    from megatron_paradyse.calibration.measure import measure_layer  # megatron-core: only to fit the correction

    p = group.size()
    out = []
    for s in lengths:
        layout = SequenceLayout.build(s, p, causal=True)
        for option in correction_layers():
            m = measure_layer(option, layout, shape, group, dtype=dtype, device=device, memory_runs=0, metered=metered)
            out.append((str(option), s, m.time_s))
    return out


def _correction_layers_on_rank(rank: int, world: int, shape: ModelShape, lengths, device_type: str, dtype_name: str):
    device = _rank_device(rank, device_type)
    return _correction_layers(dist.group.WORLD, shape, lengths, device, getattr(torch, dtype_name))
