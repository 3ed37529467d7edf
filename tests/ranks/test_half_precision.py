"""Half-precision weights: no bf16 sum across ranks or hops, and gradients within bf16 round-off.

Wherever a strategy sums a weight's gradient over ranks (ZeRO-3's reduce-scatter, ``lean``
attention's reduce to a shard's owner, ``lean`` MLP's accumulator travelling around the ring) the
sum is kept in fp32, as Megatron keeps its main gradients, and rounded to bf16 once. On p=3 gloo
ranks every collective a strategy's backward issues is recorded with its dtype; and every rank's
weight gradients are compared with a float64 single-rank reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_paradyse.attention import get_kernel
from megatron_paradyse.core import comm
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.mcore.bare_layer import make_layer_params
from megatron_paradyse.strategies import AttentionContext, MLPContext, ModelShape, run_attention, run_mlp

P = 3
SHAPE = ModelShape(hidden_size=48, num_attention_heads=6, num_query_groups=3, kv_channels=8, ffn_hidden_size=72)
CASES = [
    ("attention", "ulysses"),
    ("attention", "ring"),
    ("attention", "lean"),
    ("mlp", "zero3"),
    ("mlp", "zero3_actrc"),
    ("mlp", "lean"),
]


def _recorded_backward(rank: int, p: int, sublayer: str, name: str, dtype: torch.dtype) -> tuple[list, list]:
    """Run one sublayer forward and backward; return (the collectives its backward issued, as
    (kind, dtype), and this rank's weight gradients in float64)."""
    layout = SequenceLayout.build(8 * p, p, causal=True)
    params = make_layer_params(SHAPE, p, rank, dtype=dtype, seed=3)
    group = dist.group.WORLD
    x = torch.randn(layout.local_len, 1, SHAPE.hidden_size, generator=torch.Generator().manual_seed(rank))
    x = x.to(dtype).requires_grad_()
    if sublayer == "attention":
        kernel = get_kernel("math", "cpu", dtype)
        ctx = AttentionContext(group=group, layout=layout, shape=SHAPE, kernel=kernel, softmax_scale=0.3)
        y = run_attention(name, x, params.attention, ctx)
        weights = params.attention
    else:
        y = run_mlp(name, x, params.mlp, MLPContext(group=group, shape=SHAPE, activation=F.gelu))
        weights = params.mlp
    calls = []
    reduce_scatter, reduce, send_recv = comm.reduce_scatter_single, dist.reduce, comm.RingComm.send_recv

    def record(kind, original):
        def wrapper(*args, **kwargs):
            tensor = args[1] if kind == "reduce_scatter" else args[0] if kind == "reduce" else args[1]
            calls.append((kind, tensor.dtype))
            return original(*args, **kwargs)

        return wrapper

    comm.reduce_scatter_single = record("reduce_scatter", reduce_scatter)
    dist.reduce = record("reduce", reduce)
    comm.RingComm.send_recv = record("send_recv", send_recv)
    try:
        y.float().square().sum().backward()
    finally:
        comm.reduce_scatter_single, dist.reduce, comm.RingComm.send_recv = reduce_scatter, reduce, send_recv
    grads = [getattr(weights, f).grad.double() for f in ("qkv", "proj") if sublayer == "attention"]
    grads += [getattr(weights, f).grad.double() for f in ("fc1", "fc2") if sublayer == "mlp"]
    return calls, grads


def _run(rank: int, p: int) -> dict:
    out = {}
    for sublayer, name in CASES:
        calls, bf16 = _recorded_backward(rank, p, sublayer, name, torch.bfloat16)
        _, fp64 = _recorded_backward(rank, p, sublayer, name, torch.float64)
        out[sublayer, name] = (calls, bf16, fp64)
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_run, P, timeout_s=300)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_weight_gradients_are_summed_in_fp32(results, case):
    sublayer, name = case
    for rank, per_rank in enumerate(results):
        calls, _, _ = per_rank[case]
        if name in ("ulysses", "ring", "zero3", "zero3_actrc"):  # two weights' and a bias's gradients reduce-scattered
            sums = [dtype for kind, dtype in calls if kind == "reduce_scatter"]
            assert len(sums) == 3, calls
        elif sublayer == "attention":  # lean: each head group's gradient reduced to its owner
            sums = [dtype for kind, dtype in calls if kind == "reduce"]
            assert len(sums) == P, calls
        else:  # lean MLP: p accumulator hops beside p - 1 hops of the bf16 shards
            hops = [dtype for kind, dtype in calls if kind == "send_recv"]
            sums = [dtype for dtype in hops if dtype != torch.bfloat16]
            assert len(hops) == 2 * P - 1 and len(sums) == P, calls
        assert sums and set(sums) == {torch.float32}, f"rank {rank}: {calls}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_bf16_weight_gradients_are_within_bf16_round_off(results, case):
    """Each rank's bf16 gradients against the same strategy in float64: relative to the largest
    entry, within a few bf16 ulps (2^-8) -- inputs, weights and products are rounded to bf16, sums
    across ranks are not."""
    for rank, per_rank in enumerate(results):
        _, bf16, fp64 = per_rank[case]
        for got, want in zip(bf16, fp64):
            assert (got - want).abs().max() <= 2**-5 * want.abs().max(), f"rank {rank}"
