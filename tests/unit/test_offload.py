"""Activation offload, single process: the mechanism, its price in the cost model, the planner's use of it.

Exactness inside a Megatron model on gloo ranks (every strategy, p in 1..4) is in test_megatron_spec.py,
the whole step's device memory in test_step_memory.py, nothing left behind in test_recompute.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.memory import PeakMemory, host_memory
from megatron_paradyse.core.offload import ActivationOffload
from megatron_paradyse.core.plan import LayerOption, Plan
from megatron_paradyse.cost.analytic import AnalyticCostModel
from megatron_paradyse.cost.base import LayerCost, stage_layer_bytes
from megatron_paradyse.cost.profile import ProfileError, load_profile
from megatron_paradyse.planner import PlannerConfig, StageProblem
from megatron_paradyse.strategies.recompute import recompute

from helpers.cost_profiles import MHA, synthetic_profile
from helpers.planner_cost_models import llama3_8b_head_planner

GIB = 2**30


# -- the mechanism ---------------------------------------------------------------------------------------
def _layers(weights: list[torch.Tensor], x: torch.Tensor, offload: ActivationOffload | None, rc: bool) -> torch.Tensor:
    """Residual tanh layers, each recomputed (its input offloaded with ``offload``) or not."""
    for w in weights:
        layer = lambda x, w=w: x + torch.tanh(x @ w)  # noqa: E731
        x = recompute(layer, x, offload=offload) if rc else layer(x)
    return x


def test_offloaded_recompute_gives_the_plain_gradients_and_keeps_inputs_on_the_host():
    torch.manual_seed(0)
    weights = [(0.3 * torch.randn(64, 64)).requires_grad_() for _ in range(4)]
    x = torch.randn(256, 64, requires_grad=True)
    dy = torch.randn(256, 64)

    def grads(offload, rc):
        _layers(weights, x, offload, rc).backward(dy)
        out = [t.grad.clone() for t in (x, *weights)]
        for t in (x, *weights):
            t.grad = None
        return out

    plain = grads(None, False)
    offload = ActivationOffload()
    for got, want in zip(grads(offload, True), plain):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    activation = 256 * 64 * 4
    assert offload.host_peak_bytes == 4 * activation  # every layer's input, at the end of the forward
    assert offload.host_bytes == 0  # all brought back, in backward


def test_offloaded_inputs_leave_the_device():
    """Four layers of ``y = x + tanh(x w)`` on an input no one else holds. Device memory at the end of the
    forward: without offload each layer's input and the output; with offload the output only."""
    torch.manual_seed(0)
    weights = [(0.3 * torch.randn(64, 64)).requires_grad_() for _ in range(4)]
    activation = 1024 * 64 * 4

    def forward_bytes(offload):
        x = torch.randn(1024, 64, requires_grad=True)
        with PeakMemory() as memory:
            y = _layers(weights, x.clone(), offload, True)
            held = memory.current_bytes()
            y.sum().backward()
        return held, memory.peak_bytes

    held_rc, peak_rc = forward_bytes(None)
    held_off, peak_off = forward_bytes(ActivationOffload())
    assert held_rc == 5 * activation
    assert held_off == activation
    assert peak_off < peak_rc


def test_an_offloaded_input_comes_back_once():
    w = torch.randn(8, 8, requires_grad=True)
    y = recompute(lambda x: torch.tanh(x @ w), torch.randn(4, 8, requires_grad=True), offload=ActivationOffload())
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"an offloaded activation is brought back once.*'\+rc', not '\+rc\+off'"):
        y.sum().backward()


def test_the_cpu_tracker_leaves_host_memory_out():
    with PeakMemory() as memory:
        with host_memory():
            host = torch.ones(1000)
        device = host.clone()
    assert memory.peak_bytes == device.nbytes


