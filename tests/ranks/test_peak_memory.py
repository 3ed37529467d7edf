"""The CPU peak counter around gloo: a collective's buffers are freed when the code drops them (the tracker
waits for gloo to let go), and the repeat rule (:func:`recurring_least`) for what else a late free can
raise: the work's own figures are the least, once they recur; ranks run the work equally often."""

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


def _peaks_around_collectives(rank: int, world_size: int) -> dict:
    """Peaks of work that drops a collective's buffer and then allocates, with threads switching at
    Python's default interval: gloo's worker thread, which holds the buffer a moment longer, would free
    it late now and then, were the collective not waited for until gloo lets go of it."""
    import torch.distributed as dist

    from megatron_paradyse.core.comm import all_gather_single
    from megatron_paradyse.core.memory import PeakMemory

    n = 1 << 14  # elements per buffer

    def dropped_then_allocated(collective, dtype: torch.dtype) -> int:
        with PeakMemory() as memory:
            buffer = torch.ones(n, dtype=dtype)
            collective(buffer)
            del buffer
            torch.empty(n, dtype=dtype)
        return memory.peak_bytes

    def gathered(buffer: torch.Tensor) -> None:
        gathered.out = torch.empty(n * world_size, dtype=buffer.dtype)
        all_gather_single(gathered.out, buffer, async_op=True).wait()

    peaks = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        peaks[str(dtype), "all_reduce"] = [dropped_then_allocated(dist.all_reduce, dtype) for _ in range(40)]
        peaks[str(dtype), "all_gather, async"] = [dropped_then_allocated(gathered, dtype) for _ in range(40)]
        assert torch.equal(gathered.out, torch.ones(n * world_size, dtype=dtype))
    ring = torch.full((4,), float(rank))  # point-to-point, crossing: left to run as it is
    with PeakMemory():
        sent = dist.isend(ring, (rank + 1) % world_size)
        received = torch.empty(4)
        dist.recv(received, (rank - 1) % world_size)
        sent.wait()
    assert torch.equal(received, torch.full((4,), float((rank - 1) % world_size)))
    return {name: sorted(set(values)) for name, values in peaks.items()}


def test_a_collectives_buffer_is_freed_when_the_code_drops_it():
    expected = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        one = (1 << 14) * dtype.itemsize
        expected[str(dtype), "all_reduce"] = [one]
        expected[str(dtype), "all_gather, async"] = [one * 3]
    assert run_on_ranks(_peaks_around_collectives, 2) == [expected] * 2
