"""The simulated paper setting: hardware profiles from published figures, curves that end where the
planner finds no plan, and the benchmark's output."""

from __future__ import annotations

import dataclasses
import importlib.util
import re

import numpy as np
import pytest
import torch

from megatron_paradyse.bench import _simulation, simulate
from megatron_paradyse.bench.frontier import frontier, training_flops
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost import AnalyticCostModel, ProfileError
from megatron_paradyse.cost.hardware import HARDWARE, hardware_profile, stage_static_bytes
from megatron_paradyse.cost.profile import load_profile, save_profile
from megatron_paradyse.planner import Planner, PlannerConfig
from megatron_paradyse.strategies import ModelShape

GPT = ModelShape(hidden_size=12288, num_attention_heads=96, num_query_groups=96, kv_channels=128, ffn_hidden_size=49152)
PAIRS = ("tp_sp/tp_sp", "ulysses/zero3", "ring/zero3", "lean/lean")


@pytest.mark.parametrize("name", sorted(HARDWARE))
def test_hardware_profile_loads_and_predicts_monotone_costs(name, tmp_path):
    path = tmp_path / f"{name}.json"
    save_profile(hardware_profile(HARDWARE[name]), path)  # validates every key the schema requires
    with pytest.raises(ProfileError, match="another machine"):
        load_profile(path, p=8, device="cpu")  # it describes a GPU, not this machine
    profile = load_profile(path, p=8, check_machine=False)
    model = AnalyticCostModel(profile, GPT, 8, dtype=torch.bfloat16)
    lengths = (2048, 16384, 131072)
    for pair in PAIRS:
        costs = [model.layer_cost(LayerOption.parse(pair), SequenceLayout.build(s, 8, causal=True), 1) for s in lengths]
        assert all(a.time_s < b.time_s for a, b in zip(costs, costs[1:])), pair
        assert all(a.saved_bytes < b.saved_bytes for a, b in zip(costs, costs[1:])), pair


def test_hardware_profile_holds_the_published_figures():
    profile = hardware_profile(HARDWARE["a100"])
    # nccl-tests bus bandwidth 230 GB/s: an all-gather of N output bytes moves N (p-1)/p per rank
    assert profile["collectives"]["8"]["all_gather"]["per_byte_s"] == pytest.approx(7 / 8 / 230e9)
    # FlashAttention-2 on A100: 73% (forward) and 63% (backward, 2.5x the FLOPs) of 312 TFLOP/s at long blocks
    forward = profile["attention"]["forward"]["causal"]["by_head_dim"]["128"]
    backward = profile["attention"]["backward"]["full"]["by_head_dim"]["128"]
    assert forward["per_unit_s"][-1] == pytest.approx(4 / (0.73 * 312e12))
    assert backward["per_unit_s"][-1] == pytest.approx(10 / (0.63 * 312e12))
    assert profile["gemm"]["forward"]["coef"][1] == pytest.approx(1 / (0.75 * 312e12))
    h100 = hardware_profile(HARDWARE["h100"])["attention"]
    f = 4 / h100["forward"]["full"]["by_head_dim"]["128"]["per_unit_s"][-1]
    b = 10 / h100["backward"]["full"]["by_head_dim"]["128"]["per_unit_s"][-1]
    assert 3.5 / (1 / f + 2.5 / b) == pytest.approx(335e12)  # FlashAttention-2's H100 forward + backward
    # causal square blocks: cuDNN's attention as measured on an H200, 211.2 ms for the forward and backward
    # of a Llama-3-8B core (32 heads, head dim 128) at 64K tokens (the result file the figures name)
    causal = {d: h100[d]["causal"]["by_head_dim"]["128"] for d in ("forward", "backward")}
    f, b = 4 / causal["forward"]["per_unit_s"][-1], 10 / causal["backward"]["per_unit_s"][-1]
    assert causal["forward"]["lengths"][-1] == 65536
    assert 3.5 / (1 / f + 2.5 / b) == pytest.approx(14 * 65536 * 65537 / 2 * 32 * 128 / 0.2112)
    at_4k = 4 / causal["forward"]["per_unit_s"][causal["forward"]["lengths"].index(4096)]  # 1.08 ms at 4K
    assert at_4k / f == pytest.approx(0.2112 / 1.08e-3 * 4096 * 4097 / (65536 * 65537))
    assert hardware_profile(HARDWARE["h100"])["samples"]["sources"][3] == (
        "benchmarks/results/attention-kernels_h200_20261126_a36467b.md"
    )


def test_hardware_without_a_collective_figure_is_refused():
    spec = HARDWARE["h100"]
    links = {k: v for k, v in spec.links.items() if k != "all_to_all"}
    with pytest.raises(ValueError, match="has no link figures for all_to_all"):
        hardware_profile(dataclasses.replace(spec, links=links))


def _tiny_planner(pairs: tuple[str, ...], budget_gib: float) -> tuple[Planner, AnalyticCostModel]:
    shape = ModelShape(hidden_size=256, num_attention_heads=8, num_query_groups=8, kv_channels=32, ffn_hidden_size=1024)
    model = AnalyticCostModel(hardware_profile(HARDWARE["a100"]), shape, 8, dtype=torch.bfloat16, static_bytes=2**30)
    config = PlannerConfig(pairs=pairs, recompute=False, on_infeasible="stop")
    cost = _simulation.MemoCostModel(model)
    planner = Planner.for_model(config, cost, shape=shape, p=8, num_layers=4, budget_bytes=budget_gib * 2**30)
    return planner, model


