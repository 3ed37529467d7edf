"""The baseline a tuned Megatron user runs: every static configuration of a node priced, the fastest that
trains the dataset's longest sequence chosen, and what cannot run said."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.hardware import stage_params_per_rank
from megatron_paradyse.planner import Planner, PlannerConfig
from megatron_paradyse.simulation.node import NodeModel
from megatron_paradyse.simulation.tuned import MegatronConfig, describe, megatron_configs, tuned_megatron
from megatron_paradyse.strategies import ModelShape

SHAPE = ModelShape(hidden_size=256, num_attention_heads=8, num_query_groups=8, kv_channels=32, ffn_hidden_size=1024)
LAYERS = 4


def _node(shape: ModelShape, budget_gib: float) -> NodeModel:
    return NodeModel(
        gpu="a100",
        shape=shape,
        num_layers=LAYERS,
        causal=True,
        budget_bytes=budget_gib * 2**30,
        planner=PlannerConfig(recompute=False, on_infeasible="stop"),
    )


def _edge(n: int, longest: int) -> int:
    """The planner's bucket: a multiple of 512 tokens, the last one ending at the longest sequence."""
    return min(-(-n // 512) * 512, longest)


def _by_hand(node: NodeModel, config: MegatronConfig, lengths: list[int]) -> float:
    """The configuration's time over ``lengths``: its layers at each bucket's edge, ``recomputed`` of them
    recomputed, ``DP`` sequences a step taking the longest one's time, the gradients' reduce-scatter
    (fp32) and the parameters' all-gather (bf16) across the replicas at the A100's published 230 GB/s bus
    bandwidth and 20 us a collective, 90% of the shorter of them and the step hidden behind the other."""
    cost = node.cost_model(config.group, dp=config.dp)
    recomputed = dataclasses.replace(config.pair, recompute=True)
    times = []
    for n in lengths:
        layout = SequenceLayout.build(_edge(n, lengths[-1]), config.group, causal=True)
        whole = (LAYERS - config.recomputed) * cost.layer_cost(config.pair, layout, 1).time_s
        times.append(whole + config.recomputed * cost.layer_cost(recomputed, layout, 1).time_s)
    dp = config.dp
    params = stage_params_per_rank(SHAPE, LAYERS, config.group)
    sync = 0.0 if dp == 1 else 2 * 20e-6 + 6 * params * (dp - 1) / dp / 230e9
    total = 0.0
    for start in range(0, len(times), dp):
        step = max(times[start : start + dp])
        total += max(step, sync) + 0.1 * min(step, sync)
    return total


def _fits(node: NodeModel, config: MegatronConfig, recomputed: int, tokens: int) -> bool:
    """Whether ``config``'s layout fits ``tokens`` with ``recomputed`` of its layers recomputed."""
    options = (config.pair, dataclasses.replace(config.pair, recompute=True))
    cost = node.cost_model(config.group, dp=config.dp)
    planner = Planner(
        PlannerConfig(bucket_tokens=1), cost, options=options, num_layers=LAYERS, budget_bytes=node.budget_bytes
    )
    problem = planner.stage_problem(SequenceLayout.build(tokens, config.group, causal=True))
    return problem.fits(problem.evaluate((LAYERS - recomputed, recomputed)))


def test_the_tuned_configuration_is_the_fastest_that_trains_the_longest_sequence():
    lengths = [2048] * 24 + [4096] * 7 + [200_000]
    node = _node(SHAPE, budget_gib=1.0)
    tuned = tuned_megatron(node, lengths)
    assert [c.layout for c in tuned.curves] == [c.layout for c in megatron_configs(8)] and not tuned.cannot_run
    finished = {c for c, curve in tuned.curves.items() if curve.stopped_at is None}
    stopped = set(tuned.curves) - finished
    assert finished and stopped  # the budget must rule some layouts out at the longest sequence
    for config in finished:
        assert tuned.curves[config].total_s == pytest.approx(_by_hand(node, config, lengths), rel=1e-9), config
        # the fewest recomputed layers under which the longest sequence fits: one fewer does not
        assert _fits(node, config, config.recomputed, 200_000), config
        assert config.recomputed == 0 or not _fits(node, config, config.recomputed - 1, 200_000), config
    assert any(0 < c.recomputed < LAYERS for c in finished)  # some recompute part of their layers
    for config in stopped:  # even recomputing every layer
        assert config.recomputed == LAYERS and not _fits(node, config, LAYERS, 200_000), config
        assert tuned.curves[config].stopped_at == 200_000 and tuned.curves[config].max_feasible < 200_000
    assert tuned.chosen == min(finished, key=lambda c: tuned.curves[c].total_s)
    assert tuned.fitting == len(finished)
    # a layout faster over the short sequences is not run: the longest does not fit it
    fastest_short = min(tuned.curves, key=lambda c: tuned.curves[c].cumulative_at(4096))
    assert fastest_short in stopped
    assert describe(tuned, tuned.curves[tuned.chosen]).startswith(
        f"tuned Megatron: {tuned.chosen}, the fastest of the {len(finished)} of 6 layouts that train every "
        f"sequence, each recomputing the fewest layers it needs; last step "
    )


def test_where_none_trains_every_sequence_the_one_reaching_furthest_is_run():
    lengths = [2048] * 8 + [4_000_000]
    tuned = tuned_megatron(_node(SHAPE, budget_gib=1.0), lengths)
    assert tuned.fitting == 0
    furthest = max(curve.max_feasible for curve in tuned.curves.values())
    assert tuned.curve.max_feasible == furthest
    assert "none of the 6 layouts trains every sequence, even recomputing every layer; this reaches furthest" in (
        describe(tuned, tuned.curve)
    )


def test_configurations_that_cannot_run_the_model_are_said_with_the_reason():
    four_groups = ModelShape(
        hidden_size=256, num_attention_heads=8, num_query_groups=4, kv_channels=32, ffn_hidden_size=1024
    )
    tuned = tuned_megatron(_node(four_groups, budget_gib=4.0), [2048, 4096])
    assert {c.layout for c in [*tuned.curves, *tuned.cannot_run]} == {c.layout for c in megatron_configs(8)}
    assert [c.layout for c in tuned.cannot_run] == ["TP=8 CP=1 DP=1", "TP=1 CP=8 a2a DP=1", "TP=1 CP=8 p2p DP=1"]
    line = describe(tuned, tuned.curve)
    assert (
        "; TP=8 CP=1 DP=1 cannot run this model: attention tp_sp: num_query_groups=4 is not divisible by p=8 "
        "(Megatron would split a key/value head across ranks); mlp tp_sp: num_query_groups=4"
    ) in line
    assert "; TP=1 CP=8 p2p DP=1 cannot run this model: attention ring: " in line


def test_the_configurations_of_a_group_of_gpus():
    assert [c.layout for c in megatron_configs(2)] == [
        "TP=1 CP=1 DP=2",
        "TP=2 CP=1 DP=1",
        "TP=1 CP=2 a2a DP=1",
        "TP=1 CP=2 p2p DP=1",
    ]
    assert [c.layout for c in megatron_configs(1)] == ["TP=1 CP=1 DP=1"]
    assert str(MegatronConfig(1, 8, 1, "a2a", 32, 32)) == "TP=1 CP=8 a2a DP=1 full recompute"
    assert str(MegatronConfig(8, 1, 1, "", 20, 32)) == "TP=8 CP=1 DP=1 recompute 20 of 32 layers"
    assert str(MegatronConfig(2, 1, 4, "", 0, 32)) == "TP=2 CP=1 DP=4 no recompute"
    assert MegatronConfig(1, 8, 1, "p2p").pair == LayerOption("ring", "zero3")
    with pytest.raises(ValueError, match=r"^a tuned Megatron configuration is priced on 1, 2, 4, 8 GPUs, not 16$"):
        megatron_configs(16)


def test_data_parallel_steps_take_their_longest_sequence():
    lengths = list(np.linspace(1024, 8192, 9).astype(int))
    tuned = tuned_megatron(_node(SHAPE, budget_gib=4.0), lengths)
    curve = next(curve for config, curve in tuned.curves.items() if config.layout == "TP=2 CP=1 DP=4")
    assert curve.cumulative_s[:4] == [curve.cumulative_s[3]] * 4  # one step of four replicas
    assert curve.cumulative_s[8] > curve.cumulative_s[7] == curve.cumulative_s[4]  # the last step: one sequence
