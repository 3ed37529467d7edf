"""A job's start-up calibration (no ``cost.profile``): each tensor-parallel group of the job measures
itself in the job's own processes, its fitted correction timed on layers of Megatron's linear modules,
and every rank plans from rank 0's profile; a group that cannot calibrate stops every rank with its
reason. In bf16 and fp16 here; fp32 in the entry point's and the drop-in spec's tests."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatron_paradyse.calibration import calibrate as calibration
from megatron_paradyse.calibration import fit, samples, startup
from megatron_paradyse.calibration import grid as grids
from megatron_paradyse.core.memory import PeakMemory
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.cost.profile import load_profile

from helpers.cost_profiles import CALIBRATED_LAYER, TINY_GRID


def _refuse_to_start_processes(*args, **kwargs):
    raise AssertionError("calibration started processes of its own")


class _OutOfMemoryFrom256Tokens:
    """An attention kernel on a device too full for blocks of 256 tokens or more."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.name = kernel.name

    def forward(self, q, *args):
        if q.shape[-2] >= 256:
            raise RuntimeError("out of memory")
        return self.kernel.forward(q, *args)

    def backward(self, *args):
        return self.kernel.backward(*args)


class _CountedMeterWindows(PeakMemory):
    entered = 0

    def __enter__(self):
        type(self).entered += 1
        return super().__enter__()


def _startup_on_tp_groups(rank: int, world: int, cache_dir: str, failing_ranks: tuple[int, ...], dtype: str):
    """Rank ``rank`` of a job of 4 ranks in tensor-parallel pairs, calibrating at start-up: measured the
    first time (in these processes: starting any fails), then for a job that meters its micro-batches'
    memory (the meter's windows counted), then read from the cache. On ``failing_ranks``, attention runs
    out of memory partway through the samples."""
    import torch.distributed as dist

    from megatron_paradyse.calibration import measure
    from megatron_paradyse.cost.profile import ProfileError

    grids.GRIDS["quick"] = TINY_GRID
    calibration.run_on_ranks = _refuse_to_start_processes
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp_group = pairs[rank // 2]
    if rank in failing_ranks:
        get_kernel = samples.get_kernel
        samples.get_kernel = lambda *args: _OutOfMemoryFrom256Tokens(get_kernel(*args))

    def profile(metered: bool = False) -> dict:
        return startup.startup_profile(
            cache_dir,
            tp_group,
            dist.group.WORLD,
            device=torch.device("cpu"),
            dtype=getattr(torch, dtype),
            shape=CALIBRATED_LAYER,
            longest=256,
            metered=metered,
        )

    try:
        first = profile()
    except ProfileError as e:
        return str(e)
    measure.PeakMemory = _CountedMeterWindows
    metered = profile(metered=True)
    calibration.measure_samples = _refuse_to_start_processes  # the last run measures nothing
    return first, profile(), metered, _CountedMeterWindows.entered


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])  # float32: the entry point's and drop-in's tests
def test_a_job_calibrates_on_its_own_tensor_parallel_groups_and_every_rank_plans_from_rank_0s(tmp_path, dtype):
    """No cost.profile: each TP group of the job measures itself, no process is started, all ranks get
    rank 0's profile (TP=2 shapes, the model's own work, the job's dtype), which a later start reads from
    the cache. A job that meters each micro-batch's memory (``log.measure``) on CPU, where the meter slows
    the work it watches, has the correction's layers timed under the meter, in a profile cached apart."""
    per_rank = run_on_ranks(_startup_on_tp_groups, 4, args=(str(tmp_path), (), dtype), timeout_s=300)
    measured, cached, metered, windows = zip(*per_rank)
    assert all(p == measured[0] for p in measured) and all(p == cached[0] for p in cached)
    assert all(p == metered[0] for p in metered)
    saved = tmp_path / f"cost-profile-quick-corrected-cpu-p2-{dtype}-model{grids.model_key(CALIBRATED_LAYER)}.json"
    assert cached[0] == load_profile(saved, p=2)
    written = {"schema", "version", "created"}
    assert {k: v for k, v in cached[0].items() if k not in written} == json.loads(json.dumps(measured[0]))
    saved_metered = load_profile(saved.with_name(f"{saved.stem}-metered.json"), p=2)
    assert {k: v for k, v in saved_metered.items() if k not in written} == json.loads(json.dumps(metered[0]))
    # every timed run of every correction layer at every length, on each rank: a window of the meter
    lengths = grids.model_grid(TINY_GRID, CALIBRATED_LAYER, 2, 256, "cpu").correction_lengths
    assert windows == (len(grids.correction_layers()) * len(lengths) * 3,) * 4
    assert (measured[0]["correction"]["metered"], metered[0]["correction"]["metered"]) == (False, True)
    profile = measured[0]
    assert (
        profile["dtype"] == dtype
        and profile["concurrency"] == 2
        and profile["model"]
        == {
            "shape": dataclasses.asdict(CALIBRATED_LAYER),
            "p": 2,
            "longest": 256,
        }
    )
    assert set(profile["collectives"]) == {"2"} and profile["correction"]["compute"] >= fit.MIN_SCALE
    grid = grids.model_grid(TINY_GRID, CALIBRATED_LAYER, 2, 256, "cpu")
    assert [(g["m"], g["n"], g["k"]) for g in profile["samples"]["gemm"]] == samples.gemm_shapes(grid)


@pytest.mark.parametrize(
    "failing_ranks, reasons",
    [
        ((2, 3), "rank 2: out of memory; rank 3: out of memory"),
        # rank 2 would wait for rank 3 in the sample's first collective until the group's timeout
        ((3,), "rank 2: rank 3 could not run a calibration sample; rank 3: out of memory"),
    ],
    ids=["both-ranks", "one-rank-partway"],
)
def test_a_tensor_parallel_group_that_cannot_calibrate_stops_every_rank_with_its_reason(
    tmp_path, failing_ranks, reasons
):
    per_rank = run_on_ranks(_startup_on_tp_groups, 4, args=(str(tmp_path), failing_ranks, "bfloat16"), timeout_s=300)
    assert (
        per_rank
        == [
            f"could not calibrate a cost profile ({reasons}); make one with `paradyse calibrate --p 2` and name it "
            "in cost.profile"
        ]
        * 4
    )
    assert not list(tmp_path.glob("*.json"))
