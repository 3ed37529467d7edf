"""`paradyse calibrate` end to end: it writes a profile the analytic model reads.

Times are not asserted here (the machine is shared); the run checks the pipeline and the profile.
The memory terms are checked against what the strategies allocate in ``tests/ranks/test_memory_scripts.py``.
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from megatron_paradyse.calibration import calibrate as calibration
from megatron_paradyse.calibration import fit, samples, startup
from megatron_paradyse.calibration import grid as grids
from megatron_paradyse.cli import main as cli_main
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.analytic import AnalyticCostModel
from megatron_paradyse.cost.profile import load_profile
from megatron_paradyse.cost.terms import layer_terms
from megatron_paradyse.strategies import ModelShape, strategy_names
from megatron_paradyse.strategies.dims import Dims

from helpers.cost_profiles import CALIBRATED_LAYER, TINY_GRID

MHA = ModelShape(hidden_size=128, num_attention_heads=4, num_query_groups=4, kv_channels=32, ffn_hidden_size=512)
OPTIONS = [
    LayerOption(a, m, rc)
    for a, m in (("tp_sp", "tp_sp"), ("ulysses", "zero3"), ("ring", "zero3"), ("lean", "lean"), ("lean", "zero3"))
    for rc in (False, True)
]


def test_calibrate_writes_a_profile_the_model_reads(tmp_path, monkeypatch, capfd):
    monkeypatch.setitem(grids.GRIDS, "quick", TINY_GRID)
    path = tmp_path / "profile.json"
    assert cli_main(["calibrate", "--output", str(path), "--p", "2", "--grid", "quick", "--fit-correction"]) == 0
    assert "[##############################] 29/29" in capfd.readouterr().err  # rank 0's progress bar finished

    profile = load_profile(path, p=2)
    assert profile["grid"] == "quick" and profile["concurrency"] == 2 and profile["attention"]["kernel"] == "torch"
    assert len(profile["samples"]["gemm"]) == 4 and len(profile["samples"]["attention"]) == 5
    assert set(profile["collectives"]) == {"2"}
    assert all(c >= 0 for c in profile["gemm"]["forward"]["coef"]) and any(profile["gemm"]["forward"]["coef"])
    for direction in ("forward", "backward"):  # each measured GEMM shape's rate at each of its m
        rates = {
            f"{n}x{k}": {
                "m": [32, 256],
                "per_flop_s": [
                    g[f"{direction}_s"] / (2 * g["m"] * n * k)
                    for m in (32, 256)
                    for g in profile["samples"]["gemm"]
                    if (g["m"], g["n"], g["k"]) == (m, n, k)
                ],
            }
            for n, k in ((128, 128), (384, 128))
        }
        assert profile["gemm"][direction]["by_shape"] == rates
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
    pairs = [f"{a}/{m}" for a in strategy_names("attention") for m in strategy_names("mlp")]
    assert profile["correction"]["fitted_on"] == [f"{option}@{s}" for s in (64, 128) for option in pairs]

    model = AnalyticCostModel.from_file(path, MHA, 2)
    for option in OPTIONS:  # longer sequences cost more with measured rates too
        costs = [model.layer_cost(option, SequenceLayout.build(s, 2, causal=True), 1) for s in (256, 1024, 4096)]
        assert all(0 < a.time_s < b.time_s for a, b in zip(costs, costs[1:])), option
    with pytest.raises(ValueError, match=r"has no collectives for p=4"):
        AnalyticCostModel.from_file(path, MHA, 4)


def test_calibrate_for_one_rank(tmp_path, monkeypatch):
    """TP=1: kernels only, no collectives, nothing to overlap; the model prices p=1 from it."""
    monkeypatch.setitem(grids.GRIDS, "quick", TINY_GRID)
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

    return samples.median_time(lambda: time.sleep(0.001 + 0.004 * rank), 3, torch.device("cpu"))


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
    grid = grids.model_grid(TINY_GRID, LLAMA3_8B, p, longest, "cuda")
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
    cap = grids.SAMPLE_FLOPS["cuda"]
    ladder = [256 * 4**i for i in range(5)] + [longest]  # 256 to 65536 tokens, then the longest
    for n, k in measured:  # each shape from 256 tokens up to as many as the cap allows
        tokens = sorted(m for m, n2, k2 in grid.gemms if (n2, k2) == (n, k))
        assert tokens == [m for m in ladder if 2 * m * n * k <= cap] or tokens == [256]
    assert (65536, 4096, 4096) in grid.gemms and (longest, 4096, 4096) not in grid.gemms  # 4.4 TFLOP: over
    blocks = {(sq, causal): heads for heads, hn, sq, sk, causal in grid.attention_calls if hn == 128 and sq == sk}
    assert (32768, True) in blocks and (longest, True) not in blocks  # over the cap: the 32K rate prices it
    # as many heads as the model's calls run (ring's and lean's all 32 at any p), fewer where over the cap: on
    # an H200 one head of 8K tokens left most of the GPU idle; a CPU's rate does not depend on the count
    assert blocks[8192, True] == blocks[8192, False] == 32 and blocks[32768, True] == 14
    assert blocks[32768, False] == 7  # and 131,072 tokens: one head is over the cap
    cpu_blocks = grids.model_grid(TINY_GRID, LLAMA3_8B, p, longest, "cpu").attention_calls
    assert {heads for heads, *_ in cpu_blocks} == {1}
    # the correction's layers: the grid's lengths, and on a GPU 4x the longest (the grid's are launch overhead)
    assert grid.correction_lengths == (64, 128, 512)
    # one activation (fp32 bytes) at each token count, up to 2 GiB: a 16 MB add is launch overhead on a GPU
    generic = {4 << 10, 256 << 10, 4 << 20, 16 << 20}
    assert grid.elementwise_bytes == tuple(sorted(generic | {m * 4096 * 4 for m in ladder}))
    cpu = grids.model_grid(TINY_GRID, LLAMA3_8B, p, longest, "cpu")  # up to 256 MiB
    assert cpu.elementwise_bytes == tuple(sorted(generic | {m * 4096 * 4 for m in ladder[:4]}))
    assert cpu.correction_lengths == (64, 128)
    assert grids.model_grid(TINY_GRID, LLAMA3_8B, p, 100, "cuda").correction_lengths == (64, 100)


def test_calibrate_measures_the_configs_model(tmp_path, monkeypatch, capsys):
    """``--config``: the model's own GEMMs and attention, up to its longest micro-batch, its TP size and dtype."""
    monkeypatch.setitem(grids.GRIDS, "quick", TINY_GRID)
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
    fitted_lengths = {fitted.split("@")[1] for fitted in profile["correction"]["fitted_on"]}
    assert fitted_lengths == {"64", "128"}  # on a CPU, the grid's lengths alone
    with pytest.raises(SystemExit) as stopped:
        cli_main(["calibrate", "--output", str(path), "--", "--bf16"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.endswith(
        "paradyse: error: Megatron flags (--bf16) go with --config, which they override\n"
    )


def test_the_cached_profile_of_a_model_serves_every_length_it_measured(tmp_path, monkeypatch, capsys):
    """Start-up calibration (no cost.profile) keeps one profile per layer: calibrated up to 512 tokens, it
    serves a job whose longest micro-batch is 256, and is measured again, up to 1024, for one of 1024."""
    monkeypatch.setitem(grids.GRIDS, "quick", TINY_GRID)
    shape = ModelShape(hidden_size=64, num_attention_heads=4, num_query_groups=4, kv_channels=16, ffn_hidden_size=128)

    def profile(longest: int) -> dict:
        return startup.cached_quick_profile(
            tmp_path, 1, device="cpu", dtype=torch.float32, shape=shape, longest=longest
        )

    assert profile(512)["model"]["longest"] == 512
    assert "calibrating a quick profile for p=1" in capsys.readouterr().out
    assert profile(256)["model"]["longest"] == 512
    assert "using the quick profile calibrated before" in capsys.readouterr().out
    assert profile(1024)["model"]["longest"] == 1024
    assert "calibrating a quick profile for p=1" in capsys.readouterr().out
    (path,) = tmp_path.glob("cost-profile-quick-corrected-cpu-p1-float32-model*.json")
    # one saved before the GEMM shapes had their own rates is measured again
    saved = json.loads(path.read_text())
    del saved["gemm"]["forward"]["by_shape"], saved["gemm"]["backward"]["by_shape"]
    path.write_text(json.dumps(saved))
    assert "by_shape" in profile(256)["gemm"]["forward"]
    assert "calibrating a quick profile for p=1" in capsys.readouterr().out


# -- one GPU standing for p ranks ----------------------------------------------------------------
def _calibrate_as_one_of_eight(rank: int, world: int, links: dict) -> dict | str:
    """This process alone stands for rank 0 of 8 on a fake group: one device's compute at 8 ranks' shapes."""
    import torch.distributed as dist

    from megatron_paradyse.mcore.trace import fake_world

    grids.GRIDS["quick"] = TINY_GRID
    dist.destroy_process_group()
    with fake_world(0, 8):
        try:
            calibration.calibrate_on_group(
                dist.group.WORLD,
                device=torch.device("cpu"),
                dtype=torch.bfloat16,
                shape=CALIBRATED_LAYER,
                longest=512,
                links={},
            )
        except ValueError as e:
            refused = str(e)
        profile = calibration.calibrate_on_group(
            dist.group.WORLD,
            device=torch.device("cpu"),
            dtype=torch.bfloat16,
            shape=CALIBRATED_LAYER,
            longest=512,
            links=links,
        )
    from megatron.core import parallel_state

    # the TP=8 linears' gather buffer, made without Megatron's parallel state, is gone with the calibration
    return profile, refused, parallel_state._GLOBAL_MEMORY_BUFFER is not None


def test_one_device_calibrates_the_compute_of_one_rank_of_eight_with_the_links_of_another_profile():
    from megatron_paradyse.cost.hardware import HARDWARE, hardware_profile

    links = hardware_profile(HARDWARE["h100"])
    ((profile, refused, gather_buffer_left),) = run_on_ranks(
        _calibrate_as_one_of_eight, 1, args=(links,), timeout_s=300
    )
    assert not gather_buffer_left  # Megatron's initialize_model_parallel refuses one (found on an H200)
    assert refused == (
        "the links profile has no collectives for p=8 (it has p in []); calibrate them on the cluster with "
        "`paradyse calibrate --p 8`"
    )
    assert profile["concurrency"] == 8 and profile["model"]["p"] == 8 and profile["dtype"] == "bfloat16"
    grid = grids.model_grid(TINY_GRID, CALIBRATED_LAYER, 8, 512, "cpu")
    assert [(g["m"], g["n"], g["k"]) for g in profile["samples"]["gemm"]] == samples.gemm_shapes(grid)
    assert profile["samples"]["collectives"] == {} and profile["collectives"] == {"8": links["collectives"]["8"]}
    assert profile["ring_overlap"] == links["ring_overlap"] == 0.9
    assert profile["links"] == {"fingerprint": links["fingerprint"], "grid": "published"}
    correction = profile["correction"]  # fitted on compute alone: the fake group's collectives took no time
    assert correction["comm"] == 1.0 and correction["per_sync_s"] == 0.0
    assert correction["compute"] >= fit.MIN_SCALE
    layers = [f"{option}@{s}" for s in grid.correction_lengths for option in grids.correction_layers()]
    assert grid.correction_lengths == (64, 128) and correction["fitted_on"] == layers


@pytest.mark.parametrize(
    "flags, error",
    [
        (
            ["--fake-group", "--links", "h100", "--p", "8"],
            "--fake-group measures one GPU standing for each rank; on the CPU the ranks share the cores, so "
            "calibrate them together: leave out --fake-group",
        ),
        (
            ["--device", "cuda", "--fake-group", "--p", "8"],
            "--fake-group measures no collective (a fake group's move nothing): give --links, a profile calibrated "
            "on the cluster (`paradyse calibrate --p 8`) or a node's published figures (a100, h100, h200)",
        ),
        (
            ["--device", "cuda", "--fake-group", "--p", "16", "--links", "h100"],
            "--links h100: the published figures are for groups of 1, 2, 4, 8 GPUs of one node, not p=16",
        ),
        (["--device", "cuda", "--fake-group", "--p", "4,8"], "--fake-group stands for one group size, got --p 4,8"),
        (["--links", "h100"], "--links gives the collectives of a fake group, which measures none: add --fake-group"),
        pytest.param(
            ["--device", "cuda", "--fake-group", "--p", "8", "--links", "h100"],
            "--fake-group measures this machine's GPU, and it has none (torch.cuda.is_available() is False)",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU"),
        ),
    ],
)
def test_calibrating_one_rank_on_a_fake_group_refuses_what_it_cannot_measure(tmp_path, capsys, flags, error):
    with pytest.raises(SystemExit) as stopped:
        cli_main(["calibrate", "--output", str(tmp_path / "profile.json"), "--quiet", *flags])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"paradyse: error: {error}\n"
    assert not list(tmp_path.iterdir())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_gpu_calibrates_a_rank_of_eight_of_the_configs_model(tmp_path, monkeypatch):
    """``paradyse calibrate --config --fake-group --links h100``: this GPU's compute at TP=8 shapes in bf16,
    the published node's links; the profile prices the config's model at p=8."""
    monkeypatch.setitem(grids.GRIDS, "quick", TINY_GRID)
    config = tmp_path / "cfg.yaml"
    config.write_text(
        "data: {max_len: 4096}\n"
        'megatron_args: [--hidden-size, "1024", --num-attention-heads, "16", --ffn-hidden-size, "4096", --bf16, '
        '--tensor-model-parallel-size, "8"]\n'
    )
    path = tmp_path / "profile.json"
    argv = ["calibrate", "--output", str(path), "--grid", "quick", "--quiet", "--config", str(config)]
    assert cli_main([*argv, "--device", "cuda", "--fake-group", "--links", "h100", "--fit-correction"]) == 0
    profile = load_profile(path, p=8)
    assert profile["concurrency"] == 8 and profile["dtype"] == "bfloat16" and profile["links"]["grid"] == "published"
    shape = ModelShape(
        hidden_size=1024, num_attention_heads=16, num_query_groups=16, kv_channels=64, ffn_hidden_size=4096
    )
    gemms = {(g["m"], g["n"], g["k"]) for g in profile["samples"]["gemm"]}
    assert (4096, 4096 // 8, 1024) in gemms and profile["correction"]["comm"] == 1.0  # fc1's shard at TP=8
    cost = AnalyticCostModel.from_file(path, shape, 8, dtype=torch.bfloat16).layer_cost(
        OPTIONS[0], SequenceLayout.build(4096, 8, causal=True), 1
    )
    assert cost.time_s > 0


def test_attention_is_timed_on_blocks_laid_out_as_the_strategies_hand_them_over():
    """Sequence-major q, k, v (``[b, s, n, d]`` dense), as ``attend_full_sequence`` gives the kernel: on
    a GPU with ``CUDNN_LENGTH_BUCKETS`` set only these run cuDNN's graphs by length bucket, a few percent
    slower than the dense graph per length, and calibration must time what training runs."""
    from helpers.recording_kernels import DenseLayoutRecorder

    recorder = DenseLayoutRecorder()
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        samples.time_attention(recorder, 2, 8, 16, 16, True, 1, torch.device("cpu"), torch.float32, None)
    finally:
        torch.distributed.destroy_process_group()
    assert recorder.dense and set(recorder.dense) == {(True, True, True)}
