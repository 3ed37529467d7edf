"""A job without ``cost.profile``: the quick profile with its correction fitted on the model's own layers,
calibrated at start-up on the job's own ranks (:func:`startup_profile`) or in ranks started for it
(:func:`cached_quick_profile`), and cached for the next run."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_paradyse.calibration.calibrate import calibrate, calibrate_on_group
from megatron_paradyse.calibration.grid import model_key
from megatron_paradyse.core.memory import PeakMemory
from megatron_paradyse.cost.profile import ProfileError, load_profile, save_profile
from megatron_paradyse.strategies import ModelShape

__all__ = ["cached_quick_profile", "startup_profile"]


def _cache_path(
    cache_dir, p: int, device: str, dtype: torch.dtype, shape: ModelShape | None, *, metered: bool = False
) -> Path:
    name = str(dtype).removeprefix("torch.")
    model = "" if shape is None else f"-model{model_key(shape)}"
    meter = "-metered" if metered else ""
    return Path(cache_dir) / f"cost-profile-quick-corrected-{device}-p{p}-{name}{model}{meter}.json"


def _cached(path: Path, p: int, longest: int | None) -> dict[str, Any] | None:
    """The profile an earlier run saved at ``path``, if it serves a longest micro-batch of ``longest``
    tokens (it measured as many or more), else None. A profile calibrated before offload, or before its
    GEMM shapes had their own rates (and a GPU's attention samples the model's heads), is made again: a
    cache is this module's, and what it measures better should not wait for someone to delete it."""
    try:
        profile = load_profile(path, p=p, host_link=True)
    except ProfileError:
        return None
    if "by_shape" not in profile["gemm"]["forward"]:
        return None
    if longest is None or profile.get("model") and profile["model"]["longest"] >= longest:
        print(f"paradyse: no cost.profile: using the quick profile calibrated before, {path}", flush=True)
        return profile
    return None


def cached_quick_profile(
    cache_dir: str | os.PathLike,
    p: int,
    *,
    device: str,
    dtype: torch.dtype,
    shape: ModelShape | None = None,
    longest: int | None = None,
) -> dict[str, Any]:
    """The quick profile with its correction fitted on measured layers, for ``p`` ranks on ``device`` in
    ``dtype`` (with ``shape`` and ``longest``: measuring that model's own work too, :func:`model_grid`):
    the one an earlier run saved in ``cache_dir`` (for the same model, up to ``longest`` tokens or more),
    else calibrated now on ``p`` ranks started for it (a minute or two on a CPU) and saved there. For a
    process outside any group (the benchmarks); a job's ranks use :func:`startup_profile`."""
    path = _cache_path(cache_dir, p, device, dtype, shape)
    profile = _cached(path, p, longest)
    if profile is not None:
        return profile
    print(f"paradyse: no cost.profile: calibrating a quick profile for p={p} into {path} ...", flush=True)
    start = time.perf_counter()
    profile = calibrate(
        [p],
        device=device,
        grid="quick",
        dtype=dtype,
        fit_correction=True,
        show_progress=False,
        shape=shape,
        longest=longest,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, path)
    print(f"paradyse: calibrated in {time.perf_counter() - start:.0f} s", flush=True)
    return profile


def startup_profile(
    cache_dir: str | os.PathLike,
    measure_group,
    share_group,
    *,
    device: torch.device,
    dtype: torch.dtype,
    shape: ModelShape,
    longest: int,
    metered: bool = False,
) -> dict[str, Any]:
    """A job without ``cost.profile``: the quick profile with its correction fitted on the model's own
    layers, the same on every rank of ``share_group`` (a collective over it, made of whole
    ``measure_group`` s: the job's tensor-parallel groups). ``metered``: the job measures every
    micro-batch's peak (``log.measure``); where that slows its layers (the CPU's meter), the correction is
    fitted on layers timed under the same meter, so that the times predicted are the job's, and the profile
    is cached apart from an unmetered job's.

    The first rank of ``share_group`` reads the one an earlier run saved in ``cache_dir`` (this layer at
    this group size, up to ``longest`` tokens or more). Else each ``measure_group`` calibrates on itself
    at once (:func:`calibrate_on_group`: the job's own processes, GPUs and links; no process started),
    and the first rank saves its group's profile there and sends it to all. A failure on any rank
    raises on every rank."""
    p = measure_group.size()
    metered = metered and PeakMemory.slows_work(device)
    path = _cache_path(cache_dir, p, device.type, dtype, shape, metered=metered)
    first = dist.get_rank(share_group) == 0
    message: list = [_cached(path, p, longest) if first else None]
    dist.broadcast_object_list(message, group_src=0, group=share_group)
    if message[0] is not None:
        return message[0]
    if first:
        print(
            f"paradyse: no cost.profile: calibrating a quick profile for p={p} on the job's ranks into {path} ...",
            flush=True,
        )
    start = time.perf_counter()
    profile, error = None, None
    try:
        profile = calibrate_on_group(
            measure_group, device=device, dtype=dtype, shape=shape, longest=longest, metered=metered
        )
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, not wait in the next collective
        error = f"rank {dist.get_rank()}: {e}"
    errors: list = [None] * share_group.size()
    dist.all_gather_object(errors, error, group=share_group)
    failed = [e for e in errors if e]
    message = [ProfileError(f"could not calibrate a cost profile ({'; '.join(failed)})") if failed else profile]
    if first and not failed:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_profile(profile, path)
            print(f"paradyse: calibrated in {time.perf_counter() - start:.0f} s", flush=True)
        except OSError as e:
            message[0] = ProfileError(f"could not save the calibrated cost profile to {path} ({e})")
    dist.broadcast_object_list(message, group_src=0, group=share_group)
    if isinstance(message[0], Exception):
        raise ProfileError(f"{message[0]}; make one with `paradyse calibrate --p {p}` and name it in cost.profile")
    return message[0]
