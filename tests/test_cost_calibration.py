"""The memory terms against what the strategies really allocate, and `paradyse calibrate` end to end.

Memory is deterministic, so the terms are checked against :class:`PeakMemory` on real gloo ranks,
every rank: saved bytes exactly and the peak within 1% for the benchmark's kind of layer (MHA, GELU,
causal), within 10% for GQA with a gated MLP, causal and bidirectional. Every strategy's memory
decides some option's peak: lean's MLP backward in ``lean/lean``, lean's attention backward in
``lean/zero3`` with GQA. Times are not asserted here (the machine is shared); the calibration run
checks the pipeline and the profile.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_paradyse.cli import main as cli_main
from megatron_paradyse.cost import calibrate as calibration
from megatron_paradyse.cost.analytic import AnalyticCostModel
from megatron_paradyse.cost.measure import measure_layer
from megatron_paradyse.cost.profile import load_profile
from megatron_paradyse.cost.terms import Dims, layer_terms
from megatron_paradyse.layout import SequenceLayout
from megatron_paradyse.multiprocess import run_on_ranks
from megatron_paradyse.plan import LayerOption
from megatron_paradyse.strategies import ModelShape

P = 2
SHAPES = {
    "mha": ModelShape(hidden_size=128, num_attention_heads=4, num_query_groups=4, kv_channels=32, ffn_hidden_size=512),
    "gqa": ModelShape(
        hidden_size=64, num_attention_heads=8, num_query_groups=4, kv_channels=8, ffn_hidden_size=96, gated_mlp=True
    ),
}
OPTIONS = [
    LayerOption(a, m, rc)
    for a, m in (("tp_sp", "tp_sp"), ("ulysses", "zero3"), ("ring", "zero3"), ("lean", "lean"), ("lean", "zero3"))
    for rc in (False, True)
]
# (shape, causal, lengths): weight-dominated and activation-dominated lengths
CASES = [("mha", True, (64, 1024)), ("gqa", True, (64, 512)), ("gqa", False, (512,))]


def _measure_memory(rank: int, p: int) -> dict:
    out = {}
    for shape_name, causal, lengths in CASES:
        for s in lengths:
            layout = SequenceLayout.build(s, p, causal=causal)
            for option in OPTIONS:
                m = measure_layer(option, layout, SHAPES[shape_name], dist.group.WORLD, repeats=0, memory_runs=5)
                out[(shape_name, causal, s, str(option))] = (m.saved_bytes, m.peak_bytes)
    return out


@pytest.fixture(scope="module")
def measured():
    return run_on_ranks(_measure_memory, P, timeout_s=300)


CASE_IDS = [(n, c, s, str(o)) for n, c, lengths in CASES for s in lengths for o in OPTIONS]


@pytest.mark.parametrize("key", CASE_IDS, ids=lambda k: f"{k[0]}-{'causal' if k[1] else 'bidir'}-{k[2]}-{k[3]}")
def test_memory_terms_match_the_tracker(measured, key):
    shape_name, causal, s, option = key
    exact = shape_name == "mha"
    for rank, per_rank in enumerate(measured):
        saved, peak = per_rank[key]
        layout = SequenceLayout.build(s, P, causal=causal)
        terms = layer_terms(
            LayerOption.parse(option), Dims(SHAPES[shape_name], P, layout.padded_len, 1, 4), layout, rank
        )
        predicted_peak = terms.saved_bytes + terms.transient_bytes
        if exact:
            assert terms.saved_bytes == saved, f"rank {rank}: saved {terms.saved_bytes} != measured {saved}"
            assert predicted_peak == pytest.approx(peak, rel=0.01), f"rank {rank}"
        else:
            assert terms.saved_bytes == pytest.approx(saved, rel=0.1), f"rank {rank}"
            assert predicted_peak == pytest.approx(peak, rel=0.1), f"rank {rank}"


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
    assert "[##############################] 26/26" in capfd.readouterr().err  # rank 0's progress bar finished

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
    pairs = [f"{a}/{m}" for a in ("tp_sp", "ulysses", "ring", "lean") for m in ("tp_sp", "zero3", "lean")]
    assert profile["correction"]["fitted_on"] == [f"{option}@{s}" for s in (64, 128) for option in pairs]

    model = AnalyticCostModel.from_file(path, SHAPES["mha"], 2)
    for option in OPTIONS:  # longer sequences cost more with measured rates too
        costs = [model.layer_cost(option, SequenceLayout.build(s, 2, causal=True), 1) for s in (256, 1024, 4096)]
        assert all(0 < a.time_s < b.time_s for a, b in zip(costs, costs[1:])), option
    with pytest.raises(ValueError, match=r"has no collectives for p=4"):
        AnalyticCostModel.from_file(path, SHAPES["mha"], 4)