# -- options and config ----------------------------------------------------------------------------------
def test_offload_is_written_after_recompute_and_needs_it():
    assert str(LayerOption("ring", "zero3", True, True)) == "ring/zero3+rc+off"
    assert LayerOption.parse("ring/zero3+rc+off") == LayerOption("ring", "zero3", True, True)
    with pytest.raises(
        ValueError, match=r"ring/zero3: offload moves a recomputed layer's input .*'ring/zero3\+rc\+off'"
    ):
        LayerOption("ring", "zero3", False, True)
    with pytest.raises(
        ValueError,
        match=r"a layer option reads .*'\+rc', '\+keepcore', '\+off' as they apply .*got 'ring/zero3\+off'",
    ):
        LayerOption.parse("ring/zero3+off")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"host_memory_gib": -1}, r"planner.host_memory_gib must be a non-negative number of GiB per rank"),
        ({"host_memory_gib": 8, "recompute": False}, r"planner.host_memory_gib .* needs planner.recompute: true"),
    ],
)
def test_config_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        PlannerConfig(**fields)


def test_host_memory_adds_the_offloaded_options():
    from megatron_paradyse.planner.config import layer_options

    plain, _ = layer_options(PlannerConfig(pairs=("ring/zero3",)), MHA, 4)
    offloading, _ = layer_options(PlannerConfig(pairs=("ring/zero3",), host_memory_gib=1), MHA, 4)
    recomputed = ["ring/zero3", "ring/zero3+rc", "ring/zero3+rc+keepcore"]
    assert [str(o) for o in plain] == recomputed
    assert [str(o) for o in offloading] == [*recomputed, "ring/zero3+rc+off", "ring/zero3+rc+keepcore+off"]


# -- the cost model --------------------------------------------------------------------------------------
def _host_profile(overlap: float = 0.0) -> dict:
    return {**synthetic_profile(), "host_link": {"latency_s": 1e-4, "per_byte_s": 1e-9, "overlap": overlap}}


@pytest.mark.parametrize("option", ["ring/zero3", "tp_sp/lean", "ulysses/tp_sp"])
def test_an_offloaded_layer_trades_its_saved_activation_for_host_memory(option):
    layout = SequenceLayout.build(4096, 4, causal=True)
    model = AnalyticCostModel(_host_profile(), MHA, 4)
    rc = model.layer_cost(LayerOption.parse(option + "+rc"), layout, 1)
    off = model.layer_cost(LayerOption.parse(option + "+rc+off"), layout, 1)
    activation = 1024 * 256 * 4
    assert (rc.saved_bytes, rc.host_bytes) == (activation, 0)
    assert (off.saved_bytes, off.host_bytes) == (0, activation)
    # the next offloaded layer's input prefetched beside its backward
    assert off.saved_bytes + off.transient_bytes == rc.saved_bytes + rc.transient_bytes + activation
    # on CPU the two copies run in line: each is the link's latency and bytes
    assert off.time_s == pytest.approx(rc.time_s + 2 * (1e-4 + activation * 1e-9), rel=1e-12)
    hidden = AnalyticCostModel(_host_profile(overlap=1.0), MHA, 4).layer_cost(
        LayerOption.parse(option + "+rc+off"), layout, 1
    )
    assert hidden.time_s == pytest.approx(rc.time_s, rel=1e-12)  # both copies shorter than the compute


def test_a_profile_without_a_host_link_cannot_price_offload():
    model = AnalyticCostModel(synthetic_profile(), MHA, 4)
    with pytest.raises(ValueError, match=r"the cost profile has no host_link .*run `paradyse calibrate` again"):
        model.layer_cost(LayerOption.parse("ring/zero3+rc+off"), SequenceLayout.build(512, 4, causal=True), 1)


def test_a_planner_that_may_offload_needs_a_profile_with_a_host_link(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(synthetic_profile()))
    assert "host_link" not in load_profile(path)
    with pytest.raises(ProfileError, match=r"has no host_link .*planner.host_memory_gib > 0\); recalibrate"):
        load_profile(path, host_link=True)


