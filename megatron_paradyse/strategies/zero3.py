"""``zero3``: token-local MLP with ZeRO-3 weights.

The MLP needs no other token, so each rank runs its own ``s/p`` tokens through the full weights,
all-gathered from the TP shards for each GEMM (again in backward: nothing full is saved); the weight
gradients are reduce-scattered back. No activation crosses the wire. fc2's weight is gathered while
fc1's GEMM runs (:class:`~megatron_paradyse.core.comm.Zero3Gathers`), fc1's during the attention where
the attention strategy starts it (``ulysses``, ``ring``: ``Strategy.starts_mlp_gather``); in backward
each weight is gathered behind its gradient's GEMM and that gradient reduce-scattered behind the input
gradient's. Kept for backward: fc1's input and output, and fc2's input, the activation's output; but
under ``zero3_actrc`` (activation recompute) fc2's input is recomputed from fc1's output there, one
elementwise pass more for one ``[s/p, b, ffn]`` less, which the planner weighs per layer.
The transient cost is up to both gathered weights in forward, one and its full gradient in backward.
"""

from __future__ import annotations

import functools

from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_paradyse.core.comm import Zero3Gathers, zero3_linear
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.strategies.base import MLPContext, MLPWeights, Strategy
from megatron_paradyse.strategies.common import activate, add_bias
from megatron_paradyse.strategies.dims import Dims
from megatron_paradyse.strategies.registry import register
from megatron_paradyse.strategies.terms import (
    Gemm,
    SublayerTerms,
    gathered_weight,
)


def weight_gathers(w: MLPWeights, group: ProcessGroup) -> Zero3Gathers:
    """fc1's and fc2's weights, in forward order; fc2's gathered while fc1's GEMM runs."""
    return Zero3Gathers([(w.fc1, 0), (w.fc2, 1)], group)


def mlp(x_local: Tensor, w: MLPWeights, ctx: MLPContext, *, recompute_activation: bool) -> Tensor:
    group = ctx.weights_over
    gathers = ctx.gathers if ctx.gathers is not None else weight_gathers(w, group)
    h = zero3_linear(x_local, w.fc1, w.fc1_bias, group, dim=0, gathers=gathers, index=0)
    act = functools.partial(activate, shape=ctx.shape, activation=ctx.activation, blocks=group.size())
    # recompute_activation: fc2's input ([s/p, b, ffn], rank order) is recomputed in backward from fc1's
    # output, which the activation keeps anyway
    input_from = (h, act) if recompute_activation else None
    y = zero3_linear(act(h), w.fc2, None, group, dim=1, gathers=gathers, index=1, input_from=input_from)
    return add_bias(y, w.fc2_bias)


# -- what it costs: time terms (priced by cost.analytic) and memory (composed by cost.layer_memory) --
def mlp_terms(d: Dims, layout: SequenceLayout, rank: int, *, recompute_activation: bool) -> SublayerTerms:
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
        # the activation, forward and backward; recomputed (p > 1), fc1's output read and fc2's input written
        elementwise_bytes=3 * t * b * d.f1 * e
        + (t * b * (d.f1 + d.f) * e if _recomputes(d, recompute_activation) else 0),
    )


def _recomputes(d: Dims, recompute_activation: bool) -> bool:
    """fc2's input is recomputed in backward (at ``p = 1`` ``zero3_linear`` is a plain linear: kept)."""
    return recompute_activation and d.p > 1


for name, recompute_activation, kept in (("zero3", False, "keeps"), ("zero3_actrc", True, "recomputes")):
    register(
        Strategy(
            name=name,
            sublayer="mlp",
            forward=functools.partial(mlp, recompute_activation=recompute_activation),
            terms=functools.partial(mlp_terms, recompute_activation=recompute_activation),
            weight_gathers=weight_gathers,
            runs_on_subgroup=True,
            summary=f"ZeRO-3: token-local on s/p tokens; fc1/fc2 gathered, gradients reduce-scattered; {kept} "
            "fc2's input",
        )
    )
