"""``bench costmodel``'s rank agreement of predicted and measured times (pure: no ranks, no timing)."""

from __future__ import annotations

import math

import pytest

from megatron_paradyse.bench.costmodel import RankAgreement, length_line, main, rank_agreement, summary_line


def test_identical_order_gives_tau_one_and_every_pair_right():
    agreement = rank_agreement([1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 25.0, 90.0])
    assert agreement == RankAgreement(options=4, tau=1.0, pairs_correct=6, pairs=6)


def test_reversed_order_gives_tau_minus_one_and_no_pair_right():
    agreement = rank_agreement([4.0, 3.0, 2.0, 1.0], [10.0, 20.0, 25.0, 90.0])
    assert agreement == RankAgreement(options=4, tau=-1.0, pairs_correct=0, pairs=6)


def test_ties_by_hand():
    # pairs (i, j) of predicted [1, 2, 2, 3] and measured [1, 3, 2, 2]:
    #   (0,1) 1<2, 1<3 concordant    (0,2) 1<2, 1<2 concordant    (0,3) 1<3, 1<2 concordant
    #   (1,2) 2=2 tied in predicted  (1,3) 2<3, 3>2 discordant    (2,3) 2<3, 2=2 tied in measured
    # n0 = 6, n1 (predicted ties) = 1, n2 (measured ties) = 1, concordant 3, discordant 1:
    # tau_b = (3 - 1) / sqrt((6 - 1) * (6 - 1)) = 2 / 5 = 0.4 (tau-a would be 2 / 6)
    # pairs: 6 - 1 measured tie = 5; right: the 3 concordant ((1,2), tied in predicted only, is wrong)
    agreement = rank_agreement([1.0, 2.0, 2.0, 3.0], [1.0, 3.0, 2.0, 2.0])
    assert agreement.tau == pytest.approx(0.4, abs=1e-12)
    assert (agreement.options, agreement.pairs_correct, agreement.pairs) == (4, 3, 5)


def test_pair_share_leaves_out_measured_ties_only():
    # measured: options 0 and 1 tied, 2 slower; the prediction orders 0 < 1 < 2 strictly
    agreement = rank_agreement([1.0, 2.0, 3.0], [5.0, 5.0, 9.0])
    assert (agreement.pairs_correct, agreement.pairs) == (2, 2)
    # tied in both: still left out of the pair share
    agreement = rank_agreement([1.0, 1.0, 3.0], [5.0, 5.0, 9.0])
    assert (agreement.pairs_correct, agreement.pairs) == (2, 2)
    assert agreement.tau == pytest.approx(1.0)
    # tied in prediction only: a pair the model does not order, so wrong
    agreement = rank_agreement([1.0, 1.0, 3.0], [5.0, 6.0, 9.0])
    assert (agreement.pairs_correct, agreement.pairs) == (2, 3)
    assert agreement.tau == pytest.approx(2 / math.sqrt(2 * 3))


@pytest.mark.parametrize("n", [0, 1])
def test_fewer_than_two_options_give_nan_and_no_pairs(n):
    agreement = rank_agreement([1.0] * n, [2.0] * n)
    assert agreement.options == n
    assert math.isnan(agreement.tau)
    assert (agreement.pairs_correct, agreement.pairs) == (0, 0)


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError):
        rank_agreement([1.0, 2.0], [1.0])


def test_length_line_format():
    assert (
        length_line(512, RankAgreement(options=4, tau=0.4, pairs_correct=3, pairs=5))
        == "length=512 options=4 kendall_tau=0.400 pairs_ordered=3/5 (60.0%)"
    )
    assert length_line(256, rank_agreement([1.0], [1.0])).startswith("length=256 options=1 kendall_tau=nan")


def test_summary_line_keys_in_order_worst_tau_and_pooled_pairs():
    agreements = [
        RankAgreement(options=1, tau=math.nan, pairs_correct=0, pairs=0),  # skipped (first: min() would keep a nan)
        RankAgreement(options=4, tau=0.4, pairs_correct=3, pairs=5),
        RankAgreement(options=3, tau=1.0, pairs_correct=3, pairs=3),
    ]
    line = summary_line(8.66, 0.0, agreements)
    assert line == "time_mape=8.7 mem_mape=0.0 rank_tau_min=0.400 pairs_ordered=0.750"
    assert [field.split("=")[0] for field in line.split()] == ["time_mape", "mem_mape", "rank_tau_min", "pairs_ordered"]


def test_summary_line_with_nothing_to_rank():
    assert summary_line(1.0, 2.0, [rank_agreement([], [])]) == (
        "time_mape=1.0 mem_mape=2.0 rank_tau_min=nan pairs_ordered=nan"
    )


def test_save_profile_is_refused_beside_a_given_profile(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--profile", "given.json", "--save-profile", "kept.json"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.endswith(
        "error: --save-profile keeps the profile calibrated here; with --profile nothing is calibrated\n"
    )
