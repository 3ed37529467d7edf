"""``tp_sp``: Megatron's own tensor + sequence parallelism.

The sublayer's Megatron linear modules run it, as in a stock Megatron layer of the same transformer
implementation: the column-parallel ``linear_qkv`` / ``linear_fc1`` all-gather the sequence and apply
this rank's shard (this rank's heads or units over the whole sequence), the row-parallel
``linear_proj`` / ``linear_fc2`` reduce-scatter the sequence. Megatron's local modules save only the
local ``[s/p, b, h]`` input and gather it again in backward; Transformer Engine's bring their fused
input norm, communication overlap and FP8 recipes. Only attention's core is ours: RoPE and the
kernel over the canonical layout (:func:`~megatron_paradyse.strategies.common.attend_full_sequence`).
Weights stay in place and their gradients are complete locally (Megatron's gradient accumulation
fusion included, where the modules have it).
"""

from __future__ import annotations

from torch import Tensor

from megatron_paradyse.strategies.base import (
    AttentionContext,
    AttentionWeights,
    MLPContext,
    MLPWeights,
    ParallelLinear,
    Strategy,
)
from megatron_paradyse.strategies.common import activate, add_bias, attend_full_sequence
from megatron_paradyse.strategies.registry import register


def _linear(module: ParallelLinear | None, name: str) -> ParallelLinear:
    if module is None:
        raise ValueError(
            f"tp_sp runs the layer's Megatron linear modules, and the weights hold no {name}; build them with "
            f"{'AttentionWeights' if name in ('linear_qkv', 'linear_proj') else 'MLPWeights'}.of(...)"
        )
    return module


def _call(module: ParallelLinear, x: Tensor) -> Tensor:
    """The module's output with the bias it leaves to its caller (``skip_bias_add``) added."""
    y, bias = module(x)
    return add_bias(y, bias)


def attention(x_local: Tensor, w: AttentionWeights, ctx: AttentionContext) -> Tensor:
    linear_qkv, linear_proj = _linear(w.linear_qkv, "linear_qkv"), _linear(w.linear_proj, "linear_proj")
    qkv = _call(linear_qkv, x_local)  # [s, b, ng/p*(np/ng+2)*hn]
    core = attend_full_sequence(qkv, ctx)  # [s, b, np/p*hn]
    return _call(linear_proj, core)  # [s/p, b, h]


def mlp(x_local: Tensor, w: MLPWeights, ctx: MLPContext) -> Tensor:
    linear_fc1, linear_fc2 = _linear(w.linear_fc1, "linear_fc1"), _linear(w.linear_fc2, "linear_fc2")
    h = _call(linear_fc1, x_local)  # [s, b, (2*)ffn/p]
    h = activate(h, ctx.shape, ctx.activation, blocks=1)  # [s, b, ffn/p]
    return _call(linear_fc2, h)  # [s/p, b, h]


register(
    Strategy(
        name="tp_sp",
        sublayer="attention",
        forward=attention,
        summary="Megatron TP+SP: AG + RS of [s,b,h]; local heads over the whole sequence; weights in place",
        calls_linears=True,
    )
)
register(
    Strategy(
        name="tp_sp",
        sublayer="mlp",
        forward=mlp,
        summary="Megatron TP+SP: AG + RS of [s,b,h]; local units over the whole sequence; weights in place",
        calls_linears=True,
    )
)
