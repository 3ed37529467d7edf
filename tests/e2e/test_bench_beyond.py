"""``python -m megatron_paradyse.bench beyond``: on 2 gloo ranks, a sequence no plan fits with Megatron's
loss trains under the same budget with the loss in chunks, and one no plan fits on device memory alone
trains with layer inputs offloaded to host memory, and one no plan with whole MLPs fits trains with MLPs in
tiles, each measured peak the predicted one."""

from __future__ import annotations

import re

import pytest

from megatron_paradyse.bench import beyond


def test_a_sequence_beyond_the_whole_loss_trains_within_budget(capsys):
    assert beyond.main(["--tokens", "2048", "--vocab", "16384"]) == 0
    out = capsys.readouterr().out
    assert "Megatron's loss: the leanest plan peaks at" in out and "does not fit" in out
    fields = dict(kv.split("=") for kv in out.strip().splitlines()[-1].split())
    assert list(fields) == [
        "unchunked_max_len",
        "chunked_max_len",
        "trained_len",
        "predicted_peak_mib",
        "measured_peak_mib",
        "budget_mib",
    ]
    assert int(fields["unchunked_max_len"]) < int(fields["trained_len"]) <= int(fields["chunked_max_len"])
    measured, predicted = float(fields["measured_peak_mib"]), float(fields["predicted_peak_mib"])
    assert measured <= float(fields["budget_mib"])
    assert abs(predicted / measured - 1) <= 0.01
    assert re.search(r"plan .*; loss in 512-token chunks", out)
    _assert_it_trains(out)


def _assert_it_trains(out: str) -> None:
    """The SGD steps from the measured one on lower the loss, step after step (the loss before the first and
    after each)."""
    losses = [float(v) for v in re.search(r"SGD steps \(lr [\d.]+\): loss (.*)", out)[1].split(" -> ")]
    assert len(losses) == beyond.TRAIN_STEPS + 1 and all(a > b for a, b in zip(losses, losses[1:])), losses


def test_a_sequence_beyond_device_memory_trains_with_offload_within_budget(capsys):
    assert beyond.main(["--lever", "offload", "--vocab", "1024", "--tokens", "8192"]) == 0
    out = capsys.readouterr().out
    assert "device memory only: the leanest plan peaks at" in out and "does not fit" in out
    fields = dict(kv.split("=") for kv in out.strip().splitlines()[-1].split())
    assert list(fields)[:2] == ["device_max_len", "offload_max_len"] and list(fields)[-1] == "host_mib"
    assert int(fields["device_max_len"]) < int(fields["trained_len"]) <= int(fields["offload_max_len"])
    measured, predicted = float(fields["measured_peak_mib"]), float(fields["predicted_peak_mib"])
    assert measured <= float(fields["budget_mib"]) and abs(predicted / measured - 1) <= 0.01
    assert re.search(r"plan .*\+rc\+off", out)
    # what went to the host: the offloaded layers' inputs, as the model counts them
    host = re.search(r"host memory \(offloaded layer inputs\): predicted ([\d.]+) MiB, measured ([\d.]+) MiB", out)
    assert host and float(host[2]) > 0 and host[1] == host[2] == fields["host_mib"]
    _assert_it_trains(out)


def test_a_sequence_beyond_whole_mlps_trains_with_mlps_in_tiles_within_budget(capsys):
    assert beyond.main(["--lever", "tile", "--vocab", "1024", "--tokens", "8192"]) == 0
    out = capsys.readouterr().out
    assert "whole MLPs: the leanest plan peaks at" in out and "does not fit" in out
    fields = dict(kv.split("=") for kv in out.strip().splitlines()[-1].split())
    assert int(fields["untiled_max_len"]) < int(fields["trained_len"]) <= int(fields["tiled_max_len"])
    measured, predicted = float(fields["measured_peak_mib"]), float(fields["predicted_peak_mib"])
    assert measured <= float(fields["budget_mib"]) and abs(predicted / measured - 1) <= 0.01
    assert re.search(r"plan .*\+tile512", out)
    _assert_it_trains(out)


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--vocab", "1000"], "--vocab must be a positive multiple of 128 x tp = 256"), (["--tokens", "0"], "--tokens")],
)
def test_bad_arguments_exit_2_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        beyond.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
