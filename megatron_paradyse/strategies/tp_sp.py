"""``tp_sp``: Megatron tensor + sequence parallelism.

Attention: all-gather the sequence, QKV with the local column shard (this rank's heads, whole
sequence), attention, row-parallel projection, reduce-scatter the sequence. The MLP follows the same
pattern. Weights stay in place and their gradients are complete locally; activations cost one
all-gather and one reduce-scatter of ``[s, b, h]`` per sublayer, plus, as in Megatron, a second
all-gather in backward: only the local ``[s/p, b, h]`` input is saved.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from megatron_paradyse.comm import reduce_scatter_seq, sequence_parallel_linear
from megatron_paradyse.strategies.base import (
    AttentionContext,
    AttentionWeights,
    MLPContext,
    MLPWeights,
    Strategy,
)
from megatron_paradyse.strategies.common import activate, add_bias, attend_full_sequence
from megatron_paradyse.strategies.registry import register


def attention(x_local: Tensor, w: AttentionWeights, ctx: AttentionContext) -> Tensor:
    qkv = sequence_parallel_linear(x_local, w.qkv, w.qkv_bias, ctx.group)  # [s, b, ng/p*(np/ng+2)*hn]
    core = attend_full_sequence(qkv, ctx)  # [s, b, np/p*hn]
    y_partial = F.linear(core, w.proj)  # [s, b, h], summed over ranks' heads below
    return add_bias(reduce_scatter_seq(y_partial, ctx.group), w.proj_bias)


def mlp(x_local: Tensor, w: MLPWeights, ctx: MLPContext) -> Tensor:
    h = sequence_parallel_linear(x_local, w.fc1, w.fc1_bias, ctx.group)  # [s, b, (2*)ffn/p]
    h = activate(h, ctx.shape, ctx.activation, blocks=1)  # [s, b, ffn/p]
    y_partial = F.linear(h, w.fc2)  # [s, b, h]
    return add_bias(reduce_scatter_seq(y_partial, ctx.group), w.fc2_bias)


register(
    Strategy(
        name="tp_sp",
        sublayer="attention",
        forward=attention,
        summary="Megatron TP+SP: AG + RS of [s,b,h]; local heads over the whole sequence; weights in place",
    )
)
register(
    Strategy(
        name="tp_sp",
        sublayer="mlp",
        forward=mlp,
        summary="Megatron TP+SP: AG + RS of [s,b,h]; local units over the whole sequence; weights in place",
    )
)
