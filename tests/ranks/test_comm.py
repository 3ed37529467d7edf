"""Autograd collectives on real gloo ranks: forward and backward against what each rank can rebuild.

Every rank draws every rank's tensors from the same seeds, so it knows the exact expected result of
each collective and of its adjoint without trusting any other collective.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_paradyse.core.comm import (
    RingComm,
    StepGroup,
    all_gather_seq,
    all_to_all_heads_to_seq,
    all_to_all_seq_to_heads,
    reduce_scatter_seq,
    warm_communicators,
    zero3_linear,
)
from megatron_paradyse.core.multiprocess import run_on_ranks

S_LOCAL, B, W = 3, 2, 4


def _draw(tag: str, rank: int, *shape) -> torch.Tensor:
    # str hashes are salted per process; every rank must draw the same numbers.
    seed = sum(ord(c) * 31**i for i, c in enumerate(tag)) * 1009 + rank
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed % (2**31)), dtype=torch.float64)


def _check(op, inputs, grads, expected_out, expected_grad_in) -> bool:
    x = inputs.clone().requires_grad_()
    out = op(x)
    out.backward(grads)
    # Exact up to the order in which a collective sums float64 partials.
    close = dict(rtol=0, atol=1e-12)
    return torch.allclose(out.detach(), expected_out, **close) and torch.allclose(x.grad, expected_grad_in, **close)


def _collective_cases(rank: int, p: int) -> dict[str, bool]:
    group = dist.group.WORLD
    ranks = range(p)
    results = {}

    # all_gather_seq: [s/p, b, w] -> [s, b, w]; adjoint sums every rank's gradient of my slice.
    xs = [_draw("ag", r, S_LOCAL, B, W) for r in ranks]
    gs = [_draw("ag-grad", r, p * S_LOCAL, B, W) for r in ranks]
    mine = slice(rank * S_LOCAL, (rank + 1) * S_LOCAL)
    results["all_gather_seq"] = _check(
        lambda x: all_gather_seq(x, group), xs[rank], gs[rank], torch.cat(xs), sum(g[mine] for g in gs)
    )

    # reduce_scatter_seq: [s, b, w] partial sums -> my reduced slice; adjoint all-gathers.
    xs = [_draw("rs", r, p * S_LOCAL, B, W) for r in ranks]
    gs = [_draw("rs-grad", r, S_LOCAL, B, W) for r in ranks]
    results["reduce_scatter_seq"] = _check(
        lambda x: reduce_scatter_seq(x, group), xs[rank], gs[rank], sum(xs)[mine], torch.cat(gs)
    )

    # seq -> heads: rank r receives column chunk r of every rank's tokens, in rank (canonical) order.
    xs = [_draw("a2a", r, S_LOCAL, B, p * W) for r in ranks]
    gs = [_draw("a2a-grad", r, p * S_LOCAL, B, W) for r in ranks]
    cols = slice(rank * W, (rank + 1) * W)
    results["all_to_all_seq_to_heads"] = _check(
        lambda x: all_to_all_seq_to_heads(x, group),
        xs[rank],
        gs[rank],
        torch.cat([x[:, :, cols] for x in xs]),
        torch.cat([g[mine] for g in gs], dim=2),
    )
    # heads -> seq is its inverse (and so is its adjoint).
    ys = [_draw("a2a-back", r, p * S_LOCAL, B, W) for r in ranks]
    gs = [_draw("a2a-back-grad", r, S_LOCAL, B, p * W) for r in ranks]
    results["all_to_all_heads_to_seq"] = _check(
        lambda y: all_to_all_heads_to_seq(y, group),
        ys[rank],
        gs[rank],
        torch.cat([y[mine] for y in ys], dim=2),
        torch.cat([g[:, :, cols] for g in gs]),
    )

    # zero3_linear: x W^T + b with W gathered from shards (column: dim 0, row: dim 1); the shards'
    # gradients are the sums over every rank's tokens.
    for dim in (0, 1):
        shards = [_draw(f"w{dim}", r, 6, 4) for r in ranks]
        w_full = torch.cat(shards, dim=dim)
        bias = [_draw(f"b{dim}", r, 6) for r in ranks] if dim == 0 else None
        xs = [_draw(f"x{dim}", r, S_LOCAL, B, w_full.shape[1]) for r in ranks]
        gs = [_draw(f"y{dim}-grad", r, S_LOCAL, B, w_full.shape[0]) for r in ranks]
        x = xs[rank].clone().requires_grad_()
        w = shards[rank].clone().requires_grad_()
        b = bias[rank].clone().requires_grad_() if bias else None
        y = zero3_linear(x, w, b, group, dim)
        y.backward(gs[rank])
        b_full = torch.cat(bias) if bias else None
        dw_full = sum(g.reshape(-1, g.shape[-1]).t() @ xr.reshape(-1, xr.shape[-1]) for g, xr in zip(gs, xs))
        close = dict(rtol=0, atol=1e-12)
        results[f"zero3_linear_dim{dim}"] = (
            torch.allclose(y.detach(), torch.nn.functional.linear(xs[rank], w_full, b_full), **close)
            and torch.allclose(x.grad, gs[rank] @ w_full, **close)
            and torch.allclose(w.grad, dw_full.chunk(p, dim=dim)[rank], **close)
            and (b is None or torch.allclose(b.grad, sum(g.sum(dim=(0, 1)) for g in gs).chunk(p)[rank], **close))
        )

    # RingComm: a block arrives from the previous rank; misuse is refused.
    ring = RingComm(group)
    received = ring.send_recv(torch.full((2,), float(rank)))
    try:
        ring.send_recv(torch.zeros(2))
        double_send_refused = False
    except RuntimeError as e:
        double_send_refused = "wait() first" in str(e)
    ring.wait()
    results["ring_receives_from_previous"] = received.tolist() == [float((rank - 1) % p)] * 2
    results["ring_refuses_second_transfer"] = double_send_refused
    try:
        ring.wait()
        results["ring_refuses_wait_without_transfer"] = False
    except RuntimeError as e:
        results["ring_refuses_wait_without_transfer"] = "no transfer in flight" in str(e)

    # warm_communicators: each group's transfers once (point-to-point to the next and previous rank, or to all),
    # matched on every rank (a transfer left unmatched hangs until the launch times out); which groups and
    # peers a step needs warmed is tests/e2e/test_communicators.py's
    other = dist.new_group(list(ranks))
    warm_communicators([StepGroup(group, "neighbours"), StepGroup(other, "all"), StepGroup(group, "none")], x.device)
    count = torch.ones(1)
    dist.all_reduce(count, group=group)
    results["warm_communicators_completes_on_every_rank"] = count.item() == p
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"p{p}")
def collective_results(request):
    return run_on_ranks(_collective_cases, request.param, timeout_s=300)


@pytest.mark.parametrize(
    "name",
    [
        "all_gather_seq",
        "reduce_scatter_seq",
        "all_to_all_seq_to_heads",
        "all_to_all_heads_to_seq",
        "zero3_linear_dim0",
        "zero3_linear_dim1",
        "ring_receives_from_previous",
        "ring_refuses_second_transfer",
        "ring_refuses_wait_without_transfer",
        "warm_communicators_completes_on_every_rank",
    ],
)
def test_collective_forward_and_adjoint(collective_results, name):
    assert all(results[name] for results in collective_results), [r[name] for r in collective_results]


def test_group_of_one_is_the_identity():
    """No process group is touched when p=1: the same tensor comes back (or a plain GEMM)."""

    class One:
        def size(self):
            return 1

    x = torch.randn(4, 2, 6)
    assert all_gather_seq(x, One()) is x
    assert reduce_scatter_seq(x, One()) is x
    assert all_to_all_seq_to_heads(x, One()) is x
    w = x[0]
    torch.testing.assert_close(zero3_linear(x, w, None, One(), dim=1), x @ w.t(), rtol=0, atol=0)


def test_bad_shapes_are_refused_before_any_communication():
    class Three:
        def size(self):
            return 3

    with pytest.raises(ValueError, match=r"expected \[s/p, b, w\] with w divisible by p=3, got \(4, 2, 5\)"):
        all_to_all_seq_to_heads(torch.zeros(4, 2, 5), Three())
    with pytest.raises(ValueError, match=r"expected \[s, b, w\] with s divisible by p=3, got \(4, 2, 6\)"):
        all_to_all_heads_to_seq(torch.zeros(4, 2, 6), Three())
    with pytest.raises(ValueError, match=r"zero3_linear takes a 2-D shard split on dim 0 or 1, got \(2, 2, 2\), dim=1"):
        zero3_linear(torch.zeros(2, 2), torch.zeros(2, 2, 2), None, Three(), dim=1)
    with pytest.raises(ValueError, match=r"only a column-parallel \(dim 0\) linear has a sharded bias"):
        zero3_linear(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2), Three(), dim=1)
