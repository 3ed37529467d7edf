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
from megatron_paradyse.strategies.base import MLPContext, MLPWeights, Strategy
from megatron_paradyse.strategies.common import activate, add_bias
from megatron_paradyse.strategies.registry import register


def weight_gathers(w: MLPWeights, group: ProcessGroup) -> Zero3Gathers:
    """fc1's and fc2's weights, in forward order; fc2's gathered while fc1's GEMM runs."""
    return Zero3Gathers([(w.fc1, 0), (w.fc2, 1)], group)


def mlp(x_local: Tensor, w: MLPWeights, ctx: MLPContext) -> Tensor:
    group = ctx.group
    gathers = ctx.gathers if ctx.gathers is not None else weight_gathers(w, group)
    h = zero3_linear(x_local, w.fc1, w.fc1_bias, group, dim=0, gathers=gathers, index=0)
    h = activate(h, ctx.shape, ctx.activation, blocks=group.size())  # [s/p, b, ffn], rank order
    return add_bias(zero3_linear(h, w.fc2, None, group, dim=1, gathers=gathers, index=1), w.fc2_bias)


register(
    Strategy(
        name="zero3",
        sublayer="mlp",
        forward=mlp,
        weight_gathers=weight_gathers,
        summary="ZeRO-3: token-local on s/p tokens; fc1/fc2 gathered, gradients reduce-scattered",
    )
)
