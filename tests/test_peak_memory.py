"""The CPU peak counter's repeat rule (:func:`recurring_peak_bytes`): a late free only ever raises a run's
peak, so the work's own is the least peak, once it recurs."""

from __future__ import annotations

import pytest
import torch

from megatron_paradyse.core.memory import recurring_peak_bytes


def _work_peaking_at(*elements: int):
    """Work whose n-th run peaks at ``elements[n]`` float32 elements."""
    runs = iter(elements)

    def work() -> None:
        torch.empty(next(runs), dtype=torch.float32)

    return work


def test_the_least_peak_counts_once_two_runs_reach_it():
    assert recurring_peak_bytes(_work_peaking_at(300, 200, 100, 200, 100, 50)) == 400
    assert recurring_peak_bytes(_work_peaking_at(100, 100, 50)) == 400  # stops there


def test_work_whose_least_peak_never_recurs_is_named():
    with pytest.raises(RuntimeError) as err:
        recurring_peak_bytes(_work_peaking_at(300, 200, 100), most_runs=3)
    assert str(err.value) == "no two of 3 runs of the work peaked alike at the least: [400, 800, 1200] B"