@pytest.mark.parametrize("pairs", [("tp_sp/tp_sp",), PAIRS])
def test_a_curve_ends_at_the_first_sequence_no_plan_fits(pairs):
    planner, model = _tiny_planner(pairs, budget_gib=2.0)
    lengths = np.sort(np.random.default_rng(0).integers(1000, 2_000_000, size=40))
    run = _simulation.Run(name="x", paper_name="x", planner=planner.config, static=len(pairs) == 1)
    curve = _simulation.simulate_curve(run, planner, lengths, 8, causal=True)
    longest = curve.max_feasible
    assert longest == planner.max_feasible_length(8, causal=True)  # the bounded search finds the planner's
    assert 0 < longest < lengths[-1]  # the setting must stop inside the data
    edge = lambda n: -(-n // 512) * 512  # noqa: E731  the planner's bucket (a multiple of 512 >= 2p)
    assert curve.stopped_at == next(int(n) for n in lengths if edge(n) > longest)
    assert curve.lengths == [int(n) for n in lengths if n < curve.stopped_at]
    assert edge(curve.reached) <= longest
    if len(pairs) == 1:  # a static strategy's time: its option on every layer, at the bucket's edge
        option = LayerOption.parse(pairs[0])
        times = [
            4 * model.layer_cost(option, SequenceLayout.build(edge(n), 8, causal=True), 1).time_s for n in curve.lengths
        ]
        assert curve.cumulative_s == pytest.approx(np.cumsum(times).tolist(), rel=1e-12)
    assert curve.cumulative_at(curve.stopped_at) is None
    assert curve.cumulative_at(curve.reached) == curve.total_s


def test_stage_static_bytes_counts_18_bytes_per_parameter():
    params_per_rank = 8 * 12 * 12288**2 / 8 + 8 * 4 * 12288  # TP-sharded linears, replicated LayerNorms
    assert stage_static_bytes(GPT, 8, 8) == 18 * params_per_rank
    assert stage_static_bytes(GPT, 8, 8, vocab_size=100) == 18 * (params_per_rank + 2 * 100 * 12288 / 8)
    # Megatron's distributed optimizer: the master weights and Adam's moments sharded over the replicas
    assert stage_static_bytes(GPT, 8, 8, dp=4) == (2 + 4 + 12 / 4) * params_per_rank


def test_benchmark_prints_tables_checks_and_the_summary_line(tmp_path, capsys):
    plots = importlib.util.find_spec("matplotlib") is not None  # an optional dependency
    argv = ["--gpus", "h100", "--models", "bert", "--datasets", "grch38", "--sequences", "40"]
    assert simulate.main([*argv, "--out-dir", str(tmp_path)] if plots else [*argv, "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SIMULATED, NOT MEASURED")
    assert "MegatronTS" in out and "METP" in out and "ParaDySe" in out
    assert re.search(r"^(PASS|FAIL): METP reaches furthest of the static strategies", out, re.M)
    # the tuned Megatron configuration: what is not priced, said; a row of each setting's table, and why
    assert "(megatron_paradyse/simulation/tuned.py); not priced:\n  TP and CP both above 1 (" in out
    assert "\n  selective recompute (no cost term recomputes the attention core alone)\n" in out
    assert re.search(
        r"^  tuned +Megatron TP=\d CP=\d.* DP=\d (no recompute|full recompute|recompute \d+ of \d+ layers) +"
        r"(all fit|[\d,]+) ",
        out,
        re.M,
    )
    assert re.search(
        r"^  tuned Megatron: TP=\d .*, the fastest of the \d+ of 6 layouts that train every sequence", out, re.M
    )
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"adaptive_max_len_bert_grch38_h100=\d+ mfu_128k=\d+\.\d mfu_1m=\d+\.\d adaptive_vs_tuned_megatron=\d\.\d\d "
        r"llama3_8b_h100_max_len=\d+ paper=329728 ordering_ok=[01]",
        last,
    ), last
    assert "Llama-3-8B on one node, the whole model" in out
    assert "Llama-3-8B on one H100 node (configs/llama3-8b.yaml, every lever), SIMULATED, against each" in out
    if plots:
        assert (tmp_path / "figure2_h100.png").stat().st_size > 10_000


def test_llama3_8b_frontier_counts_the_whole_model_chunks_its_loss_and_offloads():
    result = frontier(HARDWARE["h100"], _simulation.CONFIGS)
    # the full-vocabulary logits bind Megatron's loss; chunked, the whole model comes close to its layers
    assert result.megatron_loss_max_len < result.chunked_loss_max_len <= result.layers_only_max_len
    assert result.chunked_loss_max_len > 3 * result.megatron_loss_max_len
    # the layers' saved inputs in host memory: past what the layers alone fit on the device
    assert result.max_len > 2 * result.layers_only_max_len
    assert "loss in 8192-token chunks" in result.plan_at_1m and "+off" in result.plan_at_1m
    assert 0 < result.mfu_at_1m < 1 and 0 < result.mfu_at_128k < 1


def test_training_flops_are_six_per_parameter_and_token_plus_causal_attention():
    shape = ModelShape(hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, ffn_hidden_size=96)
    params = 64 * (64 + 2 * 2 * 16 + 64 + 96) + 96 * 64  # q, k and v, proj, fc1, fc2 of one layer
    assert training_flops(shape, 3, 10) == 6 * 3 * params * 10 + 3 * 3 * 2 * 10 * 10 * 64
