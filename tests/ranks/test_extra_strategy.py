"""A strategy is one record: registered from one file, it is run, listed, validated, priced and planned
without a change anywhere else.

The extra strategy is registered inside the rank processes only (the test process's library stays as
shipped): ``gathered``, an MLP that all-gathers the sequence, applies this rank's TP shards of fc1 and
fc2 with ``torch.nn.functional.linear`` and reduce-scatters the result (what ``tp_sp`` does through
Megatron's modules). It borrows ``tp_sp``'s time terms, which describe the same collectives and GEMMs,
writes no memory (recorded from its own code: it keeps the gathered input where ``tp_sp`` gathers it
again), and refuses gated MLPs to show that its own precondition is honoured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_paradyse.core.comm import all_gather_seq, reduce_scatter_seq
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.core.plan import LayerOption

NAME = "gathered"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _gathered_mlp(x_local, w, ctx):
    from megatron_paradyse.strategies.common import activate, add_bias

    h = F.linear(all_gather_seq(x_local, ctx.group), w.fc1, w.fc1_bias)  # [s, b, ffn/p]
    h = activate(h, ctx.shape, ctx.activation, blocks=1)
    return add_bias(reduce_scatter_seq(F.linear(h, w.fc2), ctx.group), w.fc2_bias)


def _register() -> None:
    from megatron_paradyse.strategies import Strategy, register, tp_sp

    register(
        Strategy(
            name=NAME,
            sublayer="mlp",
            forward=_gathered_mlp,
            terms=tp_sp.mlp_terms,
            unsupported=lambda shape, p: "a gated MLP's shard is two blocks" if shape.gated_mlp else None,
            summary="all-gather + reduce-scatter of [s,b,h] around this rank's shards",
        )
    )


def _extra_strategy_on_rank(rank: int, p: int) -> dict:
    from megatron_paradyse.cli import main as cli_main
    from megatron_paradyse.core.layout import SequenceLayout
    from megatron_paradyse.cost.analytic import AnalyticCostModel
    from megatron_paradyse.planner import Planner, PlannerConfig, layer_options
    from megatron_paradyse.strategies import MLPContext, run_mlp, strategy_names

    from helpers.cost_profiles import GQA, MHA, synthetic_profile
    from helpers.numerics import rel_err
    from helpers.reference_model import StackConfig, make_params, shard_layer
    from helpers.strategy_stack import model_shape

    _register()
    found = {"names": strategy_names("mlp")}

    listing = io.StringIO()
    with contextlib.redirect_stdout(listing):
        cli_main(["strategies"])
    found["listed"] = [line.split()[:2] for line in listing.getvalue().splitlines()]

    shape = model_shape(p, gqa=False)
    layer = make_params(StackConfig(shape=shape, num_layers=1, causal=True), seed=3)[0]
    _, weights = shard_layer(layer, shape, p, rank)
    x = torch.randn(8, 2, shape.hidden_size, generator=torch.Generator().manual_seed(rank))
    ctx = MLPContext(group=dist.group.WORLD, shape=shape, activation=F.gelu)
    found["error_vs_zero3"] = {}
    for name, dtype in DTYPES.items():
        cast = dataclasses.replace(weights, fc1=weights.fc1.to(dtype), fc2=weights.fc2.to(dtype))
        cast = dataclasses.replace(cast, fc1_bias=cast.fc1_bias.to(dtype), fc2_bias=cast.fc2_bias.to(dtype))
        ours, zero3 = run_mlp(NAME, x.to(dtype), cast, ctx), run_mlp("zero3", x.to(dtype), cast, ctx)
        found["error_vs_zero3"][name] = rel_err(ours.float(), zero3.float())

    with pytest.raises(ValueError) as unknown:
        PlannerConfig(mlp=["gatherd"])
    found["unknown"] = str(unknown.value)
    found["gated_excluded"] = layer_options(PlannerConfig(mlp=[NAME, "zero3"]), GQA, p)[1]

    model = AnalyticCostModel(synthetic_profile(), MHA, p)
    layout = SequenceLayout.build(4096, p, causal=True)
    ours, borrowed = (model.layer_cost(LayerOption("ulysses", mlp), layout, 1) for mlp in (NAME, "tp_sp"))
    found["priced"] = ours.time_s == borrowed.time_s, ours.saved_bytes - borrowed.saved_bytes
    found["memory"] = _saved_by_code(ctx, weights, shape, p), _saved_recorded(shape, p)
    config = PlannerConfig(attention=["ulysses"], mlp=[NAME])
    planner = Planner.for_model(config, model, shape=MHA, p=p, num_layers=4, budget_bytes=64 * 2**30)
    found["planned"] = {str(option) for option in planner.decide(layout).plan}
    return found


def _saved_by_code(ctx, weights, shape, p: int) -> dict[str, int]:
    """What the extra strategy's forward keeps for backward on this rank, per dtype, counted for real."""
    from megatron_paradyse.core.memory import _StorageTracker
    from megatron_paradyse.strategies import run_mlp

    saved = {}
    for name, dtype in DTYPES.items():  # trained weights: autograd keeps what their gradients need
        cast = {f: getattr(weights, f).to(dtype).requires_grad_() for f in ("fc1", "fc2", "fc1_bias", "fc2_bias")}
        cast = dataclasses.replace(weights, **cast)
        x0 = torch.randn(16, 1, shape.hidden_size, dtype=dtype, requires_grad=True)
        with _StorageTracker() as tracker:
            x = x0.clone()
            y = run_mlp(NAME, x, cast, ctx)
            del x
            saved[name] = tracker.live - y.numel() * y.element_size()
            del y
    return saved


def _saved_recorded(shape, p: int) -> dict[str, float]:
    from megatron_paradyse.core.layout import SequenceLayout
    from megatron_paradyse.cost.layer_memory import sublayer_memory
    from megatron_paradyse.strategies.dims import Dims

    layout = SequenceLayout.build(16 * p, p, causal=True)
    return {
        name: sublayer_memory("mlp", NAME, Dims(shape, p, layout.padded_len, 1, dtype.itemsize), layout).saved_bytes
        for name, dtype in DTYPES.items()
    }


def test_a_strategy_registered_from_one_file_is_run_listed_validated_priced_and_planned():
    from megatron_paradyse.strategies import strategy_names

    for found in run_on_ranks(_extra_strategy_on_rank, 2, timeout_s=300):
        assert found["names"] == ["tp_sp", "zero3", "zero3_actrc", "lean", NAME]
        assert ["mlp", NAME] in found["listed"]
        errors = found["error_vs_zero3"]  # the same sums, in another order
        assert errors["fp32"] < 1e-6 and errors["bf16"] < 2e-2 and errors["fp16"] < 2e-3, errors
        assert found["unknown"] == (
            "planner.mlp: unknown mlp strategy 'gatherd'; known: tp_sp, zero3, zero3_actrc, lean, gathered"
        )
        assert found["gated_excluded"] == {f"mlp {NAME}": "a gated MLP's shard is two blocks"}
        same_time, more_saved = found["priced"]
        assert same_time
        assert more_saved > 0  # its own memory, not tp_sp's: it keeps the gathered input
        measured, recorded = found["memory"]
        assert measured == recorded, found["memory"]
        assert found["planned"] <= {f"ulysses/{NAME}", f"ulysses/{NAME}+rc"}, found["planned"]
    assert NAME not in strategy_names("mlp")  # registered in the ranks only
