"""The weight-streaming schedules of ``lean`` on p = 1..4 gloo ranks (odd p and p = 1 included: the
authors' METP schedules were wrong there): which shard each rank holds at each hop, that at most
two shards are resident, that shard gradients arrive at their owners summed over every rank, and
that no rank's own tensors are touched.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist

from megatron_paradyse.core.memory import recurring_peak_bytes
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.strategies.streaming import broadcast_shards, ring_shards

SCHEDULES = {"broadcast": broadcast_shards, "ring": ring_shards}
SHARD_BYTES = (6 + 4) * 4  # the flat message of one shard below: 10 fp32 values


def own_shard(rank: int) -> tuple:
    """Different on every rank, with an absent tensor in the middle (a bias-less layer)."""
    return (torch.arange(6.0).view(2, 3) + 100 * rank, None, torch.arange(4.0) - 10 * rank)


def _recording_hop(rank: int):
    """A hop that records what it was given and contributes ``(rank + 1) * shard_j`` to the gradient."""
    seen = []

    def hop(j, shard, grad):
        seen.append((j, tuple(None if t is None else t.clone() for t in shard)))
        for g, t in zip(grad, shard):
            if t is not None:
                g.add_(t, alpha=rank + 1)

    return hop, seen


def _yielding_hop(j, shard, grad) -> None:
    """Gives gloo's worker thread the GIL and a core to drop the last collective's buffers, as a device
    frees them at once (on four ranks over two cores it may otherwise not run before the next shard)."""
    time.sleep(0.001)


def _run_schedules(rank: int, p: int) -> dict:
    group = dist.group.WORLD
    own = own_shard(rank)
    results = {}
    for name, schedule in SCHEDULES.items():
        hop, seen = _recording_hop(rank)
        grad = schedule(own, group, hop, grads=True)
        # After one run without gradients, as layer measurements run once before measuring: the first such
        # run of a process held a finished broadcast's buffer until it returned (120 B for 80, every rank,
        # p = 3). Then the peak that recurs.
        schedule(own, group, _yielding_hop)
        forward, backward = (functools.partial(schedule, own, group, _yielding_hop, grads=g) for g in (False, True))
        peak_forward = recurring_peak_bytes(forward)
        peak_with_grads = recurring_peak_bytes(backward)
        results[name] = {
            "order": [j for j, _ in seen],
            "shards_match_owners": all(
                all(a is None and b is None or torch.equal(a, b) for a, b in zip(shard, own_shard(j)))
                for j, shard in seen
            ),
            "grad": grad,
            "peak_forward": peak_forward,
            "peak_with_grads": peak_with_grads,
        }
    results["own_unchanged"] = all(a is None or torch.equal(a, b) for a, b in zip(own, own_shard(rank)))
    return results


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda p: f"p{p}")
def launch(request):
    p = request.param
    return p, run_on_ranks(_run_schedules, p, timeout_s=120)


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_rank_holds_the_scheduled_shard(launch, name):
    p, per_rank = launch
    for rank, results in enumerate(per_rank):
        want = list(range(p)) if name == "broadcast" else [(rank - t) % p for t in range(p)]
        assert results[name]["order"] == want, f"rank {rank}"
        assert results[name]["shards_match_owners"], f"rank {rank}: a hop saw another shard than its owner's"
        assert results["own_unchanged"], f"rank {rank}: streaming changed the rank's own tensors"


@pytest.mark.parametrize("name", SCHEDULES)
def test_gradients_arrive_at_owner_summed_over_ranks(launch, name):
    p, per_rank = launch
    total = p * (p + 1) / 2  # sum over ranks r of (r + 1)
    for rank, results in enumerate(per_rank):
        grad = results[name]["grad"]
        assert grad[1] is None
        for g, w in zip(grad, own_shard(rank)):
            if w is not None:
                torch.testing.assert_close(g, total * w, rtol=0, atol=0)


@pytest.mark.parametrize("name", SCHEDULES)
def test_at_most_two_shards_resident(launch, name):
    p, per_rank = launch
    for rank, results in enumerate(per_rank):
        # The shard in use and the one in flight (one alone for p = 1).
        assert results[name]["peak_forward"] == min(p, 2) * SHARD_BYTES, f"rank {rank}"
        # Plus gradients: the one being filled and those in flight (a reduce, or one leaving and one
        # arriving on the ring), and the rank's own finished one; never all p shards and gradients.
        assert results[name]["peak_with_grads"] <= 5 * SHARD_BYTES, f"rank {rank}"
