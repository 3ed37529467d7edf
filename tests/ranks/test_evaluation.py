"""Forward-only planning (validation and test): what a no-grad forward of each layer option holds on
real gloo ranks never exceeds what :class:`~megatron_paradyse.planner.planner.ForwardOnlyCost` prices
for it, in fp32, bf16 and fp16, and forward-only plans are at most as heavy as training's.

The whole evaluation path (held-out documents, Megatron's validation loop, restarts) runs in
``tests/e2e/test_pretrain_gpt.py``.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_paradyse.attention import get_kernel
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.memory import _StorageTracker
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.base import LayerCost
from megatron_paradyse.cost.terms import layer_terms
from megatron_paradyse.mcore.bare_layer import make_layer_params, run_layer
from megatron_paradyse.planner.planner import ForwardOnlyCost
from megatron_paradyse.strategies import AttentionContext, MLPContext
from megatron_paradyse.strategies.dims import Dims

from helpers.memory_cells import DTYPES, model_shape

P = 2
SHAPE = model_shape("gqa", P)
LAYOUT = SequenceLayout.build((41, 17 * P, 6), P, causal=True)
OPTIONS = [
    LayerOption(a, m, rc)
    for a in ("tp_sp", "ulysses", "ring", "lean")
    for m in ("tp_sp", "zero3", "lean")
    for rc in (False, True)
]


class _ScriptedTraining:
    """The part of a training cost model :class:`ForwardOnlyCost` reads, priced by the memory scripts
    of ``rank`` (what :class:`~megatron_paradyse.cost.AnalyticCostModel` prices per rank)."""

    def __init__(self, element_size: int, rank: int) -> None:
        self.shape, self.p, self.element_size, self.rank = SHAPE, P, element_size, rank

    def layer_cost(self, option: LayerOption, layout: SequenceLayout, micro_batch_size: int) -> LayerCost:
        d = Dims(SHAPE, P, layout.padded_len, micro_batch_size, self.element_size, bias=True)
        terms = layer_terms(option, d, layout, self.rank)
        return LayerCost(0.0, terms.saved_bytes, terms.peak_bytes - terms.saved_bytes)


def _forward_peaks(rank: int, p: int) -> dict[tuple[str, str], tuple[int, float]]:
    """(measured, priced) bytes of each option's no-grad forward on this rank: its input, what the forward
    allocates at its high-water mark, against the held activation plus the priced working set."""
    out = {}
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # gloo's thread drops a finished collective's buffers when the code does
    for name, dtype in DTYPES.items():
        params = make_layer_params(SHAPE, p, rank, dtype=dtype)
        actx = AttentionContext(
            group=dist.group.WORLD,
            layout=LAYOUT,
            shape=SHAPE,
            kernel=get_kernel("torch", "cpu", dtype),
            softmax_scale=0.125,
        )
        mctx = MLPContext(group=dist.group.WORLD, shape=SHAPE, activation=F.silu)
        x0 = torch.randn(LAYOUT.local_len, 1, SHAPE.hidden_size).to(dtype)
        cost = ForwardOnlyCost(_ScriptedTraining(dtype.itemsize, rank))
        for option in OPTIONS:
            with torch.no_grad(), _StorageTracker() as tracker:
                x = x0.clone()
                y = run_layer(x, params, option, actx, mctx)
                del x, y
            priced = cost.activation_bytes(LAYOUT, 1) + cost.layer_cost(option, LAYOUT, 1).transient_bytes
            out[(name, str(option))] = (tracker.peak, priced)
    sys.setswitchinterval(interval)
    return out


@pytest.fixture(scope="module")
def forward_peaks() -> list[dict]:
    return run_on_ranks(_forward_peaks, P)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_no_grad_forward_holds_no_more_than_forward_only_pricing(forward_peaks, dtype):
    for rank, peaks in enumerate(forward_peaks):
        over = {
            option: (measured, priced)
            for (name, option), (measured, priced) in peaks.items()
            if name == dtype and measured > priced
        }
        assert not over, f"rank {rank}: measured over priced bytes: {over}"
        # the bound is not vacuous: some option's forward reaches past a third of what is priced
        assert max(m / p for (name, _), (m, p) in peaks.items() if name == dtype) > 1 / 3


def test_forward_only_plans_keep_nothing_between_layers():
    cost = ForwardOnlyCost(_ScriptedTraining(2, rank=0))
    training = cost.training
    for option in OPTIONS:
        forward, backward = cost.layer_cost(option, LAYOUT, 1), training.layer_cost(option, LAYOUT, 1)
        assert forward.saved_bytes == 0
        assert forward.transient_bytes == backward.saved_bytes + backward.transient_bytes
