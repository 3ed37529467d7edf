"""``zero3``: token-local MLP with ZeRO-3 weights.

The MLP needs no other token, so each rank runs its own ``s/p`` tokens through the full weights,
all-gathered from the TP shards just in time; the weight gradients are reduce-scattered back. No
activation crosses the wire; the transient cost is the gathered ``fc1``/``fc2`` weights.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from megatron_paradyse.comm import gather_weight
from megatron_paradyse.strategies.base import MLPContext, MLPWeights, Strategy
from megatron_paradyse.strategies.common import activate, add_bias, gather_bias
from megatron_paradyse.strategies.registry import register


def mlp(x_local: Tensor, w: MLPWeights, ctx: MLPContext) -> Tensor:
    group = ctx.group
    h = F.linear(x_local, gather_weight(w.fc1, group, 0), gather_bias(w.fc1_bias, group))
    h = activate(h, ctx.shape, ctx.activation, blocks=group.size())  # [s/p, b, ffn], rank order
    return add_bias(F.linear(h, gather_weight(w.fc2, group, 1)), w.fc2_bias)


register(
    Strategy(
        name="zero3",
        sublayer="mlp",
        forward=mlp,
        summary="ZeRO-3: token-local on s/p tokens; fc1/fc2 gathered, gradients reduce-scattered",
    )
)
