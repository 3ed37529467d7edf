"""Switching strategies between iterations moves nothing; bad input is refused by name, early.

The switching run trains a 4-layer stack for three iterations, each under a different plan, with a
momentum optimizer over Megatron's TP shards, and checks that every parameter, gradient and optimizer
state tensor keeps its storage, and that the weights equal a single-rank run of the same three steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_paradyse.attention import get_kernel
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.strategies import (
    AttentionContext,
    AttentionWeights,
    MLPContext,
    ModelShape,
    available_strategies,
    run_attention,
    run_mlp,
    strategy_names,
)

from helpers.numerics import rel_err
from helpers.reference_model import StackConfig, make_params, reference_forward, shard_layer
from helpers.strategy_stack import fields, held_by_megatron_linears, model_shape, run_stack

PLANS = [
    (("tp_sp", "tp_sp"),) * 4,
    (("ring", "zero3"), ("ulysses", "tp_sp"), ("tp_sp", "zero3"), ("ring", "tp_sp")),
    (("ulysses", "zero3"), ("lean", "lean"), ("lean", "zero3"), ("tp_sp", "lean")),
]
LR, MOMENTUM = 1e-3, 0.9


def _storages(params, optimizer) -> list[int]:
    ptrs = []
    for t in params:
        ptrs += [t.data_ptr(), t.grad.data_ptr(), optimizer.state[t]["momentum_buffer"].data_ptr()]
    return ptrs


def _switching_run(rank: int, p: int) -> dict:
    group = dist.group.WORLD
    cfg = StackConfig(model_shape(p, gqa=True), 4, causal=True)
    layers = make_params(cfg, seed=7)
    layout = SequenceLayout.build(8 * p - 3, p, causal=True)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(layout.valid_len, 2, cfg.shape.hidden_size, generator=gen)
    g = torch.rand(x.shape, generator=gen)
    local = layout.local_slice(rank)

    shards = [held_by_megatron_linears(shard_layer(layer, cfg.shape, p, rank), cfg.shape, group) for layer in layers]
    norms = [{k: layer[k].clone() for k in ("ln1_w", "ln1_b", "ln2_w", "ln2_b")} for layer in layers]
    sharded = [t for aw, mw in shards for t in (*fields(aw), *fields(mw)) if t is not None]
    replicated = [t for n in norms for t in n.values()] + [
        t for aw, mw in shards for t in (aw.proj_bias, mw.fc2_bias) if t is not None
    ]
    for t in sharded + replicated:
        t.requires_grad_()
    params = list(dict.fromkeys(sharded + replicated))  # proj/fc2 biases are in both lists
    optimizer = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)

    reference = [{k: None if v is None else v.clone().requires_grad_() for k, v in layer.items()} for layer in layers]
    ref_params = [t for layer in reference for t in layer.values() if t is not None]
    ref_optimizer = torch.optim.SGD(ref_params, lr=LR, momentum=MOMENTUM)

    moved = []
    for step, plan in enumerate(PLANS):
        optimizer.zero_grad(set_to_none=False)  # gradients stay where they are, as Megatron's buffers do
        x_local = layout.to_canonical(x)[local]
        y_local = run_stack(x_local, *zip(*shards), norms, plan, layout, cfg, group)
        (y_local.square() * layout.to_canonical(g)[local]).sum().backward()
        for t in replicated:
            dist.all_reduce(t.grad, group=group)
        optimizer.step()
        if step == 0:
            storages = _storages(params, optimizer)
        elif _storages(params, optimizer) != storages:
            moved.append(step)

        ref_optimizer.zero_grad()
        (reference_forward(x, reference, cfg, layout.doc_lengths).square() * g).sum().backward()
        ref_optimizer.step()

    errors = []
    for (aw, mw), norm, ref in zip(shards, norms, reference):
        ref_aw, ref_mw = shard_layer({k: None if v is None else v.detach() for k, v in ref.items()}, cfg.shape, p, rank)
        for mine, theirs in zip((*fields(aw), *fields(mw)), (*fields(ref_aw), *fields(ref_mw))):
            if mine is not None:
                errors.append(rel_err(mine.detach(), theirs))
        errors += [rel_err(norm[k].detach(), ref[k].detach()) for k in norm]
    return {"moved_at_steps": moved, "max_weight_err": max(errors)}


def _error_cases(rank: int, p: int) -> dict[str, str]:
    """Each wrong input, on every rank, before any collective: the messages come back."""
    group = dist.group.WORLD
    shape = model_shape(p, gqa=False)
    layout = SequenceLayout.build(13, p, causal=True)
    cfg = StackConfig(shape, 1, causal=True)
    aw, mw = shard_layer(make_params(cfg, seed=1)[0], shape, p, rank)
    ctx = AttentionContext(
        group=group,
        layout=layout,
        shape=shape,
        kernel=get_kernel("torch", torch.device("cpu"), torch.float32),
        softmax_scale=1.0,
    )
    x_local = torch.zeros(layout.local_len, 1, shape.hidden_size)
    bad_shape = ModelShape(hidden_size=32, num_attention_heads=3, num_query_groups=3, kv_channels=8, ffn_hidden_size=24)
    cases = {
        "unknown": lambda: run_attention("nope", x_local, aw, ctx),
        "unpadded": lambda: run_attention("ring", x_local[:6], aw, ctx),
        "heads": lambda: run_attention(
            "ulysses", x_local, aw, AttentionContext(**{**ctx.__dict__, "shape": bad_shape})
        ),
        "group": lambda: run_attention(
            "tp_sp",
            x_local,
            aw,
            AttentionContext(**{**ctx.__dict__, "layout": SequenceLayout.build(13, 3, causal=True)}),
        ),
        "weights": lambda: run_attention("tp_sp", x_local, AttentionWeights(qkv=aw.qkv[1:], proj=aw.proj), ctx),
        "mlp_unknown": lambda: run_mlp("ring", x_local, mw, MLPContext(group=group, shape=shape, activation=F.gelu)),
    }
    messages = {}
    for name, call in cases.items():
        try:
            call()
            messages[name] = "no error"
        except ValueError as e:
            messages[name] = str(e)
    dist.barrier(group=group)  # every rank got here: nothing was left waiting in a collective
    return messages


@pytest.mark.parametrize("p", [2, 3])
def test_switching_moves_no_state_and_trains_like_one_rank(p):
    for rank, result in enumerate(run_on_ranks(_switching_run, p, timeout_s=300)):
        assert result["moved_at_steps"] == [], f"rank {rank}: state moved at a switch"
        # Three SGD steps of weights that match to ~1e-6 after each step.
        assert result["max_weight_err"] <= 1e-5, f"rank {rank}: weights off by {result['max_weight_err']:.2e}"


def test_wrong_input_is_refused_by_name_on_every_rank():
    for messages in run_on_ranks(_error_cases, 2, timeout_s=300):
        assert messages["unknown"].startswith("unknown attention strategy 'nope'; known: tp_sp, ulysses, ring")
        assert messages["unpadded"].startswith(
            "x_local has 6 tokens on dim 0, but the layout puts 8 on each of p=2 ranks (13 tokens padded to 16, "
            "a multiple of 2p)"
        )
        assert messages["heads"] == (
            "attention strategy 'ulysses' cannot run this model on p=2 ranks: num_attention_heads=3 is not "
            "divisible by p=2; num_query_groups=3 is not divisible by p=2 (Megatron would split a key/value "
            "head across ranks)"
        )
        assert messages["group"] == "the sequence layout is for p=3 ranks, but the group has 2"
        assert (
            messages["weights"] == "linear_qkv.weight has shape (47, 32), but the model's TP shard for p=2 is (48, 32)"
        )
        assert messages["mlp_unknown"].startswith("unknown mlp strategy 'ring'; known: tp_sp, zero3")


def test_strategies_a_model_cannot_run_are_reported_with_the_reason():
    shape = ModelShape(hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8, ffn_hidden_size=24)
    usable, excluded = available_strategies("attention", shape, 3)
    assert usable == []
    reason = (
        "num_attention_heads=4 is not divisible by p=3; num_query_groups=2 is not divisible by p=3 (Megatron would "
        "split a key/value head across ranks)"
    )
    assert excluded == dict.fromkeys(strategy_names("attention"), reason)
    assert available_strategies("attention", shape, 2) == (strategy_names("attention"), {})
