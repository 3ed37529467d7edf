"""Cost terms against hand counts, the analytic model's physics, profiles' errors, the empirical mode.

Single-process and fast: the profile is synthetic (plausible CPU constants), so nothing here depends on
this machine's speed. Measured agreement is in test_cost_calibration.py.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from megatron_paradyse.cli import main as cli_main
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.analytic import AnalyticCostModel
from megatron_paradyse.cost.base import WHOLE_LOSS, StageOptions
from megatron_paradyse.cost.empirical import EmpiricalCostModel, HybridRegressor, Sample, aic_polynomial
from megatron_paradyse.cost.fitting import fit_nonnegative, mape
from megatron_paradyse.cost.layer_memory import sublayer_memory
from megatron_paradyse.cost.profile import ProfileError, load_profile, save_profile
from megatron_paradyse.cost.terms import layer_terms, sublayer_terms
from megatron_paradyse.strategies import attention_allocations, lean, ring
from megatron_paradyse.strategies.dims import Dims

from helpers.cost_profiles import GQA, MHA, synthetic_profile

OPTIONS = [
    LayerOption(a, m, rc)
    for a in ("tp_sp", "ulysses", "ring", "lean")
    for m in ("tp_sp", "zero3", "lean")
    for rc in (False, True)
]


# -- terms against hand counts -------------------------------------------------------------------
def test_tp_sp_terms_match_hand_counts():
    p, s, b, e = 4, 2048, 1, 4
    layout = SequenceLayout.build(s, p, causal=True)
    d = Dims(MHA, p, s, b, e)
    attn = sublayer_terms("attention", "tp_sp", d, layout)
    # QKV: [s, h] x [h, 3h/p]; proj: [s, h/p] x [h/p, h]
    assert [(g.m, g.n, g.k) for g in attn.gemms] == [(2048, 192, 256), (2048, 256, 64)]
    assert sum(g.flops for g in attn.gemms) == 2 * 2048 * 192 * 256 + 2 * 2048 * 256 * 64
    # one causal call over the whole sequence on 8/4 heads: s(s+1)/2 pairs, 4*hn FLOPs per pair and head
    (call,) = attn.attention
    assert (call.heads, call.sq, call.causal, call.pairs) == (2, 2048, True, 2048 * 2049 // 2)
    assert call.flops == 4 * 2 * (2048 * 2049 // 2) * 32
    # AG + RS of [s, b, h] fp32 each way, and the input gathered again for the weight gradient
    assert [(c.kind, c.nbytes) for c in attn.fwd_comm] == [("all_gather", 2048 * 256 * 4), ("reduce_scatter", 2097152)]
    assert [c.kind for c in attn.bwd_comm] == ["all_gather", "reduce_scatter", "all_gather"]
    # kept: the local input (as Megatron), natural-order q/k/v copies, output, lse, output in canonical order
    assert dict(sublayer_memory("attention", "tp_sp", d, layout).saved) == {
        "x_local": 2048 // 4 * 256 * 4,
        "q_natural": 2048 * 64 * 4,
        "k_natural": 2048 * 64 * 4,
        "v_natural": 2048 * 64 * 4,
        "attn_out": 2048 * 64 * 4,
        "lse": 2048 * 2 * 4,
        "core": 2048 * 64 * 4,
    }
    mlp = sublayer_memory("mlp", "tp_sp", d, layout)
    # recorded from the code: x_local, fc1's output and the activation's
    assert sorted(dict(mlp.saved).values()) == [524288, 2048 * 256 * 4, 2048 * 256 * 4]
    # the whole layer: sublayers, two LN statistics pairs, the residual sum and the output (measured: 8937472)
    assert layer_terms(LayerOption("tp_sp", "tp_sp"), d, layout).saved_bytes == 8937472


def test_zero3_strategies_gather_weights_for_each_gemm_and_keep_none():
    p, s = 4, 1024
    layout = SequenceLayout.build(s, p, causal=True)
    d = Dims(GQA, p, s, 2, 2)  # b=2, bf16
    t = s // p
    qkv = (8 + 2 * 4) * 32  # (nq + 2 ng) hn
    uly = sublayer_terms("attention", "ulysses", d, layout)
    assert [(c.kind, c.nbytes) for c in uly.fwd_comm] == [
        ("all_gather", qkv * 256 * 2),
        ("all_to_all", t * 2 * qkv * 2),
        ("all_to_all", t * 2 * 256 * 2),
    ]
    # the output projection's weight travels while the attention core runs
    assert [(c.kind, c.nbytes) for c in uly.fwd_streamed] == [("all_gather", 256 * 256 * 2)]
    # backward waits for the all-to-alls only: it gathers each weight again (the QKV weight while the
    # core's backward runs, the output projection's beside its weight gradient's GEMM) and reduce-scatters
    # its gradient, in fp32, beside the input gradient's GEMM
    assert [(c.kind, c.nbytes) for c in uly.bwd_comm] == [
        ("all_to_all", t * 2 * 256 * 2),
        ("all_to_all", t * 2 * qkv * 2),
    ]
    assert [(c.kind, c.nbytes) for c in uly.bwd_streamed] == [
        ("all_gather", 256 * 256 * 2),
        ("reduce_scatter", 256 * 256 * 4),
        ("all_gather", qkv * 256 * 2),
        ("reduce_scatter", qkv * 256 * 4),
    ]
    saved = dict(sublayer_memory("attention", "ulysses", d, layout).saved)
    assert set(saved) == {"x_local", "q_natural", "k_natural", "v_natural", "attn_out", "lse", "core_local"}
    mlp = sublayer_terms("mlp", "zero3", d, layout)
    assert [(g.m, g.n, g.k) for g in mlp.gemms] == [(t * 2, 1024, 256), (t * 2, 256, 512)]  # gated fc1: 2 ffn rows
    # recorded from the code: x_local, fc1's output, the activation's (not the gate's: computed again in
    # backward)
    kept = sorted(dict(sublayer_memory("mlp", "zero3", d, layout).saved).values())
    assert kept == [t * 2 * 256 * 2, t * 2 * 512 * 2, t * 2 * 1024 * 2]
    # zero3_actrc recomputes fc2's input from fc1's output in backward: the same traffic, one pass more
    lower = sublayer_terms("mlp", "zero3_actrc", d, layout)
    assert sorted(dict(sublayer_memory("mlp", "zero3_actrc", d, layout).saved).values()) == [
        t * 2 * 256 * 2,
        t * 2 * 1024 * 2,
    ]
    assert (lower.gemms, lower.fwd_comm, lower.fwd_streamed, lower.bwd_comm, lower.bwd_streamed) == (
        mlp.gemms,
        mlp.fwd_comm,
        mlp.fwd_streamed,
        mlp.bwd_comm,
        mlp.bwd_streamed,
    )
    assert lower.elementwise_bytes == mlp.elementwise_bytes + t * 2 * (1024 + 512) * 2


@pytest.mark.parametrize("attention", ["tp_sp", "ulysses", "ring", "lean"])
@pytest.mark.parametrize("tile_tokens", [0, 512])
def test_ulysses_and_ring_gather_a_whole_zero3_mlps_first_weight_while_their_core_runs(attention, tile_tokens):
    p, s = 4, 1024
    layout = SequenceLayout.build(s, p, causal=True)
    d = Dims(GQA, p, s, 2, 2)
    fc1_gather = ("all_gather", 1024 * 256 * 2)  # gated: 2 ffn rows of h, bf16
    ahead = attention in ("ulysses", "ring") and not tile_tokens
    terms = layer_terms(LayerOption(attention, "zero3", mlp_tile_tokens=tile_tokens), d, layout)
    alone = sublayer_terms("attention", attention, d, layout)
    assert [(c.kind, c.nbytes) for c in terms.attention.fwd_streamed] == [
        *((c.kind, c.nbytes) for c in alone.fwd_streamed),
        *([fc1_gather] if ahead else []),
    ]
    assert terms.attention.fwd_comm == alone.fwd_comm
    assert [(c.kind, c.nbytes) for c in terms.mlp.fwd_comm] == ([] if ahead else [fc1_gather])
    # on one rank nothing is gathered ahead: each sublayer's terms are its own
    d1, layout1 = Dims(GQA, 1, s, 2, 2), SequenceLayout.build(s, 1, causal=True)
    one = layer_terms(LayerOption(attention, "zero3"), d1, layout1)
    assert one.attention == sublayer_terms("attention", attention, d1, layout1)
    assert one.mlp == sublayer_terms("mlp", "zero3", d1, layout1)


def test_a_zero3_mlps_weight_gathered_ahead_is_alive_from_the_attention_core_to_fc1():
    """The attention's forward peak holds fc1's full weight (ulysses: it is gathered before the core),
    which the attention hands on and the MLP's forward starts with: the MLP's forward peak is the same
    either way, nothing is saved for backward, and the backward does not see it."""
    p, s = 4, 1024
    layout = SequenceLayout.build(s, p, causal=True)
    d = Dims(GQA, p, s, 2, 2)
    ahead = dataclasses.replace(d, mlp_weight_ahead=True)
    w1 = 1024 * 256 * 2
    attn, attn_ahead = (sublayer_memory("attention", "ulysses", dims, layout) for dims in (d, ahead))
    assert attn_ahead.fwd_peak == attn.fwd_peak + w1
    assert (attn_ahead.handed_on, attn.handed_on) == (w1, 0.0)
    assert (attn_ahead.saved, attn_ahead.bwd_peak) == (attn.saved, attn.bwd_peak)
    mlp, mlp_ahead = (sublayer_memory("mlp", "zero3", dims, layout) for dims in (d, ahead))
    assert (mlp_ahead.fwd_peak, mlp_ahead.saved, mlp_ahead.bwd_peak) == (mlp.fwd_peak, mlp.saved, mlp.bwd_peak)
    with pytest.raises(ValueError, match=r"^Dims\(mlp_weight_ahead=True\) needs p > 1: one rank gathers no weight"):
        Dims(GQA, 1, s, 2, 2, mlp_weight_ahead=True)


def test_zero3_mlp_peaks_match_hand_counts():
    """Ungated, p=4, t=512 local tokens of h=256, ffn=1024, fp32: x = 0.5 MiB, fc1's output and the
    activation's 2 MiB each, linear_fc2's full weight 1 MiB."""
    layout = SequenceLayout.build(2048, 4, causal=True)
    mlp = sublayer_memory("mlp", "zero3", Dims(MHA, 4, 2048, 1, 4), layout)
    x, hidden, w2 = 512 * 256 * 4, 512 * 1024 * 4, 256 * 1024 * 4
    # forward: input, fc1's output, the activation, and fc2's weight gathered as [p, h, ffn/p] beside
    # its [h, ffn] layout
    assert mlp.fwd_peak == x + 2 * hidden + 2 * w2
    # backward, linear_fc2's input gradient: itself (the activation's), the weight laid out as [h, ffn],
    # and beside it the reduce-scatter of the weight gradient's transposed copy into the shard's
    assert mlp.bwd_peak == hidden + 2 * w2 + w2 / 4
    # zero3_actrc keeps the activation's output from forward to backward no longer, but recomputes it at
    # the start of linear_fc2's backward, beside that gradient
    lower = sublayer_memory("mlp", "zero3_actrc", Dims(MHA, 4, 2048, 1, 4), layout)
    assert lower.saved_bytes == mlp.saved_bytes - hidden
    assert (lower.fwd_peak, lower.bwd_peak) == (mlp.fwd_peak, mlp.bwd_peak + hidden)


def test_lean_terms_match_hand_counts():
    p, s = 4, 2048
    t, units = s // p, 1024 // p
    d = Dims(MHA, p, s, 1, 4)
    layout = SequenceLayout.build(s, p, causal=True)
    x = t * 256 * 4
    mlp = sublayer_terms("mlp", "lean", d, layout)
    mlp_memory = sublayer_memory("mlp", "lean", d, layout)
    shard = (units * 256 + 256 * units + units) * 4  # fc1 rows, fc2 columns, fc1 bias
    assert dict(mlp_memory.saved) == {"x_local": x}
    assert [c.nbytes for c in mlp.fwd_streamed] == [shard] * (p - 1) and not mlp.fwd_comm
    assert len(mlp.bwd_streamed) + len(mlp.bwd_comm) == 2 * p - 1  # p - 1 shard hops, p gradient hops
    assert [(g.m, g.n, g.k) for g in mlp.recompute_gemms] == [(t, units, 256)] * p
    # forward: input, y, two shards, one shard's [t, ffn/p] before and after the activation
    assert mlp_memory.fwd_peak == 2 * x + 2 * shard + 2 * t * units * 4
    # backward: dx, two shards, the gradient being filled, the one leaving and the one arriving,
    # fc1's output, the activation, its gradient and fc1 output's gradient
    assert mlp_memory.bwd_peak == x + 5 * shard + 4 * t * units * 4

    attn = sublayer_terms("attention", "lean", d, layout)
    # kept: the input, each head group's output and log-sum-exp
    assert sublayer_memory("attention", "lean", d, layout).saved_bytes == x + t * 8 * 32 * 4 + 8 * t * 4
    shard = (192 * 256 + 256 * 64 + 192) * 4  # qkv rows, proj columns, qkv bias
    assert [(c.kind, c.nbytes) for c in attn.fwd_comm + attn.fwd_streamed] == [("broadcast", shard)] * p
    assert sorted(c.kind for c in attn.bwd_comm + attn.bwd_streamed) == ["broadcast"] * p + ["reduce"] * p
    assert len(attn.rings) == p and all(ring.hops[0][0].heads == 8 // p for ring in attn.rings)
    assert attn.rings[0].send.nbytes == 2 * t * (8 // p) * 32 * 4
    # rank 0 keeps its own shard's gradient from the first group on: one shard more than the last rank
    # (bidirectional: every rank's ring hops are alike)
    bidir = SequenceLayout.build(s, p, causal=False)
    peaks = [sublayer_memory("attention", "lean", d, bidir, rank).bwd_peak for rank in range(p)]
    assert peaks[0] - peaks[p - 1] == shard and len(set(peaks[1:])) == 1


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("docs", [(1200,), (300, 517, 41)])
def test_ring_hops_cover_every_visible_pair_once(p, docs):
    """Over all ranks and hops the ring computes exactly the causal pairs of every document (padding
    included, as its own document), each rank the same amount without padding (zigzag balance)."""
    layout = SequenceLayout.build(docs, p, causal=True)
    d = Dims(MHA, p, layout.padded_len, 1, 4)
    per_rank = []
    for rank in range(p):
        (ring,) = sublayer_terms("attention", "ring", d, layout, rank).rings
        assert len(ring.hops) == p and ring.send.nbytes == 2 * layout.local_len * 8 * 32 * 4
        per_rank.append(sum(c.pairs for hop in ring.hops for c in hop))
    assert sum(per_rank) == sum((e - s) * (e - s + 1) // 2 for s, e in layout.doc_bounds)
    if len(docs) == 1:
        assert len(set(per_rank)) == 1


def test_packed_documents_attend_within_documents():
    layout = SequenceLayout.build((100, 28), 2, causal=False)
    d = Dims(MHA, 2, layout.padded_len, 1, 4)
    calls = sublayer_terms("attention", "tp_sp", d, layout).attention
    assert [(c.sq, c.causal) for c in calls] == [(100, False), (28, False)]
    assert sum(c.pairs for c in calls) == 100**2 + 28**2


def test_rope_keeps_only_the_rotated_q_k_where_attention_keeps_them():
    p, s, b, e, rot = 4, 1024, 1, 4, 16
    causal, bidir = SequenceLayout.build(s, p, causal=True), SequenceLayout.build(s, p, causal=False)
    plain, rope = Dims(MHA, p, s, b, e), Dims(MHA, p, s, b, e, rotary_dim=rot)
    nq_hn = 8 * 32

    def extra(option: str, layout: SequenceLayout) -> float:
        with_rope = layer_terms(LayerOption.parse(option), rope, layout)
        return with_rope.saved_bytes - layer_terms(LayerOption.parse(option), plain, layout).saved_bytes

    assert extra("tp_sp/tp_sp", causal) == 0  # rotated q/k copied into natural order, not kept; no angles
    assert extra("tp_sp/tp_sp", bidir) == 0  # kept by the kernel, where dense copies of q/k would be
    assert extra("ring/zero3", causal) == s // p * b * 2 * nq_hn * e  # the rotated q and k, the ring's inputs
    assert extra("lean/lean", causal) == 0
    assert extra("ulysses/zero3+rc", causal) == 0  # recompute keeps the input only
    # backward through the rotation adds its temporaries where the attention's backward is the peak (the
    # ring's; tp_sp's peak is elsewhere)
    peak = layer_terms(LayerOption.parse("ring/zero3"), rope, causal).peak_bytes
    assert peak > layer_terms(LayerOption.parse("ring/zero3"), plain, causal).peak_bytes


def test_recompute_keeps_the_output_only():
    layout = SequenceLayout.build(4096, 4, causal=True)
    d = Dims(MHA, 4, 4096, 1, 4)
    for option in ("ring/zero3", "tp_sp/lean"):
        plain = layer_terms(LayerOption.parse(option), d, layout)
        rc = layer_terms(LayerOption.parse(option + "+rc"), d, layout)
        assert rc.saved_bytes == 1024 * 256 * 4
        # the backward is the same, on the rebuilt layer: the transient grows by what plain keeps, and
        # rebuilding beside the output adds nothing to the peak here (backward's high-water mark is higher)
        assert rc.peak_bytes == plain.peak_bytes
        assert rc.transient_bytes == plain.transient_bytes + plain.saved_bytes - rc.saved_bytes


def test_unknown_strategy_is_named():
    d = Dims(MHA, 2, 64, 1, 4)
    with pytest.raises(ValueError, match=r"unknown attention strategy 'flash'; known: tp_sp, ulysses, ring, lean"):
        sublayer_terms("attention", "flash", d, SequenceLayout.build(64, 2, causal=True))


# -- the analytic model ----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [MHA, GQA], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_longer_sequences_cost_more_time_and_memory(shape, causal):
    model = AnalyticCostModel(synthetic_profile(), shape, 4)
    for option in OPTIONS:
        costs = [
            model.layer_cost(option, SequenceLayout.build(s, 4, causal=causal), 1) for s in (256, 1024, 4096, 16384)
        ]
        for short, long in zip(costs, costs[1:]):
            assert long.time_s > short.time_s, option
            assert long.saved_bytes > short.saved_bytes, option
            assert long.saved_bytes + long.transient_bytes > short.saved_bytes + short.transient_bytes, option


def test_recompute_costs_one_more_forward():
    model = AnalyticCostModel(synthetic_profile(), MHA, 4)
    layout = SequenceLayout.build(2048, 4, causal=True)
    for attention, mlp in (("tp_sp", "tp_sp"), ("ring", "zero3")):
        plain = model.time_breakdown(LayerOption(attention, mlp), layout, 1)
        rc = model.time_breakdown(LayerOption(attention, mlp, True), layout, 1)
        assert plain.total_s < rc.total_s < 2 * plain.total_s


def test_a_kept_core_is_saved_and_not_rerun():
    """``+rc+keepcore`` keeps the attention core's output and log-sum-exp beside the layer's output, ``t b
    (a e + nq acc)`` whatever the strategy splits (heads or tokens, ``lean`` per head group), and its rerun
    runs no attention kernel: cheaper than ``+rc``, dearer than no recompute."""
    p, s = 4, 16384
    layout = SequenceLayout.build(s, p, causal=True)
    d = Dims(MHA, p, s, 1, 4)
    model = AnalyticCostModel(synthetic_profile(), MHA, p)
    core = d.t * d.b * (d.a * d.e + d.nq * d.acc)
    for attention in ("tp_sp", "ulysses", "ring", "lean"):
        plain, rc, kept = (LayerOption.parse(f"{attention}/zero3{flags}") for flags in ("", "+rc", "+rc+keepcore"))
        assert layer_terms(kept, d, layout).saved_bytes == layer_terms(rc, d, layout).saved_bytes + core, attention
        plain_s, rc_s, kept_s = (model.layer_cost(option, layout, 1).time_s for option in (plain, rc, kept))
        assert plain_s < kept_s < rc_s, attention


def test_time_is_compute_plus_synchronous_comm():
    """tp_sp with a profile whose only cost is 1 s per collective: 10 collectives per layer (per
    sublayer: AG and RS forward; AG of the output gradient, RS of the input gradient and AG of the
    input again backward)."""
    profile = synthetic_profile()
    zero = {"coef": [0.0, 0.0, 0.0]}
    profile["gemm"] = {"forward": zero, "backward": zero}
    no_time = {"per_call_s": 0.0, "by_head_dim": {"32": {"lengths": [1.0], "per_unit_s": [0.0]}}}
    profile["attention"].update(
        forward={"causal": no_time, "full": no_time}, backward={"causal": no_time, "full": no_time}
    )
    profile["elementwise"] = {"per_byte_s": 0.0, "per_op_s": 0.0}
    profile["collectives"]["4"] = {k: {"latency_s": 1.0, "per_byte_s": 0.0} for k in profile["collectives"]["4"]}
    model = AnalyticCostModel(profile, MHA, 4)
    layout = SequenceLayout.build(512, 4, causal=True)
    assert model.layer_cost(LayerOption("tp_sp", "tp_sp"), layout, 1).time_s == pytest.approx(10.0)
    # ring/zero3: 4 weight gathers forward, 4 again + 4 gradient reduce-scatters backward; hops: 3
    # forward, 4 backward accumulators + 3 K/V blocks, over compute that takes no time
    assert model.layer_cost(LayerOption("ring", "zero3"), layout, 1).time_s == pytest.approx(12.0 + 3 + 4 + 3)
    # lean: with nothing to hide behind, every streamed collective counts: attention 4 broadcasts
    # forward, 4 + 4 reduces backward, 4 rings of 10 hops; MLP 3 shard hops forward, 3 + 4 backward
    assert model.layer_cost(LayerOption("lean", "lean"), layout, 1).time_s == pytest.approx(4 + 8 + 40 + 3 + 7)
    # recompute reruns the forward's collectives; keeping the attention core, not its rings' forward hops
    for pair, rerun, ring_hops in (("ring/zero3", 4 + 3, 3), ("lean/lean", 4 + 12 + 3, 4 * 3)):
        plain, rc, kept = (
            model.layer_cost(LayerOption.parse(pair + f), layout, 1).time_s for f in ("", "+rc", "+rc+keepcore")
        )
        assert (rc - plain, kept - plain) == (pytest.approx(rerun), pytest.approx(rerun - ring_hops)), pair
    # the fitted correction: scales, a cost per synchronisation point (collective or hop), a constant
    profile["correction"] = {"compute": 1.0, "comm": 2.0, "per_sync_s": 0.5, "per_layer_s": 0.25, "fitted_on": []}
    corrected = AnalyticCostModel(profile, MHA, 4)
    assert corrected.time_breakdown(LayerOption("ring", "zero3"), layout, 1).syncs == 12 + 3 + 7
    assert corrected.layer_cost(LayerOption("tp_sp", "tp_sp"), layout, 1).time_s == pytest.approx(20 + 5 + 0.25)


def test_the_stage_time_prices_the_output_layer_and_loss_under_every_plan():
    """The stage's work outside its layers, counted by hand: per synchronisation 1 s (forward, the input's
    all-gather and the cross-entropy's 3 all-reduces as a reduce-scatter and an all-gather each; backward,
    the input gradient's reduce-scatter), per elementwise op 1 s (5 passes over the logits forward, 2
    backward), the output GEMM's forward and backward at the profile's rates; a chunked loss adds one
    forward per chunk. A stage without the output layer has none of it."""
    profile = synthetic_profile()
    zero = {"coef": [0.0, 0.0, 0.0]}
    profile["gemm"] = {"forward": zero, "backward": zero}
    profile["elementwise"] = {"per_byte_s": 0.0, "per_op_s": 0.0}
    profile["collectives"]["4"] = {k: {"latency_s": 1.0, "per_byte_s": 0.0} for k in profile["collectives"]["4"]}
    layout = SequenceLayout.build(2048, 4, causal=True)
    chunked = StageOptions(loss_chunk_tokens=512)  # 4 chunks of 128 rows on each of the 4 ranks

    def stage_time(profile: dict, stage: StageOptions = WHOLE_LOSS, vocab_size: int = 1024) -> float:
        return AnalyticCostModel(profile, MHA, 4, vocab_size=vocab_size).stage_time_s(layout, 1, stage)

    assert stage_time(profile) == pytest.approx(1 + 6 + 1)
    assert stage_time(profile, chunked) == pytest.approx(8 + 4 * 7)
    assert stage_time(profile, vocab_size=0) == stage_time(profile, chunked, vocab_size=0) == 0.0
    profile["collectives"]["4"] = {k: {"latency_s": 0.0, "per_byte_s": 0.0} for k in profile["collectives"]["4"]}
    profile["elementwise"] = {"per_byte_s": 0.0, "per_op_s": 1.0}
    assert stage_time(profile) == pytest.approx(5 + 2)
    profile["elementwise"] = {"per_byte_s": 0.0, "per_op_s": 0.0}
    profile["gemm"] = {"forward": {"coef": [0.0, 1e-9, 0.0]}, "backward": {"coef": [3.0, 0.0, 0.0]}}
    assert stage_time(profile) == pytest.approx(1e-9 * 2 * 2048 * 256 * 256 + 3.0)  # [2048, 256] x [256, 1024/4]


def test_a_measured_gemm_shape_is_priced_at_its_measured_rate_and_another_by_the_fit():
    """A calibrated profile keeps each measured ``(n, k)``'s seconds per FLOP at each measured ``m``
    (``gemm.<direction>.by_shape``): on an H200 the fit over a Llama-3-8B layer's own GEMMs priced them at
    820 TFLOP/s, where they ran at 645 to 801. Priced through the output layer's GEMM, ``[2048, 256] x
    [256, 1024/4]``: its rate interpolated in log m between the measured ones, flat beyond them; a shape
    not measured keeps the fit."""
    profile = synthetic_profile()
    zero = {"coef": [0.0, 0.0, 0.0]}
    profile["gemm"] = {"forward": dict(zero), "backward": {"coef": [3.0, 0.0, 0.0]}}
    profile["elementwise"] = {"per_byte_s": 0.0, "per_op_s": 0.0}
    profile["collectives"]["4"] = {k: {"latency_s": 0.0, "per_byte_s": 0.0} for k in profile["collectives"]["4"]}
    layout = SequenceLayout.build(2048, 4, causal=True)
    flops = 2 * 2048 * 256 * 256

    def stage_time(stage: StageOptions = WHOLE_LOSS) -> float:
        return AnalyticCostModel(profile, MHA, 4, vocab_size=1024).stage_time_s(layout, 1, stage)

    profile["gemm"]["forward"]["by_shape"] = {"256x256": {"m": [1024, 4096], "per_flop_s": [4e-9, 1e-9]}}
    # m = 2048, halfway in log m between 1024 and 4096; backward: this shape not measured, the fit's 3 s
    assert stage_time() == pytest.approx(2.5e-9 * flops + 3.0)
    # a chunked loss adds one forward per chunk of 128 rows on each of 4 ranks: m = 512, under the
    # measured ones, at the rate of the shortest
    assert stage_time(StageOptions(loss_chunk_tokens=512)) == pytest.approx(2.5e-9 * flops + 3.0 + 4e-9 * flops)
    profile["gemm"]["backward"]["by_shape"] = {"256x256": {"m": [1024], "per_flop_s": [7e-9]}}
    assert stage_time() == pytest.approx(2.5e-9 * flops + 7e-9 * flops)  # m over the measured: flat
    profile["gemm"]["forward"]["by_shape"] = {"512x256": {"m": [2048], "per_flop_s": [1.0]}}  # another shape
    assert stage_time() == pytest.approx(7e-9 * flops)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_stage_time_moves_activations_in_the_model_dtype_and_the_loss_statistics_in_fp32(dtype):
    """Per byte only: the output layer's input gathered forward and its gradient reduce-scattered backward,
    [2048, 256] in the model's dtype each; the cross-entropy's three all-reduces of one fp32 value per
    token, each a reduce-scatter and an all-gather."""
    profile = synthetic_profile()
    profile["dtype"] = str(dtype).removeprefix("torch.")
    zero = {"coef": [0.0, 0.0, 0.0]}
    profile["gemm"] = {"forward": zero, "backward": zero}
    profile["elementwise"] = {"per_byte_s": 0.0, "per_op_s": 0.0}
    profile["collectives"]["4"] = {k: {"latency_s": 0.0, "per_byte_s": 1.0} for k in profile["collectives"]["4"]}
    model = AnalyticCostModel(profile, MHA, 4, dtype=dtype, vocab_size=1024)
    layout = SequenceLayout.build(2048, 4, causal=True)
    element = torch.empty((), dtype=dtype).element_size()
    assert model.stage_time_s(layout, 1, WHOLE_LOSS) == 2 * 2048 * 256 * element + 3 * 2 * 4 * 2048


def test_peak_bytes_adds_static_saved_and_the_larger_working_set():
    """The whole step's terms written out by hand for one shape (``tests/megatron/test_step_memory.py`` measures
    them on gloo ranks); p=4, s=1024, b=2, h=256, V=32000, LayerNorm on the CPU."""
    profile = synthetic_profile()
    profile["allocator_slack"] = 0.1
    model = AnalyticCostModel(profile, MHA, 4, static_bytes=1e9, vocab_size=32000, rotary_dim=32)
    layout = SequenceLayout.build(1024, 4, causal=True)
    tokens = 1024 * 2
    full = tokens * 256 * 4
    weight_grad = 8000 * 256 * 4
    final_norm = full // 4 + 2 * (tokens // 4 * 4)  # output [s/p, b, h], mean and rstd [s/p, b]
    # fp32: the logits [s, b, V/p] are the cross-entropy's softmax and gradient; in backward the
    # projection's input gradient [s, b, h], reduce-scattered to [s/p, b, h], and its weight gradient
    # beside them (more than the forward's 37 B of per-token temporaries); kept throughout: the final
    # norm's output and statistics
    loss = tokens * 8000 * 4 + (full + full // 4 + weight_grad) + final_norm
    assert model.loss_bytes(layout, 2) == loss
    # the inputs (three int64 [b, s], an fp32 loss mask) and the layout's three int64 index tensors,
    # the stage's input [s/p, b, h], the embedding's mask and masked ids [b, s] (bool, int64), the
    # rotary table [s, 1, 1, 32] fp32 and Megatron's all-gather buffer [s, b, h], whatever the plan
    stage = tokens * 28 + 3 * 1024 * 8 + full // 4 + tokens * 9 + 1024 * 32 * 4 + full
    assert model.stage_bytes(layout, 2) == stage
    assert model.peak_bytes(layout, 2, 100.0, 50.0) == pytest.approx(1e9 + stage + 100 + 1.1 * loss)
    assert model.peak_bytes(layout, 2, 100.0, 2 * loss) == pytest.approx(1e9 + stage + 100 + 2.2 * loss)
    # a tied, unfused output layer's weight gradient waits for the embedding's beside every layer's
    # backward (a recomputed layer's high-water mark is in its backward), not beside its forward
    tied = AnalyticCostModel(
        profile, MHA, 4, static_bytes=1e9, vocab_size=32000, rotary_dim=32, tied_unfused_output=True
    )
    recomputed = LayerOption("tp_sp", "tp_sp", recompute=True)
    untied_cost, tied_cost = (m.layer_cost(recomputed, layout, 2) for m in (model, tied))
    assert tied_cost.transient_bytes == untied_cost.transient_bytes + weight_grad
    assert tied_cost.saved_bytes == untied_cost.saved_bytes
    assert tied.peak_bytes(layout, 2, 100.0, 2 * loss) == model.peak_bytes(layout, 2, 100.0, 2 * loss)
    # the loss in chunks of 256 gathered tokens (64 rows of each rank's 256): one chunk's logits, its
    # gathered and its own input gradient and the weight gradient, beside the chunks' input gradients
    # so far and the weight gradients' running sum; and the chunks' joined input gradient; the chunks'
    # per-token losses kept throughout
    rows, gathered = 64, 256 * 2
    row_grads = rows * 2 * 256 * 4
    chunk = gathered * 8000 * 4 + gathered * 256 * 4 + row_grads + weight_grad
    joined = max(full // 4 - row_grads + chunk + weight_grad, full // 4 + 3 * weight_grad, full // 2 + weight_grad)
    assert model.loss_bytes(layout, 2, chunk_tokens=256) == joined + final_norm + 4 * tokens
    chunked = StageOptions(256)
    assert model.stage_bytes(layout, 2, chunked) == stage
    # the output layer the only one to gather: Megatron's buffer holds one chunk [p * rows, b, h]
    assert model.stage_bytes(layout, 2, StageOptions(256, sequence_buffer=False)) == stage - full + gathered * 256 * 4
    assert model.peak_bytes(layout, 2, 100.0, 50.0, chunked) == pytest.approx(
        1e9 + stage + 100 + 1.1 * (joined + final_norm + 4 * tokens)
    )
    # bf16 logits: an fp32 copy beside them; the norm's statistics in bf16 on the CPU
    bf16 = synthetic_profile()
    bf16["dtype"] = "bfloat16"
    model = AnalyticCostModel(bf16, MHA, 4, dtype=torch.bfloat16, vocab_size=32000)
    full = tokens * 256 * 2
    final_norm = full // 4 + 2 * (tokens // 4 * 2)
    # the fp32 copy and the cross-entropy's per-token temporaries outweigh the backward
    expected = tokens * 8000 * (2 + 4) + tokens * (8 + 8 + 1 + 4 + 8 + 4 + 4) + final_norm
    assert model.loss_bytes(layout, 2) == expected
    assert AnalyticCostModel(profile, MHA, 4).loss_bytes(layout, 2) == 0  # no output layer on this stage


# -- profiles ----------------------------------------------------------------------------------------
def test_profile_round_trip(tmp_path):
    path = tmp_path / "profile.json"
    save_profile({k: v for k, v in synthetic_profile().items() if k not in ("schema", "version")}, path)
    loaded = load_profile(path, p=4)
    assert loaded["collectives"]["4"]["all_gather"]["latency_s"] == 5e-4
    model = AnalyticCostModel.from_file(path, MHA, 2)
    assert model.layer_cost(LayerOption("tp_sp", "tp_sp"), SequenceLayout.build(64, 2, causal=True), 1).time_s > 0


def _write(tmp_path, profile) -> str:
    path = tmp_path / "p.json"
    path.write_text(profile if isinstance(profile, str) else json.dumps(profile))
    return str(path)


def test_profile_errors_are_clear(tmp_path):
    with pytest.raises(ProfileError, match=r"does not exist; make one with `paradyse calibrate --output"):
        load_profile(tmp_path / "missing.json")
    with pytest.raises(ProfileError, match=r"is not valid JSON .*recalibrate"):
        load_profile(_write(tmp_path, '{"schema": '))
    with pytest.raises(ProfileError, match=r"is not a cost profile \(schema 'other'"):
        load_profile(_write(tmp_path, {**synthetic_profile(), "schema": "other"}))
    with pytest.raises(
        ProfileError,
        match=r"has version 1; this megatron-paradyse reads version 2 \(it prices collectives the older one did not",
    ):
        load_profile(_write(tmp_path, {**synthetic_profile(), "version": 1}))
    broken = synthetic_profile()
    del broken["collectives"]["4"]["send_recv"]["per_byte_s"], broken["gemm"]["backward"]
    with pytest.raises(ProfileError, match=r"lacks gemm.backward.coef, collectives.4.send_recv.per_byte_s"):
        load_profile(_write(tmp_path, broken))
    with pytest.raises(ProfileError, match=r"has no collectives for p=8 \(calibrated for p in \['2', '4'\]\)"):
        load_profile(_write(tmp_path, synthetic_profile()), p=8)
    other = synthetic_profile()
    other["fingerprint"] = {**other["fingerprint"], "torch": "1.0", "device_name": "elsewhere"}
    with pytest.raises(ProfileError, match=r"another machine or software \(device_name: .*torch: profile '1.0'"):
        load_profile(_write(tmp_path, other))
    assert load_profile(_write(tmp_path, other), check_machine=False)["fingerprint"]["torch"] == "1.0"


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["calibrate", "--output", "x.json", "--p", "two"])
    assert exit_info.value.code == 2
    assert "--p takes group sizes like 2,4, got 'two'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["calibrate", "--output", "/nonexistent/profile.json"])
    assert exit_info.value.code == 2
    assert "paradyse: error: cannot write the profile to /nonexistent/profile.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main([])


# -- fitting and the empirical mode ----------------------------------------------------------------
def test_fit_nonnegative_recovers_coefficients_and_clips():
    x = np.array([[1.0, n, n * n] for n in (1.0, 2.0, 5.0, 10.0, 40.0)])
    assert fit_nonnegative(x, x @ [0.5, 0.0, 0.25]) == pytest.approx([0.5, 0.0, 0.25], abs=1e-9)
    coef = fit_nonnegative(x, x @ [1.0, -0.01, 0.1])  # a negative slope is dropped, never returned
    assert (coef >= 0).all()
    floored = fit_nonnegative(x, x @ [0.5, 0.0, 0.25], floor=[0.0, 1.0, 0.0])
    assert floored[1] >= 1.0 and floored[0] >= 0 and floored[2] >= 0
    assert mape([110, 90], [100, 100]) == pytest.approx(10.0)


def test_aic_picks_the_degree_of_the_data():
    x = np.arange(1, 9, dtype=float)
    assert len(aic_polynomial(x, 3 * x + 1)) == 2
    rng = np.random.default_rng(0)
    cubic = 0.5 * x**3 - x + 2 + rng.normal(0, 1e-3, x.size)
    assert len(aic_polynomial(x, cubic)) == 4


def test_empirical_model_interpolates_with_the_forest_and_extrapolates_with_the_polynomial():
    lengths = [256, 512, 1024, 2048, 4096]
    regressor = HybridRegressor(lengths, [1e-6 * s * s for s in lengths])
    assert regressor(8192) == pytest.approx(1e-6 * 8192**2, rel=1e-6)  # quadratic, extrapolated exactly
    assert regressor(1024) == pytest.approx(1e-6 * 1024**2, rel=0.3)  # forest: near the measured point
    option = LayerOption("tp_sp", "tp_sp")
    model = EmpiricalCostModel([Sample(option, s, 1e-3 * s, 10.0 * s, 15.0 * s) for s in lengths])
    cost = model.layer_cost(option, SequenceLayout.build(8192, 4, causal=True), 1)
    assert cost.time_s == pytest.approx(8.192) and cost.saved_bytes + cost.transient_bytes == pytest.approx(15 * 8192)
    with pytest.raises(ValueError, match=r"no measurements of ring/zero3; measured: tp_sp/tp_sp"):
        model.layer_cost(LayerOption("ring", "zero3"), SequenceLayout.build(64, 4, causal=True), 1)


def test_profile_dtype_must_match_the_model():
    with pytest.raises(ValueError, match=r"measured in float32, the model runs in bfloat16; run `paradyse calibrate"):
        AnalyticCostModel(synthetic_profile(), MHA, 4, dtype=torch.bfloat16)


def test_ring_is_priced_at_its_slowest_rank():
    """Packed documents give ring ranks different blocks: the layer waits for the busiest one."""
    model = AnalyticCostModel(synthetic_profile(), MHA, 4)
    layout = SequenceLayout.build((3000, 100, 20), 4, causal=True)
    option = LayerOption("ring", "zero3")
    per_rank = [time.total_s for time, _, _ in model._per_rank(option, layout, 1)]
    assert len(set(per_rank)) > 1
    assert model.layer_cost(option, layout, 1).time_s == max(per_rank)


def test_memoised_scripts_give_what_a_cold_evaluation_gives():
    """Ring hops, lean's head groups and the scripts around the ring are memoised by what each one
    depends on: every rank's ring and lean memory, computed one after another (the memos warm with
    the other strategy's and ranks' iterations), equals the same memory computed with every memo
    cleared first."""
    layout = SequenceLayout.build((3000, 100, 20), 4, causal=True)
    d = Dims(GQA, 4, layout.padded_len, 2, 2, rotary_dim=16)
    warm = {
        (name, rank): sublayer_memory("attention", name, d, layout, rank)
        for name in ("ring", "lean")
        for rank in range(4)
    }
    memos = [
        f for module in (attention_allocations, ring, lean) for f in vars(module).values() if hasattr(f, "cache_clear")
    ]
    assert len(memos) >= 5
    for (name, rank), expected in warm.items():
        for memo in memos:
            memo.cache_clear()
        assert sublayer_memory("attention", name, d, layout, rank) == expected, (name, rank)


def test_mlp_memory_and_terms_are_the_same_on_every_rank():
    """The analytic model prices MLPs on rank 0 only (its memo relies on it)."""
    layout = SequenceLayout.build((3000, 100, 20), 4, causal=True)
    d = Dims(GQA, 4, layout.padded_len, 2, 4)
    for name in ("tp_sp", "zero3", "lean"):
        assert all(
            sublayer_terms("mlp", name, d, layout, r) == sublayer_terms("mlp", name, d, layout) for r in range(4)
        )
        assert all(
            sublayer_memory("mlp", name, d, layout, r) == sublayer_memory("mlp", name, d, layout) for r in range(4)
        )
