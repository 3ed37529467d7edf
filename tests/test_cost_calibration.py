"""`paradyse calibrate` end to end: it writes a profile the analytic model reads.

Times are not asserted here (the machine is shared); the run checks the pipeline and the profile.
The memory terms are checked against what the strategies allocate in ``tests/test_memory_scripts.py``.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from megatron_paradyse.cli import main as cli_main
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost import calibrate as calibration
from megatron_paradyse.cost.analytic import AnalyticCostModel
from megatron_paradyse.cost.profile import load_profile
from megatron_paradyse.cost.terms import Dims, layer_terms
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


LLAMA3_8B = ModelShape(
    hidden_size=4096, num_attention_heads=32, num_query_groups=8, kv_channels=128, ffn_hidden_size=14336, gated_mlp=True
)


@pytest.mark.parametrize("p", [1, 8])
def test_a_models_grid_measures_every_gemm_its_layers_are_priced_with(p):
    """On an H200 the generic grid's GEMMs were all launch overhead: its fit priced no FLOP, and four
    Llama-3-8B layers at 64K tokens were predicted at 11.2 s against 2.7 s measured."""
    longest = 131072
    grid = calibration.model_grid(TINY, LLAMA3_8B, p, longest, "cuda")
    measured = {(n, k) for _, n, k in grid.gemms}
    d = Dims(LLAMA3_8B, p, 8192, 1, 2)
    layout = SequenceLayout.build(8192, p, causal=True)
    priced = {
        (g.n, g.k)
        for option in OPTIONS
        for terms in [layer_terms(option, d, layout)]
        for sub in (terms.attention, terms.mlp)
        for g in (*sub.gemms, *sub.recompute_gemms)
    }
    assert priced <= measured
    cap = calibration.SAMPLE_FLOPS["cuda"]
    ladder = [256 * 4**i for i in range(5)] + [longest]  # 256 to 65536 tokens, then the longest
    for n, k in measured:  # each shape from 256 tokens up to as many as the cap allows
        tokens = sorted(m for m, n2, k2 in grid.gemms if (n2, k2) == (n, k))
        assert tokens == [m for m in ladder if 2 * m * n * k <= cap] or tokens == [256]
    assert (65536, 4096, 4096) in grid.gemms and (longest, 4096, 4096) not in grid.gemms  # 4.4 TFLOP: over
    blocks = {(sq, causal) for heads, hn, sq, sk, causal in grid.attention_calls if hn == 128 and sq == sk}
    assert (32768, True) in blocks and (longest, True) not in blocks  # over the cap: the 32K rate prices it
    assert grid.correction_lengths == (64, 128, 512)  # the correction's layers: the grid's lengths and 4x the longest
    # one activation (fp32 bytes) at each token count, up to 2 GiB: a 16 MB add is launch overhead on a GPU
    generic = {4 << 10, 256 << 10, 4 << 20, 16 << 20}
    assert grid.elementwise_bytes == tuple(sorted(generic | {m * 4096 * 4 for m in ladder}))
    cpu = calibration.model_grid(TINY, LLAMA3_8B, p, longest, "cpu")  # up to 256 MiB
    assert cpu.elementwise_bytes == tuple(sorted(generic | {m * 4096 * 4 for m in ladder[:4]}))
    assert calibration.model_grid(TINY, LLAMA3_8B, p, 100, "cuda").correction_lengths == (64, 100)


def test_calibrate_measures_the_configs_model(tmp_path, monkeypatch, capsys):
    """``--config``: the model's own GEMMs and attention, up to its longest micro-batch, its TP size and dtype."""
    monkeypatch.setitem(calibration.GRIDS, "quick", TINY)
    config = tmp_path / "cfg.yaml"
    config.write_text(
        "data: {max_len: 1024}\n"
        'megatron_args: [--hidden-size, "64", --num-attention-heads, "4", --ffn-hidden-size, "192"]\n'
    )
    path = tmp_path / "profile.json"
    argv = ["calibrate", "--output", str(path), "--grid", "quick", "--quiet", "--config", str(config)]
    assert cli_main([*argv, "--fit-correction", "--", "--ffn-hidden-size", "256"]) == 0
    profile = load_profile(path, p=1)
    assert profile["concurrency"] == 1 and profile["dtype"] == "float32"
    assert profile["model"] == {
        "shape": dataclasses.asdict(
            ModelShape(hidden_size=64, num_attention_heads=4, num_query_groups=4, kv_channels=16, ffn_hidden_size=256)
        ),
        "p": 1,
        "longest": 1024,
    }
    gemms = {(g["m"], g["n"], g["k"]) for g in profile["samples"]["gemm"]}
    assert {(1024, 192, 64), (1024, 256, 64), (1024, 64, 256)} <= gemms  # qkv, fc1 (the flag's width), fc2
    lengths = profile["attention"]["forward"]["causal"]["by_head_dim"]["16"]["lengths"]
    assert lengths == [128.0, 512.0, 1024.0]
    assert {fitted.split("@")[1] for fitted in profile["correction"]["fitted_on"]} == {"64", "128", "512"}
    with pytest.raises(SystemExit) as stopped:
        cli_main(["calibrate", "--output", str(path), "--", "--bf16"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.endswith(
        "paradyse: error: Megatron flags (--bf16) go with --config, which they override\n"
    )


def test_the_cached_profile_of_a_model_serves_every_length_it_measured(tmp_path, monkeypatch, capsys):
    """Start-up calibration (no cost.profile) keeps one profile per layer: calibrated up to 512 tokens, it
    serves a job whose longest micro-batch is 256, and is measured again, up to 1024, for one of 1024."""
    monkeypatch.setitem(calibration.GRIDS, "quick", TINY)
    shape = ModelShape(hidden_size=64, num_attention_heads=4, num_query_groups=4, kv_channels=16, ffn_hidden_size=128)

    def profile(longest: int) -> dict:
        return calibration.cached_quick_profile(
            tmp_path, 1, device="cpu", dtype=torch.float32, shape=shape, longest=longest
        )

    assert profile(512)["model"]["longest"] == 512
    assert "calibrating a quick profile for p=1" in capsys.readouterr().out
    assert profile(256)["model"]["longest"] == 512
    assert "using the quick profile calibrated before" in capsys.readouterr().out
    assert profile(1024)["model"]["longest"] == 1024
    assert "calibrating a quick profile for p=1" in capsys.readouterr().out
    assert len(list(tmp_path.glob("cost-profile-quick-corrected-cpu-p1-float32-model*.json"))) == 1
