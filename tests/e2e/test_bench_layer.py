"""``bench layer`` (scripts/gpu_check.sh's benchmark) at CPU sizes: the same code path as on a GPU, the
Llama-3-8B layer's shape shrunk; its figures mean nothing here, its table and last line do."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from megatron_paradyse.bench import layer

from helpers.paths import ROOT


def _bench(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megatron_paradyse.bench", "layer", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_bench_layer_times_both_layers_and_both_attentions_and_counts_no_host_sync():
    result = _bench("--model", "tiny", "--lengths", "64,128", "--dtype", "bf16", "--warmup", "1", "--repeats", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "layer: tiny, bf16, cpu, transformer implementation: local"
    rows = [line.split() for line in lines[2:4]]
    assert [int(row[0]) for row in rows] == [64, 128]
    for row in rows:  # tokens, paradyse ms, stock ms, ratio, attention ms, sdpa ms, ratio, (backend)
        ours, stock, ratio = float(row[1]), float(row[2]), float(row[3])
        # times are printed to 0.01 ms and the ratio to 0.001: the ratio of the printed times may differ by
        # what that rounding allows, and no more
        rounding = ours / stock * (0.005 / ours + 0.005 / stock) + 0.0005
        assert abs(ratio - ours / stock) <= rounding * 1.01
        assert re.fullmatch(r"\((flash_attention|cudnn_attention|efficient_attention|math)\)", row[7])
    ratios = [float(row[3]) for row in rows]
    assert lines[4:6] == [
        "first call at a new length, minus its steady time (ms)",
        " tokens  paradyse layer  attention core      sdpa cudnn      sdpa flash",
    ]
    new_length_rows = [line.split() for line in lines[6:-1]]
    assert [int(row[0]) for row in new_length_rows] == [64, 128]
    last = re.fullmatch(
        r"tp_sp_vs_stock_max=(\S+) attention_vs_sdpa_best=(\S+) host_syncs=(\d+) new_length_extra_ms_max=(\S+)",
        lines[-1],
    )
    assert last, lines[-1]
    assert float(last[1]) == max(ratios)
    assert float(last[2]) == max(float(row[6]) for row in rows)
    assert last[3] == "0"
    assert float(last[4]) == max(float(row[1]) for row in new_length_rows)


def test_a_new_lengths_first_call_is_timed_apart_at_a_length_no_measurement_ran(capsys):
    """The probe runs each thing at its own length below a measured one (a shape no cache holds yet, in
    memory the allocator already holds) and times that first call apart from the steady ones."""
    import time

    from megatron_paradyse.bench import layer

    class Layers:
        lengths: list[int] = []

        def step(self, which: str, n: int):
            assert which == "paradyse"
            self.lengths.append(n)
            calls = []

            def run() -> None:  # a first call that sets something up for 0.2 s, as a graph build would
                time.sleep(0.2 if not calls else 0.0)
                calls.append(n)

            return run

    device = torch.device("cpu")
    layers = Layers()
    extras = layer._print_new_length_extras(
        layers, layer.MODELS["tiny"], [6, 64], torch.bfloat16, device, layer._Timer(device, 1, 2)
    )
    assert layers.lengths == [62]  # 6 tokens leave no room for four new lengths below them
    assert len(extras) == 1 and 0.15 < extras[0] < 0.4
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [row.split()[0] for row in rows] == ["64"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lengths", "4096,odd"], "expected comma-separated token counts, got '4096,odd'"),
        (["--lengths", "4095"], "token counts must be even and >= 2"),
        (["--device", "cuda"], "--device cuda: no CUDA device here"),
    ],
)
def test_bench_layer_refuses_bad_lengths_and_a_missing_device(argv, message, capsys):
    if torch.cuda.is_available() and argv[0] == "--device":
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(SystemExit) as exit_:
        layer.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_layer_prints_the_cost_models_time_beside_the_measured(tmp_path, monkeypatch):
    """``--profile``: the time the cost model predicts for the Paradyse layer under ``tp_sp/tp_sp`` at TP=1
    from a profile of this machine, beside the measured one; the last line adds the least and the largest
    predicted/measured ratio. A profile it cannot read stops it before anything is timed."""
    from megatron_paradyse.bench.layer import MODELS
    from megatron_paradyse.calibration import calibrate as calibration
    from megatron_paradyse.calibration import grid as grids
    from megatron_paradyse.core.layout import SequenceLayout
    from megatron_paradyse.core.plan import LayerOption
    from megatron_paradyse.cost.analytic import AnalyticCostModel
    from megatron_paradyse.cost.profile import save_profile

    from helpers.cost_profiles import TINY_GRID

    monkeypatch.setitem(grids.GRIDS, "quick", TINY_GRID)
    path = tmp_path / "profile.json"
    save_profile(calibration.calibrate((1,), grid="quick", dtype=torch.bfloat16, show_progress=False), path)
    result = _bench(
        "--model", "tiny", "--lengths", "64,128", "--dtype", "bf16", "--warmup", "1", "--repeats", "2",
        "--profile", str(path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[1].endswith("pred ms pred/meas")
    model = AnalyticCostModel.from_file(path, MODELS["tiny"].shape, 1, dtype=torch.bfloat16)
    ratios = []
    for row, n in zip([line.split() for line in lines[2:4]], (64, 128)):
        ours, predicted, ratio = float(row[1]), float(row[8]), float(row[9])
        expected = model.layer_cost(LayerOption("tp_sp", "tp_sp"), SequenceLayout.build(n, 1, causal=True), 1)
        assert predicted == pytest.approx(expected.time_s * 1e3, abs=0.005)
        assert abs(ratio - predicted / ours) <= predicted / ours * (0.005 / predicted + 0.005 / ours) * 1.01 + 0.0005
        ratios.append(ratio)
    assert (
        f" predicted_over_measured_min={min(ratios):.3f} predicted_over_measured_max={max(ratios):.3f} "
        "new_length_extra_ms_max="
    ) in lines[-1]

    result = _bench("--model", "tiny", "--lengths", "64", "--profile", str(tmp_path / "none.json"))
    assert result.returncode == 2 and f"--profile {tmp_path / 'none.json'}: " in result.stderr
    assert "paradyse ms" not in result.stdout


def test_the_attention_cores_are_timed_on_sequence_major_inputs_as_the_strategies_hand_them_over():
    """On CUDA with ``CUDNN_LENGTH_BUCKETS`` set only such inputs run cuDNN's graphs by length bucket, as
    the training run's layers do."""
    from megatron_paradyse.bench import layer

    tensors = layer._qkv(layer.MODELS["tiny"].shape, 6, torch.float32, torch.device("cpu"))
    assert all(t.transpose(1, 2).is_contiguous() and t.requires_grad for t in tensors)
