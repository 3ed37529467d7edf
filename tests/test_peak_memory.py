"""The CPU peak counter's repeat rule (:func:`recurring_least`): a late free only ever raises a run's
figures, so the work's own are the least, once they recur; ranks run the work equally often."""

from __future__ import annotations

import pytest
import torch

from megatron_paradyse.core.memory import recurring_least, recurring_peak_bytes
from megatron_paradyse.core.multiprocess import run_on_ranks


def _work_peaking_at(*elements: int):
    """Work whose n-th run peaks at ``elements[n]`` float32 elements."""
    runs = iter(elements)

    def work() -> None:
        torch.empty(next(runs), dtype=torch.float32)

    return work


def test_the_least_peak_counts_once_two_runs_reach_it():
    assert recurring_peak_bytes(_work_peaking_at(300, 200, 100, 200, 100, 50)) == 400
    assert recurring_peak_bytes(_work_peaking_at(100, 100, 50)) == 400  # stops there


def test_every_figure_recurs_or_the_runs_run_out():
    runs = iter([(5, 9), (5, 7), (6, 7), (5, 1)])
    assert recurring_least(lambda: next(runs)) == (5, 7)  # the first figure recurred at once, the second later
    assert recurring_peak_bytes(_work_peaking_at(300, 200, 100), most_runs=3) == 400  # the least of three
    with pytest.raises(ValueError) as err:
        recurring_least(lambda: (1,), most_runs=0)
    assert str(err.value) == "most_runs must be at least 1, got 0"


def _runs_on_rank(rank: int, world_size: int) -> int:
    """Rank 0's least recurs at the second run, rank 1's at the fourth: both run four times."""
    figures = {0: [3, 3, 3, 3, 3], 1: [4, 3, 5, 3, 3]}[rank]
    done = []

    def measure() -> tuple[int]:
        done.append(figures[len(done)])
        return (done[-1],)

    assert recurring_least(measure) == (3,)
    return len(done)


def test_every_rank_runs_as_often():
    assert run_on_ranks(_runs_on_rank, 2) == [4, 4]
