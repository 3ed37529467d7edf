"""``python -m megatron_paradyse.bench beyond``: on 2 gloo ranks, a sequence no plan fits with Megatron's
loss trains under the same budget with the loss in chunks, its measured peak the predicted one."""

from __future__ import annotations

import re

import pytest

from megatron_paradyse.bench import beyond


def test_a_sequence_beyond_the_whole_loss_trains_within_budget(capsys):
    assert beyond.main([]) == 0
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


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--vocab", "1000"], "--vocab must be a positive multiple of 128 x tp = 256"), (["--tokens", "0"], "--tokens")],
)
def test_bad_arguments_exit_2_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        beyond.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
