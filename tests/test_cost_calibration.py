"""`paradyse calibrate` end to end: it writes a profile the analytic model reads.

Times are not asserted here (the machine is shared); the run checks the pipeline and the profile.
The memory terms are checked against what the strategies allocate in ``tests/test_memory_scripts.py``.
"""

from __future__ import annotations

import time

import pytest

from megatron_paradyse.cli import main as cli_main
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost import calibrate as calibration
from megatron_paradyse.cost.analytic import AnalyticCostModel
from megatron_paradyse.cost.profile import load_profile
from megatron_paradyse.strategies import ModelShape

MHA = ModelShape(hidden_size=128, num_attention_heads=4, num_query_groups=4, kv_channels=32, ffn_hidden_size=512)
OPTIONS = [
    LayerOption(a, m, rc)
    for a, m in (("tp_sp", "tp_sp"), ("ulysses", "zero3"), ("ring", "zero3"), ("lean", "lean"), ("lean", "zero3"))
    for rc in (False, True)
]


TINY = calibration.Grid(
    gemm_m=(32, 256),
    gemm_nk=((128, 128), (384, 128)),
    attention_blocks=((64, 2), (256, 1)),
    attention_hn=(32,),
    attention_rect_max=64,
    comm_bytes=(4 << 10, 256 << 10),
    repeats=2,
    correction_lengths=(64, 128),
)


def test_calibrate_writes_a_profile_the_model_reads(tmp_path, monkeypatch, capfd):
    monkeypatch.setitem(calibration.GRIDS, "quick", TINY)
    path = tmp_path / "profile.json"
    assert cli_main(["calibrate", "--output", str(path), "--p", "2", "--grid", "quick", "--fit-correction"]) == 0
    assert "[##############################] 29/29" in capfd.readouterr().err  # rank 0's progress bar finished

    profile = load_profile(path, p=2)
    assert profile["grid"] == "quick" and profile["concurrency"] == 2 and profile["attention"]["kernel"] == "torch"
    assert len(profile["samples"]["gemm"]) == 4 and len(profile["samples"]["attention"]) == 5
    assert set(profile["collectives"]) == {"2"}
    assert all(c >= 0 for c in profile["gemm"]["forward"]["coef"]) and any(profile["gemm"]["forward"]["coef"])
    causal = profile["attention"]["backward"]["causal"]["by_head_dim"]["32"]
    assert causal["lengths"] == [64.0, 256.0] and all(r > 0 for r in causal["per_unit_s"])
    full = profile["attention"]["forward"]["full"]["by_head_dim"]["32"]
    assert full["lengths"] == pytest.approx([64.0, 64 * 2**0.5, 256.0])
    for kind in ("all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast", "reduce"):
        assert profile["collectives"]["2"][kind]["latency_s"] + profile["collectives"]["2"][kind]["per_byte_s"] > 0
    assert 0.0 <= profile["ring_overlap"] <= 1.0
    # offload's copies, to the host and back: in line on the CPU
    assert [nbytes for nbytes, _ in profile["samples"]["host_link"]["points"]] == [4 << 10, 256 << 10]
    link = profile["host_link"]
    assert link["overlap"] == 0.0 and link["latency_s"] + link["per_byte_s"] > 0
    pairs = [f"{a}/{m}" for a in ("tp_sp", "ulysses", "ring", "lean") for m in ("tp_sp", "zero3", "lean")]
    assert profile["correction"]["fitted_on"] == [f"{option}@{s}" for s in (64, 128) for option in pairs]

    model = AnalyticCostModel.from_file(path, MHA, 2)
    for option in OPTIONS:  # longer sequences cost more with measured rates too
        costs = [model.layer_cost(option, SequenceLayout.build(s, 2, causal=True), 1) for s in (256, 1024, 4096)]
        assert all(0 < a.time_s < b.time_s for a, b in zip(costs, costs[1:])), option
    with pytest.raises(ValueError, match=r"has no collectives for p=4"):
        AnalyticCostModel.from_file(path, MHA, 4)


def test_calibrate_for_one_rank(tmp_path, monkeypatch):
    """TP=1: kernels only, no collectives, nothing to overlap; the model prices p=1 from it."""
    monkeypatch.setitem(calibration.GRIDS, "quick", TINY)
    path = tmp_path / "profile.json"
    assert cli_main(["calibrate", "--output", str(path), "--p", "1", "--grid", "quick", "--quiet"]) == 0
    profile = load_profile(path, p=1, host_link=True)
    assert profile["collectives"] == {} and profile["ring_overlap"] == 0.0 and profile["concurrency"] == 1
    cost = AnalyticCostModel.from_file(path, MHA, 1).layer_cost(
        OPTIONS[0], SequenceLayout.build(256, 1, causal=True), 1
    )
    assert cost.time_s > 0 and cost.saved_bytes > 0


def _sample_of_uneven_ranks(rank: int, world: int) -> float:
    import torch

    return calibration._median_time(lambda: time.sleep(0.001 + 0.004 * rank), 3, torch.device("cpu"))


def test_a_sample_is_the_slowest_ranks_time():
    """As in a job, where the ranks meet at every collective: rank 0 alone would read 1 ms per call."""
    per_rank = run_on_ranks(_sample_of_uneven_ranks, 2, timeout_s=60)
    assert per_rank[0] == per_rank[1] >= 0.005
