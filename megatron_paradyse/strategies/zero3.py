"""``zero3``: token-local MLP with ZeRO-3 weights.

The MLP needs no other token, so each rank runs its own ``s/p`` tokens through the full weights,
all-gathered from the TP shards for each GEMM (again in backward: nothing full is saved); the weight
gradients are reduce-scattered back. No activation crosses the wire. fc2's weight is gathered while
fc1's GEMM runs (:class:`~megatron_paradyse.core.comm.Zero3Gathers`), fc1's during the attention where
the attention strategy starts it (``ulysses``, ``ring``: ``Strategy.starts_mlp_gather``); in backward
each weight is gathered behind its gradient's GEMM and that gradient reduce-scattered behind the input
gradient's.
The transient cost is up to both gathered weights in forward, one and its full gradient in backward.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_paradyse.core.comm import Zero3Gathers, zero3_linear
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.strategies.allocations import (
    Allocations,
    SublayerMemory,
    sublayer_memory_of,
)
from megatron_paradyse.strategies.base import MLPContext, MLPWeights, Strategy
from megatron_paradyse.strategies.common import activate, add_bias
from megatron_paradyse.strategies.dims import Dims
from megatron_paradyse.strategies.linear_allocations import (
    activation_backward,
    activation_forward,
    add_bias_memory,
    bias_grad,
    zero3_backward,
    zero3_forward,
)
from megatron_paradyse.strategies.registry import register
from megatron_paradyse.strategies.terms import (
    Gemm,
    SublayerTerms,
    gathered_weight,
)


def weight_gathers(w: MLPWeights, group: ProcessGroup) -> Zero3Gathers:
    """fc1's and fc2's weights, in forward order; fc2's gathered while fc1's GEMM runs."""
    return Zero3Gathers([(w.fc1, 0), (w.fc2, 1)], group)


def mlp(x_local: Tensor, w: MLPWeights, ctx: MLPContext) -> Tensor:
    group = ctx.group
    gathers = ctx.gathers if ctx.gathers is not None else weight_gathers(w, group)
    h = zero3_linear(x_local, w.fc1, w.fc1_bias, group, dim=0, gathers=gathers, index=0)
    h = activate(h, ctx.shape, ctx.activation, blocks=group.size())  # [s/p, b, ffn], rank order
    return add_bias(zero3_linear(h, w.fc2, None, group, dim=1, gathers=gathers, index=1), w.fc2_bias)


# -- what it costs: time terms (priced by cost.analytic) and memory (composed by cost.layer_memory) --
def mlp_terms(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    """fc2's weight gathered while fc1 computes (``Zero3Gathers``): that gather streams beside the forward
    pass, the backward's gathers and reduce-scatters beside the backward's GEMMs; fc1's forward gather
    is waited for, unless the attention ran it (:attr:`Dims.mlp_weight_ahead`)."""
    t, b, e = d.t, d.b, d.e
    (fc1_gather,), fc1_bwd = gathered_weight(d.f1 * d.h * e, d)
    (fc2_gather,), fc2_bwd = gathered_weight(d.h * d.f * e, d)
    return SublayerTerms(
        gemms=(Gemm(t * b, d.f1, d.h), Gemm(t * b, d.h, d.f)),
        fwd_comm=() if d.mlp_weight_ahead else (fc1_gather,),
        fwd_streamed=(fc2_gather,),
        bwd_streamed=(*fc2_bwd, *fc1_bwd),
        elementwise_bytes=3 * t * b * d.f1 * e,
    )


def mlp_memory(d: Dims, layout: SequenceLayout, rank: int) -> SublayerMemory:
    t, b, e = d.t, d.b, d.e
    w1, w2, b1 = d.f1 * d.h * e, d.h * d.f * e, d.f1 * e if d.bias else 0.0

    # fc1's weight gathered during the attention (where the layer does), fc2's during fc1's GEMM (Zero3Gathers)
    fwd = Allocations(x_local=d.x, **({"fc1_w": w1} if d.mlp_weight_ahead else {}))
    ahead = d.mlp_weight_ahead
    zero3_forward(fwd, d, "fc1", "fc1_out", t * b * d.f1 * e, w1, bias=b1, gathered=ahead, ahead=("fc2", w2))
    activation_forward(fwd, d, t, d.f)
    zero3_forward(fwd, d, "fc2", "fc2_out", d.x, w2, row=True, gathered=True)
    add_bias_memory(fwd, d, "fc2_out")
    saved = fwd.returns("y_local", "x_local", "fc1_out", "act_out")

    bwd = Allocations(d, dy_local=0.0, **saved)
    bias_grad(bwd, d, d.bias)
    zero3_backward(
        bwd, d, "fc2", "d_act", t * b * d.f * e, w2, row=True, release=("act_out",), uses_output_gradient=True
    )
    d_fc1 = activation_backward(bwd, d, t, d.f, d_act="d_act", fc1_out="fc1_out")
    zero3_backward(bwd, d, "fc1", "dx_local", d.x, w1, bias=b1, release=(d_fc1, "x_local"))
    return sublayer_memory_of(fwd.peak, bwd, saved)


register(
    Strategy(
        name="zero3",
        sublayer="mlp",
        forward=mlp,
        terms=mlp_terms,
        memory=mlp_memory,
        weight_gathers=weight_gathers,
        summary="ZeRO-3: token-local on s/p tokens; fc1/fc2 gathered, gradients reduce-scattered",
    )
)