def test_a_bad_host_link_is_named(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**synthetic_profile(), "host_link": {"latency_s": 1e-4, "per_byte_s": 1e-9}}))
    with pytest.raises(ProfileError, match=r"host_link must be a mapping of latency_s, per_byte_s and overlap"):
        load_profile(path)
    path.write_text(json.dumps(_host_profile(overlap=1.5)))
    with pytest.raises(ProfileError, match=r"host_link.overlap must be in \[0, 1\], got 1.5"):
        load_profile(path)


def test_a_stage_counts_its_input_where_every_layer_is_offloaded_and_a_prefetch_beside_all_but_the_last():
    rc, off = LayerCost(1.0, 10.0, 5.0), LayerCost(1.1, 0.0, 25.0, 10.0)
    assert stage_layer_bytes([(3, rc), (1, off)], 4) == (30.0, 15.0)  # nothing to prefetch
    assert stage_layer_bytes([(2, rc), (2, off)], 4) == (20.0, 25.0)
    assert stage_layer_bytes([(0, rc), (4, off)], 4) == (10.0, 15.0)  # the input beside the loss


# -- the planner -----------------------------------------------------------------------------------------
def _problem(host_budget: float = float("inf"), budget: float = 100.0) -> StageProblem:
    options = (LayerOption("a", "m", True), LayerOption("a", "m", True, True))
    costs = (LayerCost(1.0, 10.0, 5.0), LayerCost(1.1, 0.0, 25.0, 10.0))
    return StageProblem(
        options, costs, 8, budget, lambda saved, transient: saved + transient, host_budget_bytes=host_budget
    )


def test_offloaded_layers_run_last_and_the_host_budget_caps_them():
    from megatron_paradyse.planner.exact import solve_exact

    problem = _problem(budget=80.0)
    solution = solve_exact(problem)
    # 8 x rc: 80 + 5; with offload on k layers: 80 - 10k + 25 <= 80 from k = 3
    assert solution.counts == (5, 3)
    assert [str(o) for o in problem.to_plan(solution)] == ["a/m+rc"] * 5 + ["a/m+rc+off"] * 3
    assert solve_exact(_problem(budget=60.0)).counts == (3, 5)  # 55; 4 x 10 bytes fewer: 65
    assert solve_exact(_problem(budget=60.0, host_budget=40.0)) is None  # 5 x 10 bytes do not fit the host
    capped = _problem(budget=70.0, host_budget=40.0)
    assert solve_exact(capped).counts == (4, 4) and capped.leanest().counts == (4, 4)
    # every layer offloaded: the stage's input stays on the device, no leaner than all but one
    everything = _problem(budget=35.0)
    assert everything.evaluate((0, 8)).saved_bytes == everything.evaluate((1, 7)).saved_bytes == 10.0
    assert solve_exact(everything).counts == (1, 7)


def test_the_planner_offloads_only_where_memory_needs_it():
    offloading, device_only = llama3_8b_head_planner(host_memory_gib=200), llama3_8b_head_planner()
    short = SequenceLayout.build(32768, 8, causal=True)
    assert offloading.decide(short).plan == device_only.decide(short).plan
    longest = device_only.max_feasible_length(8, causal=True)
    assert offloading.max_feasible_length(8, causal=True) > 2 * longest
    plan = offloading.decide(SequenceLayout.build(2 * longest, 8, causal=True)).plan
    assert any(option.offload for option in plan) and plan.predicted_peak_bytes <= offloading.budget_bytes
    flags = [option.offload for option in plan]
    assert flags == sorted(flags)  # offloaded layers last
    # host memory bounds it: 3 GiB per rank holds too few inputs to go as far
    bounded = llama3_8b_head_planner(host_memory_gib=3).max_feasible_length(8, causal=True)
    assert bounded < offloading.max_feasible_length(8, causal=True)


def test_micro_batches_offload_to_their_own_store():
    from megatron_paradyse.core.micro_batch import MicroBatch

    layout = SequenceLayout.build(64, 1, causal=True)
    plan = Plan.from_options(["tp_sp/tp_sp+rc+off"])
    first, second = MicroBatch(layout=layout, plan=plan), MicroBatch(layout=layout, plan=plan)
    assert first.offload is not second.offload and first == second
