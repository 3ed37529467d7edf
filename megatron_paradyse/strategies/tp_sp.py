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

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.strategies.allocations import (
    Allocations,
    SublayerMemory,
    sublayer_memory_of,
)
from megatron_paradyse.strategies.attention_allocations import (
    full_attention_backward,
    full_attention_forward,
)
from megatron_paradyse.strategies.base import (
    AttentionContext,
    AttentionWeights,
    MLPContext,
    MLPWeights,
    ParallelLinear,
    Strategy,
)
from megatron_paradyse.strategies.common import activate, add_bias, attend_full_sequence
from megatron_paradyse.strategies.dims import Dims
from megatron_paradyse.strategies.linear_allocations import (
    bias_grad,
    column_backward,
    column_forward,
    gathered_gradient,
    row_backward,
    row_forward,
)
from megatron_paradyse.strategies.registry import register
from megatron_paradyse.strategies.terms import (
    Collective,
    Gemm,
    SublayerTerms,
    attention_calls,
    qk_norm_bytes,
)


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


# -- what it costs: time terms (priced by cost.analytic) and memory (composed by cost.layer_memory) --
def attention_terms(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    s, b, e, p = d.s, d.b, d.e, d.p
    x_full, core = s * b * d.h * e, s * b * d.nq // p * d.hn * e
    return SublayerTerms(
        gemms=(Gemm(s * b, d.qkv // p, d.h), Gemm(s * b, d.h, d.a // p)),
        attention=attention_calls(layout, b, d.nq // p, d.hn),
        fwd_comm=(Collective("all_gather", x_full), Collective("reduce_scatter", x_full)),
        # Megatron's column-parallel linear gathers its input again for the weight gradient (issued beside
        # the input gradient's GEMM, its reduce-scatter beside the weight gradient's: counted as waited)
        bwd_comm=(
            Collective("all_gather", x_full),
            Collective("reduce_scatter", x_full),
            Collective("all_gather", x_full),
        ),
        elementwise_bytes=2 * (s * b * d.qkv // p * e) * (2 if layout.causal else 1) + 4 * core + qk_norm_bytes(d),
    )


def mlp_terms(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    s, b, e, p = d.s, d.b, d.e, d.p
    x_full = s * b * d.h * e
    return SublayerTerms(
        gemms=(Gemm(s * b, d.f1 // p, d.h), Gemm(s * b, d.h, d.f // p)),
        fwd_comm=(Collective("all_gather", x_full), Collective("reduce_scatter", x_full)),
        # Megatron's column-parallel linear gathers its input again for the weight gradient (issued beside
        # the input gradient's GEMM, its reduce-scatter beside the weight gradient's: counted as waited)
        bwd_comm=(
            Collective("all_gather", x_full),
            Collective("reduce_scatter", x_full),
            Collective("all_gather", x_full),
        ),
        elementwise_bytes=3 * s * b * d.f1 // p * e,
    )


def attention_memory(d: Dims, layout: SequenceLayout, rank: int) -> SublayerMemory:
    s, b, e, p = d.s, d.b, d.e, d.p
    heads, kv_heads = d.nq // p, d.ng // p
    core = s * b * heads * d.hn * e

    fwd = Allocations(x_local=d.x)
    column_forward(fwd, d, "qkv_out", s * b * d.qkv // p * e, d.bias)
    kept, qk, core_name = full_attention_forward(fwd, d, layout, "qkv_out", heads, kv_heads)
    row_forward(fwd, d, d.bias)
    proj_input = () if core_name in kept else (core_name,)  # kept by linear_proj
    saved = fwd.returns("y_local", "x_local", *dict.fromkeys((*kept, *qk.saved)), *proj_input)

    bwd = Allocations(dy_local=0.0, **saved)
    bias_grad(bwd, d, d.bias)
    row_backward(bwd, d, "d_core", core, d.h * d.a // p * e, release=proj_input)
    d_qkv = full_attention_backward(bwd, d, layout, "d_core", kept, qk, heads, kv_heads)
    column_backward(bwd, d, d_qkv, d.qkv // p * d.h * e, d.qkv // p * e if d.bias else 0.0)
    return sublayer_memory_of(fwd.peak, bwd, saved, prelude=gathered_gradient(d), kept_core=fwd.kept_bytes)


register(
    Strategy(
        name="tp_sp",
        sublayer="attention",
        forward=attention,
        terms=attention_terms,
        memory=attention_memory,
        summary="Megatron TP+SP: AG + RS of [s,b,h]; local heads over the whole sequence; weights in place",
        calls_linears=True,
    )
)
register(
    Strategy(
        name="tp_sp",
        sublayer="mlp",
        forward=mlp,
        terms=mlp_terms,
        summary="Megatron TP+SP: AG + RS of [s,b,h]; local units over the whole sequence; weights in place",
        calls_linears=True,
    )
)
