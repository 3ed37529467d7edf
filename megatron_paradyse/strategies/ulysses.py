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
from megatron_paradyse.strategies.base import AttentionContext, AttentionWeights, Strategy
from megatron_paradyse.strategies.common import add_bias, attend_full_sequence
from megatron_paradyse.strategies.dims import Dims
from megatron_paradyse.strategies.linear_allocations import (
    add_bias_memory,
    bias_grad,
    gather_ahead,
    gather_mlp_weight_ahead,
    mlp_weight_handed_on,
    zero3_backward,
    zero3_forward,
)
from megatron_paradyse.strategies.registry import register
from megatron_paradyse.strategies.terms import (
    Collective,
    Gemm,
    SublayerTerms,
    attention_calls,
    gathered_weight,
    mlp_weight_gathered_ahead,
    qk_norm_bytes,
)


def attention(x_local: Tensor, w: AttentionWeights, ctx: AttentionContext) -> Tensor:
    group, shards = ctx.group, ctx.weights_over
    gathers = Zero3Gathers([(w.qkv, 0), (w.proj, 1)], shards, chained=False)
    qkv_local = zero3_linear(x_local, w.qkv, w.qkv_bias, shards, dim=0, gathers=gathers, index=0)
    qkv_full = all_to_all_seq_to_heads(qkv_local, group)  # [s, b, ng/p*(np/ng+2)*hn]
    gathers.start(1)  # after the all-to-all, which would otherwise queue behind it
    ctx.start_mlp_gather()  # and the MLP's first weight (where the layer gathers it ahead)
    core = attend_full_sequence(qkv_full, ctx)  # [s, b, np/p*hn]
    gathers.start_when_gradient_reaches(core, 0)  # backward: the QKV weight travels while the core's runs
    core_local = all_to_all_heads_to_seq(core, group)  # [s/p, b, np*hn]
    return add_bias(zero3_linear(core_local, w.proj, None, shards, dim=1, gathers=gathers, index=1), w.proj_bias)


# -- what it costs: time terms (priced by cost.analytic) and memory (composed by cost.layer_memory) --
def attention_terms(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    """The output projection's weight (and the MLP's first, where the layer gathers it ahead) gathered
    while the attention core runs (``Zero3Gathers``), the QKV projection's while the core's backward
    runs: those gathers stream beside their pass, as the projections' backward collectives do; the
    all-to-alls and the QKV projection's forward gather are waited for."""
    t, b, e = d.t, d.b, d.e
    qkv_local, core_local = t * b * d.qkv * e, t * b * d.a * e  # = [s, b, qkv/p], [s, b, a/p] on the other side
    qkv_fwd, qkv_bwd = gathered_weight(d.qkv * d.h * e, d)
    proj_fwd, proj_bwd = gathered_weight(d.h * d.a * e, d)
    a2a_qkv, a2a_core = Collective("all_to_all", qkv_local), Collective("all_to_all", core_local)
    return SublayerTerms(
        gemms=(Gemm(t * b, d.qkv, d.h), Gemm(t * b, d.h, d.a)),
        attention=attention_calls(layout, b, d.nq // d.p, d.hn),
        fwd_comm=(*qkv_fwd, a2a_qkv, a2a_core),
        fwd_streamed=(*proj_fwd, *mlp_weight_gathered_ahead(d)),
        bwd_comm=(a2a_core, a2a_qkv),
        bwd_streamed=(*proj_bwd, *qkv_bwd),
        elementwise_bytes=4 * qkv_local * (2 if layout.causal else 1) + 6 * core_local + qk_norm_bytes(d),
    )


def attention_memory(d: Dims, layout: SequenceLayout, rank: int) -> SublayerMemory:
    t, b, e, p = d.t, d.b, d.e, d.p
    heads, kv_heads = d.nq // p, d.ng // p
    w_qkv, w_proj, qkv_bias = d.qkv * d.h * e, d.h * d.a * e, d.qkv * e if d.bias else 0.0
    qkv_local = t * b * d.qkv * e  # = [s, b, qkv/p] after the all-to-all
    core_local = t * b * d.a * e  # = [s, b, a/p] before it

    fwd = Allocations(x_local=d.x)
    zero3_forward(fwd, d, "qkv", "qkv_local", qkv_local, w_qkv, bias=qkv_bias)
    qkv_full = "qkv_local"
    if p > 1:  # sequence -> heads: a permuted send copy, the receive
        fwd.alloc(a2a_send=qkv_local, qkv_full=qkv_local)
        fwd.free("a2a_send")
        qkv_full = "qkv_full"
    gather_ahead(fwd, d, "proj", w_proj)  # while the attention core runs
    gather_mlp_weight_ahead(fwd, d)
    kept, qk, core = full_attention_forward(fwd, d, layout, qkv_full, heads, kv_heads)
    if p > 1:  # heads -> sequence: the receive (the output is contiguous as laid out), then permuted
        fwd.alloc(a2a_recv=core_local, core_local=core_local)
        fwd.free("a2a_recv")
        core = "core_local"
    zero3_forward(fwd, d, "proj", "proj_out", d.x, w_proj, row=True, gathered=True)
    add_bias_memory(fwd, d, "proj_out")
    handed_on = mlp_weight_handed_on(fwd, d)
    saved = fwd.returns("y_local", "x_local", *dict.fromkeys((*kept, *qk.saved, core)))

    bwd = Allocations(dy_local=0.0, **saved)
    bias_grad(bwd, d, d.bias)
    release = () if core in kept else (core,)
    zero3_backward(bwd, d, "proj", "d_core", core_local, w_proj, row=True, release=release, uses_output_gradient=True)
    if p > 1:
        bwd.alloc(a2a_send=core_local, d_core_full=core_local)
        bwd.free("a2a_send", "d_core")
        bwd.rename(d_core_full="d_core")
    gather_ahead(bwd, d, "qkv", w_qkv)  # once the core's gradient is there
    d_qkv = full_attention_backward(bwd, d, layout, "d_core", kept, qk, heads, kv_heads)
    if p > 1:
        bwd.alloc(a2a_recv=qkv_local, d_qkv_local=qkv_local)
        bwd.free("a2a_recv", d_qkv)
        d_qkv = "d_qkv_local"
    release = (d_qkv, "x_local")
    zero3_backward(bwd, d, "qkv", "dx_local", d.x, w_qkv, bias=qkv_bias, release=release, gathered=True)
    return sublayer_memory_of(fwd.peak, bwd, saved, handed_on=handed_on, kept_core=fwd.kept_bytes)


register(
    Strategy(
        name="ulysses",
        sublayer="attention",
        forward=attention,
        terms=attention_terms,
        memory=attention_memory,
        starts_mlp_gather=True,
        runs_on_subgroup=True,
        summary="Ulysses + ZeRO-3: 2 A2A of [s/p,b,*]; local heads over the whole sequence; weights gathered",
    )
)
