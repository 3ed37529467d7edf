"""``ulysses``: DeepSpeed-Ulysses sequence parallelism with ZeRO-3 weights.

QKV of the local tokens with the all-gathered weight; all-to-all from sequence shards to head
shards (rank ``j`` receives the QKV columns of Megatron's TP shard ``j``: the same heads ``tp_sp``
gives it); attention over the whole sequence; all-to-all back; projection with the all-gathered
weight, whose gather runs while the attention core computes, as does a ``zero3`` MLP's first weight's
(in backward, the QKV weight's while the core's backward does). Activations cross the wire as
``[s/p, b, *]`` blocks (``1/p`` of ``tp_sp``'s traffic), weights are gathered per call and their
gradients reduce-scattered back to the shards.
"""

from __future__ import annotations

from torch import Tensor

from megatron_paradyse.core.comm import Zero3Gathers, all_to_all_heads_to_seq, all_to_all_seq_to_heads, zero3_linear
from megatron_paradyse.strategies.base import AttentionContext, AttentionWeights, Strategy
from megatron_paradyse.strategies.common import add_bias, attend_full_sequence
from megatron_paradyse.strategies.registry import register


def attention(x_local: Tensor, w: AttentionWeights, ctx: AttentionContext) -> Tensor:
    group = ctx.group
    gathers = Zero3Gathers([(w.qkv, 0), (w.proj, 1)], group, chained=False)
    qkv_local = zero3_linear(x_local, w.qkv, w.qkv_bias, group, dim=0, gathers=gathers, index=0)
    qkv_full = all_to_all_seq_to_heads(qkv_local, group)  # [s, b, ng/p*(np/ng+2)*hn]
    gathers.start(1)  # after the all-to-all, which would otherwise queue behind it
    ctx.start_mlp_gather()  # and the MLP's first weight (where the layer gathers it ahead)
    core = attend_full_sequence(qkv_full, ctx)  # [s, b, np/p*hn]
    gathers.start_when_gradient_reaches(core, 0)  # backward: the QKV weight travels while the core's runs
    core_local = all_to_all_heads_to_seq(core, group)  # [s/p, b, np*hn]
    return add_bias(zero3_linear(core_local, w.proj, None, group, dim=1, gathers=gathers, index=1), w.proj_bias)


register(
    Strategy(
        name="ulysses",
        sublayer="attention",
        forward=attention,
        starts_mlp_gather=True,
        summary="Ulysses + ZeRO-3: 2 A2A of [s/p,b,*]; local heads over the whole sequence; weights gathered",
    )
)
