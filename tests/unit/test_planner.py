"""The per-micro-batch planner: plan space, buckets and cache, hysteresis, infeasible lengths,
monotone behaviour on physical costs, the benchmark's output."""

from __future__ import annotations

import dataclasses
import logging
import random
import re

import pytest

from megatron_paradyse.bench import planner as planner_bench
from megatron_paradyse.config import load_config
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption, Plan
from megatron_paradyse.cost.base import LayerCost
from megatron_paradyse.cost.hardware import HARDWARE
from megatron_paradyse.planner import (
    InfeasibleSequenceError,
    LearningConfig,
    PlanCacheConfig,
    Planner,
    PlannerConfig,
    SearchSpace,
    layer_options,
    solve_exact,
)
from megatron_paradyse.planner.buckets import LengthBuckets
from megatron_paradyse.planner.decision import InfeasibleReport, byte_sizes
from megatron_paradyse.strategies import ModelShape, registry, strategy_names

from helpers.paths import CONFIGS
from helpers.planner_cost_models import (
    FunctionCostModel,
    llama3_8b_head_planner,
    physical_planner,
    random_scaling_model,
    synthetic_options,
)

SHAPE = ModelShape(hidden_size=64, num_attention_heads=8, num_query_groups=8, kv_channels=8, ffn_hidden_size=256)
FAST, LEAN = LayerOption("tp_sp", "tp_sp"), LayerOption("ring", "zero3")
GIB = 2**30


def layout(tokens: int | tuple[int, ...], p: int = 2) -> SequenceLayout:
    return SequenceLayout.build(tokens, p, causal=True)


def two_option_planner(
    costs, *, budget=100.0, num_layers=4, chunk_layers=(), forwards_in_flight=1, longest_tokens=None, **config
) -> tuple[Planner, FunctionCostModel]:
    model = FunctionCostModel(costs, lambda saved, transient: saved + transient)
    planner = Planner(
        PlannerConfig(**config),
        model,
        options=(FAST, LEAN),
        num_layers=num_layers,
        budget_bytes=budget,
        chunk_layers=chunk_layers,
        forwards_in_flight=forwards_in_flight,
        longest_tokens=longest_tokens,
    )
    return planner, model


# -- plan space ----------------------------------------------------------------------------------------
def test_default_plan_space_is_every_registered_pairing_with_and_without_recompute():
    options, excluded = layer_options(PlannerConfig(), SHAPE, p=4)
    expected = [
        LayerOption(a, m, rc, keep_core=keep)
        for a in strategy_names("attention")
        for m in strategy_names("mlp")
        for rc, keep in ((False, False), (True, False), (True, True))
    ]
    assert list(options) == expected and excluded == {}


def test_paired_and_restricted_plan_spaces():
    paired, _ = layer_options(PlannerConfig(pairs=("tp_sp/tp_sp", "ulysses/zero3"), recompute=False), SHAPE, 4)
    assert paired == (LayerOption("tp_sp", "tp_sp"), LayerOption("ulysses", "zero3"))
    subset, _ = layer_options(PlannerConfig(attention=["ring"], mlp=("zero3",)), SHAPE, 4)
    assert [str(option) for option in subset] == ["ring/zero3", "ring/zero3+rc", "ring/zero3+rc+keepcore"]


def test_forward_only_plans_recompute_and_offload_nothing_where_training_offloads():
    """Validation runs without a backward: its plan space drops recompute and, with it, offload, which a
    config that offloads in training (``host_memory_gib``) would otherwise refuse as offload without
    recompute."""
    training = load_config(CONFIGS / "llama3-8b.yaml").planner
    assert training.space.host_memory_gib > 0 and training.space.mlp_tile_tokens > 0
    options, _ = layer_options(training.forward_only(), SHAPE, 4)
    assert not any(option.recompute or option.offload for option in options)
    assert {option.mlp_tile_tokens for option in options} == {0, training.space.mlp_tile_tokens}


def test_unknown_strategy_is_an_error_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown attention strategy 'nope'; known: tp_sp, ulysses, ring"):
        layer_options(PlannerConfig(attention=("nope",)), SHAPE, 4)
    with pytest.raises(ValueError, match=r"unknown mlp strategy 'zero4'"):
        layer_options(PlannerConfig(pairs=("tp_sp/zero4",)), SHAPE, 4)


def test_excluded_strategies_are_reported_once_with_their_reason(monkeypatch, caplog):
    ring = registry.get_strategy("attention", "ring")
    library = dict(registry._LIBRARY)
    library[("attention", "ring")] = dataclasses.replace(ring, unsupported=lambda shape, p: "ring needs a test")
    monkeypatch.setattr(registry, "_LIBRARY", library)
    model = FunctionCostModel(lambda option, s: LayerCost(1.0, 1.0, 1.0), lambda saved, transient: saved + transient)
    with caplog.at_level(logging.WARNING, logger="megatron_paradyse.planner"):
        planner = Planner.for_model(
            PlannerConfig(pairs=("tp_sp/tp_sp", "ring/zero3")),
            model,
            shape=SHAPE,
            p=4,
            num_layers=2,
            budget_bytes=8 * GIB,
        )
        for tokens in (64, 128, 64):
            planner.decide(layout(tokens, p=4))
    assert planner.excluded == {
        "attention ring": "ring needs a test",
        "pair ring/zero3": "attention ring cannot run this model",
    }
    assert [r.getMessage() for r in caplog.records] == [
        "planner: attention ring is left out of the plan space: ring needs a test",
        "planner: pair ring/zero3 is left out of the plan space: attention ring cannot run this model",
    ]
    assert {o.attention for o in planner.options} == {"tp_sp"}


def test_no_option_left_is_an_error():
    odd = dataclasses.replace(SHAPE, num_attention_heads=6, num_query_groups=6)
    with pytest.raises(ValueError, match=r"no layer option is left for this model on p=4 ranks \(attention tp_sp: "):
        layer_options(PlannerConfig(), odd, 4)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hysteresis": 1.5}, r"planner.hysteresis must be in \[0, 1\), got 1.5"),
        ({"method": "greedy"}, r"planner.method must be one of exact, heuristic; got 'greedy'"),
        ({"pairs": ("tp_sp/tp_sp",), "mlp": ("zero3",)}, r"leave planner.attention and planner.mlp unset"),
        ({"pairs": ("ring/zero3+rc",)}, r"recompute, offload and MLP tiles are planner.recompute, planner.host"),
        ({"mlp_tile_tokens": -8}, r"planner.mlp_tile_tokens must be a non-negative int \(0: never tile\), got -8"),
        ({"pairs": ("ring",)}, r"a layer option reads 'attention/mlp'"),
        ({"attention": "ring"}, r"planner.attention must be a non-empty list of names, got 'ring'"),
        ({"bucket_tokens": 0}, r"planner.bucket_tokens must be a positive int, got 0"),
        ({"bucket_ratio": 1.0}, r"planner.bucket_ratio must be a finite number > 1, got 1.0"),
        ({"on_infeasible": "split"}, r"planner.on_infeasible must be one of skip, stop; got 'split'"),
        ({"loss_chunk_tokens": -1}, r"planner.loss_chunk_tokens must be a non-negative int \(0: never chunk\), got -1"),
    ],
)
def test_config_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        PlannerConfig(**fields)


def test_config_keys_are_flat_and_kept_in_their_groups():
    """The ``planner`` section's keys, given flat, land in their groups; keys beside a group given whole
    change it; ``dataclasses.replace`` takes flat keys; an unknown key is refused."""
    config = PlannerConfig(pairs=("tp_sp/tp_sp",), hysteresis=0.1, learn_time=True, on_infeasible="skip")
    assert config.space == SearchSpace(pairs=("tp_sp/tp_sp",))
    assert config.cache == PlanCacheConfig(hysteresis=0.1)
    assert (config.learning, config.on_infeasible) == (LearningConfig(learn_time=True), "skip")
    beside = PlannerConfig(cache=PlanCacheConfig(bucket_tokens=64), hysteresis=0.2)
    assert beside.cache == PlanCacheConfig(bucket_tokens=64, hysteresis=0.2)
    assert dataclasses.replace(config, bucket="geometric").cache == PlanCacheConfig(hysteresis=0.1, bucket="geometric")
    with pytest.raises(TypeError, match="unknown planner keys: hysterisis"):
        PlannerConfig(hysterisis=0.1)


# -- buckets and cache ---------------------------------------------------------------------------------
def test_bucket_edges():
    linear = LengthBuckets("linear", 512, 1.05)
    assert [linear.edge(n, 6) for n in (1, 512, 513, 1024)] == [516, 516, 1026, 1026]
    geometric = LengthBuckets("geometric", 512, 1.5)
    assert [geometric.edge(n) for n in (1, 512, 513, 768, 769, 1153)] == [512, 512, 768, 768, 1152, 1728]
    assert [geometric.edge_at(i) for i in range(4)] == [512, 768, 1152, 1728]
    assert [linear.edge_at(i, 4) for i in range(3)] == [512, 1024, 1536]


def test_bucket_edges_end_at_the_longest_micro_batch():
    """No edge lies past the cap (the longest micro-batch planned), whatever the ratio: with ratio 1e300 the edge
    after 512 was 5e302 tokens. Past the cap every length is a bucket of its own, and the edges the longest-fitting
    search walks are those lengths."""
    geometric = LengthBuckets("geometric", 512, 3.0, cap=1000)
    assert [geometric.edge(n, 4) for n in (1, 512, 513, 1000, 1001, 1003)] == [512, 512, 1000, 1000, 1004, 1004]
    assert [geometric.edge_at(i, 4) for i in range(4)] == [512, 1000, 1004, 1008]
    huge = LengthBuckets("geometric", 512, 1e300, cap=1024)
    assert [huge.edge(n) for n in (513, 1024, 1025)] == [1024, 1024, 1025]
    assert [huge.edge_at(i) for i in range(3)] == [512, 1024, 1025]
    linear = LengthBuckets("linear", 512, 1.05, cap=1300)
    assert [linear.edge(n, 6) for n in (512, 513, 1025, 1300, 1301)] == [516, 1026, 1302, 1302, 1302]
    assert [linear.edge_at(i, 6) for i in range(5)] == [516, 1026, 1302, 1308, 1314]


def test_costs_at_the_bucket_edge_and_cached_per_bucket():
    planner, model = two_option_planner(lambda o, s: LayerCost(1.0 if o == FAST else 2.0, 1.0, 0.0), bucket_tokens=256)
    first = planner.decide(layout(100))
    assert (first.cached, first.bucket_length, model.calls) == (False, 256, 2)
    assert {lay.padded_len for lay in model.layouts} == {256} and model.layouts[0].doc_lengths == (256,)
    second = planner.decide(layout(255))
    assert second.cached and second.plan is first.plan and model.calls == 2
    assert not planner.decide(layout(257)).cached and model.calls == 4
    assert not planner.decide(layout(100), micro_batch_size=2).cached  # the micro-batch size is in the key


def test_cache_drops_the_least_recently_used_bucket():
    planner, model = two_option_planner(lambda o, s: LayerCost(1.0, 1.0, 0.0), bucket_tokens=8, cache_size=2)
    for tokens in (8, 16, 8, 24):  # 16 is the least recently used when 24 arrives
        planner.decide(layout(tokens))
    assert planner.decide(layout(8)).cached and not planner.decide(layout(16)).cached


def test_packed_micro_batches():
    costs = lambda o, s: LayerCost(1.0, 1.0, 0.0)  # noqa: E731
    planner, model = two_option_planner(costs, bucket_tokens=512)
    planner.decide(layout(300))
    packed = planner.decide(layout((100, 200)))
    assert packed.cached  # planned as one document of the bucket's length
    planner, model = two_option_planner(costs, bucket_tokens=512, packed_as="documents")
    planner.decide(layout(300))
    assert not planner.decide(layout((100, 200))).cached
    assert model.layouts[-1].doc_lengths == (100, 200) and model.layouts[-1].padded_len == 512


# -- plan content --------------------------------------------------------------------------------------
def test_plan_puts_large_transients_first_and_reports_its_prediction():
    costs = {FAST: LayerCost(1.0, 4.0, 3.0), LEAN: LayerCost(2.0, 1.0, 1.0)}
    planner, _ = two_option_planner(lambda o, s: costs[o], budget=3.0 + 2 * 4.0 + 2 * 1.0, num_layers=4)
    decision = planner.decide(layout(64))
    assert decision.plan.layers == (FAST, FAST, LEAN, LEAN)  # 3 FAST: 3 * 4 + 1 + max(3 - 1, 1) = 15 > 13
    # all saved (2 * 4 + 2 * 1) and the largest a working set adds to the saved bytes before it: the second
    # FAST layer's 3 beside all but the LEAN layers' 2, or the last layer's 1
    assert (decision.plan.predicted_time_s, decision.plan.predicted_peak_bytes) == (6.0, 11.0)
    assert decision.log_fields() == {
        "plan": "2x tp_sp/tp_sp, 2x ring/zero3",
        "predicted_time_s": 6.0,
        "predicted_peak_gib": 11.0 / GIB,
        "bucket_length": 512,
        "cached": False,
        "kept_previous": False,
        "explored": False,
    }


@pytest.mark.parametrize("method", ["exact", "heuristic"])
def test_a_stage_of_model_chunks_runs_one_chunks_plan_in_each(method):
    """Interleaved, each model chunk of a micro-batch is planned to the budget alone and runs the same
    plan (a shorter chunk its first layers); the time counts the stage's layers."""
    costs = {FAST: LayerCost(1.0, 4.0, 3.0), LEAN: LayerCost(2.0, 1.0, 1.0)}

    def plan(num_layers, budget, chunk_layers=()):
        planner, _ = two_option_planner(
            lambda o, s: costs[o], budget=budget, num_layers=num_layers, chunk_layers=chunk_layers, method=method
        )
        plan = planner.decide(layout(64)).plan
        return plan.layers, plan.predicted_time_s, plan.predicted_peak_bytes

    assert plan(6, 8.0, (2, 2, 2)) == ((FAST, LEAN) * 3, 9.0, 7.0)  # 5 saved, FAST's 3 beside 4 of them
    assert plan(6, 8.0) == ((LEAN,) * 6, 12.0, 7.0)  # the whole stage's layers against the same budget
    assert plan(8, 9.0, (3, 2, 3)) == ((FAST, LEAN, LEAN, FAST, LEAN, FAST, LEAN, LEAN), 13.0, 7.0)
    assert plan(4, 8.0, (4,)) == plan(4, 8.0)
    with pytest.raises(ValueError, match=r"chunk_layers \(2, 3\) must be positive and add up to num_layers=6"):
        plan(6, 8.0, (2, 3))


def _in_flight_planner(budget, forwards, longest, method="exact"):
    """Two layers of two options whose costs grow with the length (those of 1024 tokens: FAST t=1 saved 4
    transient 3, LEAN t=2 saved 1 transient 1), peak saved + transient, holding its saved bytes."""
    base = {FAST: LayerCost(1.0, 4.0, 3.0), LEAN: LayerCost(2.0, 1.0, 1.0)}
    planner, _ = two_option_planner(
        lambda o, s: LayerCost(base[o].time_s, base[o].saved_bytes * s / 1024, base[o].transient_bytes * s / 1024),
        budget=budget,
        num_layers=2,
        forwards_in_flight=forwards,
        longest_tokens=longest,
        method=method,
        bucket_tokens=256,
    )
    return planner


@pytest.mark.parametrize("method", ["exact", "heuristic"])
def test_forwards_in_flight_hold_what_the_longest_holds_and_peak_in_what_the_others_leave(method):
    """Three forwards in flight on a budget of 20: at the longest (1024 tokens) the fastest plan that fits
    three alike (two held, one running: 3 saved + what FAST's working set adds beside LEAN's) is
    FAST+LEAN (3 x 5 + 2 = 17; FAST+FAST 27), so each forward holds at most 5 and peaks at most at
    20 - 2 x 5 = 10."""
    planner = _in_flight_planner(20.0, 3, 1024, method)

    def decide(tokens):
        plan = planner.decide(layout(tokens)).plan
        return plan.layers, plan.predicted_peak_bytes

    assert decide(1024) == ((FAST, LEAN), 7.0)  # a share of a third (6.67) would run LEAN+LEAN
    assert decide(512) == ((FAST, FAST), 5.5)  # holds 4
    assert decide(768) == ((FAST, LEAN), 5.25)  # FAST+FAST would peak at 8.25 but hold 6
    # one forward alone is planned to the whole budget
    assert _in_flight_planner(20.0, 1, None, method).decide(layout(1024)).plan.layers == (FAST, FAST)


def test_forwards_in_flight_of_a_step_hold_what_its_longest_holds():
    """Two forwards in flight on a budget of 15. Any step's longest (1024 tokens) fits two alike as
    FAST+LEAN at most (2 x 5 + 2 = 12; FAST+FAST 19), so a forward of 768 tokens may hold 5 and runs
    FAST+LEAN (FAST+FAST holds 6). In a step whose longest is 768, two FAST+FAST fit alike (6 + 6 + 2.25 =
    14.25): it runs FAST+FAST, and the stage still peaks within the budget."""
    planner = _in_flight_planner(15.0, 2, 1024)
    assert planner.decide(layout(768)).plan.layers == (FAST, LEAN)
    planner.set_step_longest(768)
    plan = planner.decide(layout(768)).plan
    assert (plan.layers, plan.predicted_peak_bytes) == ((FAST, FAST), 8.25)
    assert plan.predicted_peak_bytes + 6.0 <= planner.budget_bytes  # beside the other forward's 6 held
    planner.set_step_longest(None)
    decision = planner.decide(layout(768))
    assert (decision.plan.layers, decision.cached) == ((FAST, LEAN), True)  # each step length's plans are kept
    with pytest.raises(
        ValueError, match=r"^the step's longest micro-batch must be a positive number of tokens, got 0$"
    ):
        planner.set_step_longest(0)


def test_a_reserve_follows_the_steps_longest():
    """One forward at a time on a budget of 8, beside a reserve of 4 bytes per 1,024 tokens of the step's
    longest micro-batch (what a receiving pipeline stage keeps of the previous one). Planned for any step
    (1,024 tokens: 4 left), a micro-batch of 512 runs FAST+LEAN (FAST+FAST peaks at 5.5); in a step whose
    longest it is (6 left), FAST+FAST."""
    base = {FAST: LayerCost(1.0, 4.0, 3.0), LEAN: LayerCost(2.0, 1.0, 1.0)}
    model = FunctionCostModel(
        lambda o, s: LayerCost(base[o].time_s, base[o].saved_bytes * s / 1024, base[o].transient_bytes * s / 1024),
        lambda saved, transient: saved + transient,
    )

    def planner(**reserve) -> Planner:
        config = PlannerConfig(bucket_tokens=256)
        return Planner(config, model, options=(FAST, LEAN), num_layers=2, budget_bytes=8.0, **reserve)

    reserving = planner(longest_tokens=1024, reserved_bytes_per_token=4 / 1024)
    assert (reserving.step_budget_bytes(2), reserving.decide(layout(512)).plan.layers) == (4.0, (FAST, LEAN))
    reserving.set_step_longest(512)
    plan = reserving.decide(layout(512)).plan
    assert (reserving.step_budget_bytes(2), plan.layers, plan.predicted_peak_bytes) == (6.0, (FAST, FAST), 5.5)
    with pytest.raises(ValueError, match=r"^a reserve per token needs the longest micro-batch's tokens"):
        planner(reserved_bytes_per_token=1.0)


def test_forwards_in_flight_longer_than_fits_set_the_caps_at_the_longest_that_does():
    """At 4096 tokens not even LEAN+LEAN fits three alike (7 x 4 = 28 > 20): the caps come from the longest
    bucket that does, 2816 (LEAN+LEAN holds 5.5 there, the others leave 9), which trains; the longest is
    refused with what it would peak at."""
    planner = _in_flight_planner(20.0, 3, 4096)
    assert planner.decide(layout(2816)).plan.layers == (LEAN, LEAN)
    assert planner.max_feasible_length(2, causal=True) == 2816
    with pytest.raises(InfeasibleSequenceError) as refused:
        planner.decide(layout(4096))
    report = refused.value.report
    assert (report.budget_bytes, report.leanest_peak_bytes, report.forwards_in_flight, report.held_cap_bytes) == (
        9.0,
        12.0,
        3,
        5.5,
    )
    assert (
        "the leanest (2x ring/zero3) is predicted to hold 8.00 bytes until its backward and to peak at 12.00 bytes, "
        "where each of the stage's 3 forwards in flight may hold 5.50 bytes and peak at 9.00 bytes beside the others "
        "(its budget of 20.00 bytes shared as the longest micro-batch needs); the longest that fits is 2816 tokens"
    ) in str(report)


def test_forwards_in_flight_that_fit_at_no_length_are_refused_as_such():
    """On a budget of 1, not even three of the shortest bucket fit alike (LEAN+LEAN: 7 x 0.25): every
    micro-batch is refused, saying that no length fits, not with a negative share."""
    with pytest.raises(InfeasibleSequenceError) as refused:
        _in_flight_planner(1.0, 3, 4096).decide(layout(256))
    assert str(refused.value.report) == (
        "a sequence of 256 tokens (padded to 256, planned at 256) with micro-batch size 1 fits no plan: the leanest "
        "(2x ring/zero3) is predicted to hold 0.50 bytes until its backward and to peak at 0.75 bytes, and the stage's "
        "budget of 1.00 bytes holds none of its 3 forwards in flight at any length; no length fits with this "
        "micro-batch size"
    )


def test_forwards_in_flight_need_the_longest_micro_batch():
    with pytest.raises(ValueError, match=r"with 3 forwards in flight the planner needs the longest micro-batch's"):
        _in_flight_planner(20.0, 3, None)
    with pytest.raises(ValueError, match=r"^forwards_in_flight must be a positive int, got 0$"):
        _in_flight_planner(20.0, 0, 1024)


def test_heuristic_method_runs_algorithm_1():
    # Algorithm 1 mixes two options only; the optimum here needs three
    costs = {
        FAST: LayerCost(1.0, 3.0, 0.0),
        LEAN: LayerCost(3.0, 0.0, 0.0),
        LayerOption("ulysses", "zero3"): LayerCost(2.0, 2.0, 0.0),
    }
    model = FunctionCostModel(lambda o, s: costs[o], lambda saved, transient: saved)
    plans = {
        method: Planner(PlannerConfig(method=method), model, options=tuple(costs), num_layers=3, budget_bytes=5.0)
        .decide(layout(8))
        .plan
        for method in ("exact", "heuristic")
    }
    assert plans["exact"].predicted_time_s == 6.0 and plans["heuristic"].predicted_time_s == 7.0


# -- hysteresis ----------------------------------------------------------------------------------------
def test_hysteresis_keeps_the_previous_plan_within_gamma_while_it_fits():
    def costs(option: LayerOption, s: int) -> LayerCost:
        if option == FAST:  # slows down by 3% per 512 tokens, and grows
            return LayerCost(1.0 + 0.03 * (s // 512 - 1), s / 512, 0.0)
        return LayerCost(1.005, 0.5, 0.0)

    planner, _ = two_option_planner(costs, budget=4 * 3.5, bucket_tokens=512)
    steps = [(512, FAST, False), (1024, FAST, True), (1536, LEAN, False), (512, LEAN, True), (1024, LEAN, False)]
    for tokens, option, kept in steps:
        decision = planner.decide(layout(tokens))
        assert (decision.plan.layers, decision.kept_previous) == ((option,) * 4, kept), tokens
    planner.forget_previous()  # a new run of decisions: the bucket's optimum again, from the cache
    decision = planner.decide(layout(512))
    assert (decision.plan.layers, decision.kept_previous, decision.cached) == ((FAST,) * 4, False, True)
    # with a wide margin the previous plan is still dropped once it no longer fits (4 x 2048/512 > 14)
    planner, _ = two_option_planner(costs, budget=4 * 3.5, bucket_tokens=512, hysteresis=0.9)
    assert planner.decide(layout(512)).plan.layers == (FAST,) * 4
    assert planner.decide(layout(1536)).kept_previous
    decision = planner.decide(layout(2048))
    assert not decision.kept_previous and decision.plan.layers == (LEAN,) * 4
    assert decision.plan.predicted_peak_bytes <= planner.budget_bytes


# -- infeasible lengths --------------------------------------------------------------------------------
def _growing(option: LayerOption, s: int) -> LayerCost:
    return LayerCost(1.0, s / 512 * 2.0, 0.0) if option == FAST else LayerCost(2.0, s / 512, 0.0)


def test_infeasible_length_stops_with_a_clear_report():
    planner, _ = two_option_planner(_growing, budget=4 * 3.0 * GIB / GIB, bucket_tokens=512)
    assert planner.max_feasible_length(2, causal=True) == 1536  # 4 layers x 3 <= 12 < 4 x 4
    assert planner.decide(layout(1536)) is not None
    with pytest.raises(InfeasibleSequenceError) as error:
        planner.decide(layout(1600))
    report = error.value.report
    assert (report.length, report.padded_length, report.bucket_length, report.longest_feasible_length) == (
        1600,
        1600,
        2048,
        1536,
    )
    assert (report.leanest_peak_bytes, report.leanest_plan.compact()) == (16.0, "4x ring/zero3")
    # ring/zero3 is memory-lean already: recompute is all that is left to suggest
    assert str(error.value) == (
        "a sequence of 1600 tokens (padded to 1600, planned at 2048) with micro-batch size 1 fits no plan: the "
        "leanest (4x ring/zero3) is predicted to peak at 16.00 bytes, over the budget of 12.00 bytes; the longest "
        "that fits is 1536 tokens with this micro-batch size. Shorten or split such sequences, enable recompute, or "
        "set planner.on_infeasible=skip to skip them"
    )


def test_a_report_tells_its_sizes_apart_and_suggests_only_what_the_leanest_plan_lacks():
    """Sizes in the largest unit that tells apart the ones compared (a 10 MiB budget once read "0.01 GiB, over
    the budget of 0.01 GiB"); a memory-lean strategy or recompute suggested only where some layer of the
    leanest plan lacks it."""
    assert byte_sizes(80.5 * GIB, 74.35 * GIB) == ("80.50 GiB", "74.35 GiB")
    assert byte_sizes(10.55 * 2**20, 10.04 * 2**20) == ("10.55 MiB", "10.04 MiB")
    assert byte_sizes(0.2 * GIB, 3 * GIB) == ("204.80 MiB", "3072.00 MiB")
    assert byte_sizes(1e6, 1e6 + 3) == ("976.56 KiB", "976.57 KiB")
    assert byte_sizes(2**20, 2**20 + 2, 0) == ("1048576.00 bytes", "1048578.00 bytes", "0.00 bytes")

    def refusal(*options: str) -> str:
        leanest = Plan.from_options(options)
        report = InfeasibleReport(
            length=1000,
            padded_length=1008,
            bucket_length=1024,
            micro_batch_size=1,
            budget_bytes=10.04 * 2**20,
            leanest_peak_bytes=10.55 * 2**20,
            leanest_plan=leanest,
            longest_feasible_length=512,
        )
        return str(InfeasibleSequenceError(report))

    assert refusal("tp_sp/tp_sp", "ring/zero3+rc") == (
        "a sequence of 1000 tokens (padded to 1008, planned at 1024) with micro-batch size 1 fits no plan: the "
        "leanest (1x tp_sp/tp_sp, 1x ring/zero3+rc) is predicted to peak at 10.55 MiB, over the budget of 10.04 MiB; "
        "the longest that fits is 512 tokens with this micro-batch size. Shorten or split such sequences, enable a "
        "memory-lean strategy or recompute, or set planner.on_infeasible=skip to skip them"
    )
    assert refusal("tp_sp/tp_sp+rc").endswith(
        "sequences, enable a memory-lean strategy, or set planner.on_infeasible=skip to skip them"
    )
    assert refusal("ulysses/lean+rc", "ring/zero3+rc+off").endswith(
        "Shorten or split such sequences, or set planner.on_infeasible=skip to skip them"
    )


def test_infeasible_length_is_skipped_and_logged(caplog):
    planner, _ = two_option_planner(_growing, budget=12.0, bucket_tokens=512, on_infeasible="skip")
    with caplog.at_level(logging.WARNING, logger="megatron_paradyse.planner"):
        assert planner.decide(layout(4000)) is None
    assert "planner: skipping a micro-batch: a sequence of 4000 tokens" in caplog.text
    assert "the longest that fits is 1536 tokens" in caplog.text
    assert planner.decide(layout(500)).plan.layers == (FAST,) * 4  # a later short one runs normally


def test_shrinking_the_budget_replans():
    planner, _ = two_option_planner(_growing, budget=12.0, bucket_tokens=512)
    assert planner.decide(layout(512)).plan.layers == (FAST,) * 4
    planner.set_budget(6.0)
    decision = planner.decide(layout(512))
    assert not decision.cached and decision.plan.layers == (FAST, FAST, LEAN, LEAN)  # 2x2 + 2x1 <= 6
    assert planner.max_feasible_length(2, causal=True) == 512
    with pytest.raises(ValueError, match="budget_bytes must be a positive finite number, got 0"):
        planner.set_budget(0)


# -- monotone behaviour --------------------------------------------------------------------------------
def test_longer_sequences_never_plan_faster_and_move_from_tp_sp_to_lean_options():
    """Physical costs (the benchmark's: analytic, H100 figures), 24 options, a fixed 72 GiB budget, lengths growing.

    "Toward lean", precisely: the number of ``tp_sp/tp_sp`` layers never grows (all at first, none at
    the end), and while memory binds (the fastest option alone does not fit), each plan's predicted
    peak at the longest feasible length is no larger than the previous plan's: every change trades
    speed for memory. (Where memory does not bind the planner just follows the fastest option.)
    """
    p, num_layers = 8, 24
    planner = physical_planner(num_layers, 0.9 * HARDWARE["h100"].memory_bytes, p)
    options = planner.options

    def fits(tokens: int) -> bool:  # Megatron's whole-sequence buffer kept: the problems solved below
        problem = planner.stage_problem(SequenceLayout.build(tokens, p, causal=True))
        return problem.fits(problem.leanest())

    lengths = [n for n in (512 * round(1.25**k) for k in range(60)) if fits(n)]
    reference = planner.stage_problem(SequenceLayout.build(lengths[-1], p, causal=True))
    times, tp_sp_layers, previous_peak = [], [], None
    for tokens in lengths:
        problem = planner.stage_problem(SequenceLayout.build(tokens, p, causal=True))
        solution = solve_exact(problem)
        times.append(solution.time_s)
        tp_sp_layers.append(solution.counts[options.index(LayerOption("tp_sp", "tp_sp"))])
        fastest = min(range(len(options)), key=lambda o: problem.costs[o].time_s)
        if problem.fits(problem.evaluate(problem.uniform(fastest))):
            previous_peak = None
            continue
        peak = reference.evaluate(solution.counts).peak_bytes
        assert previous_peak is None or peak <= previous_peak * (1 + 1e-12), tokens
        previous_peak = peak
    assert times == sorted(times)
    assert (
        tp_sp_layers == sorted(tp_sp_layers, reverse=True) and tp_sp_layers[0] == num_layers and tp_sp_layers[-1] == 0
    )
    assert {o.attention for o, n in zip(options, solution.counts) if n} <= {"ulysses", "ring", "lean"}


def test_recomputed_layers_keep_their_attention_core_where_it_pays():
    """Llama-3-8B's last stage on an H100 node (published figures): at a million tokens, where attention is
    most of a layer's work, recomputed layers keep their attention core (its rerun is most of a
    recompute's price); at 8K tokens nothing is recomputed."""
    planner = llama3_8b_head_planner()
    long = planner.decide(layout(2**20, p=8)).plan
    assert any(option.keep_core for option in long), long.compact()
    short = planner.decide(layout(8192, p=8)).plan
    assert not any(option.recompute for option in short), short.compact()


def test_decisions_never_get_faster_as_lengths_grow_on_random_monotone_costs():
    """Costs non-decreasing in length: fewer plans fit and each is slower, so the predicted time of
    successive decisions (hysteresis and buckets included) never decreases."""
    rng = random.Random(5)
    for _ in range(10):
        options = synthetic_options(rng.randint(2, 10))
        model = random_scaling_model(rng, options)
        num_layers = rng.randint(1, 32)
        budget = 1.0 + num_layers * rng.uniform(1e-6, 1e-4) * 4096 + rng.uniform(0.01, 0.5)
        planner = Planner(
            PlannerConfig(on_infeasible="skip", bucket="geometric", bucket_tokens=64),
            model,
            options=options,
            num_layers=num_layers,
            budget_bytes=budget,
        )
        times = []
        for tokens in sorted(rng.randint(1, 8192) for _ in range(30)):
            decision = planner.decide(layout(tokens))
            if decision is None:
                break
            times.append(decision.plan.predicted_time_s)
        assert times == sorted(times)


# -- benchmark -----------------------------------------------------------------------------------------
def test_bench_prints_the_headline_last(capsys):
    assert planner_bench.main(["--layers", "8", "--uncached-calls", "5", "--cached-calls", "20"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "cost model: analytic, h100 node simulated from its figures (megatron_paradyse/cost/hardware.py)"
    assert re.fullmatch(r"planner_us_cached=\d+\.\d\d planner_us_uncached=\d+", lines[-1])


def test_bench_refuses_a_group_the_published_figures_do_not_cover(capsys):
    assert planner_bench.main(["--p", "16"]) == 2
    assert capsys.readouterr().err == (
        "error: the published figures are for groups of 1, 2, 4, 8 GPUs of one node, not p=16: pass --profile "
        "with a profile calibrated for p=16\n"
    )


def test_the_loss_is_chunked_only_where_memory_needs_it():
    planner = llama3_8b_head_planner(8192)
    whole = llama3_8b_head_planner(0)
    short = planner.decide(SequenceLayout.build(4096, 8, causal=True))
    assert (
        short.plan.loss_chunk_tokens == 0
        and short.plan == whole.decide(SequenceLayout.build(4096, 8, causal=True)).plan
    )
    longest_whole = whole.max_feasible_length(8, causal=True)
    longest = planner.max_feasible_length(8, causal=True)
    assert longest > 3 * longest_whole  # the full-vocabulary logits no longer bind
    beyond = SequenceLayout.build(2 * longest_whole, 8, causal=True)
    assert not whole.fits(beyond)
    plan = planner.decide(beyond).plan
    assert plan.loss_chunk_tokens == 8192 and "loss in 8192-token chunks" in plan.compact()
    assert plan.predicted_peak_bytes <= planner.budget_bytes
    # the chunks' recompute is in the plan's time: the same layers with the whole loss are faster
    problem = planner.stage_problem(beyond)
    counts = tuple(plan.layers.count(option) for option in planner.options)
    assert problem.evaluate(counts).time_s < plan.predicted_time_s


def test_a_resumed_planner_keeps_the_chunked_loss_of_its_previous_plan():
    """Hysteresis keeps a previous plan with a chunked loss where a fresh planner would not chunk it; the
    checkpointed state carries the loss option, so a resumed run keeps it too."""
    layout = lambda tokens: SequenceLayout.build(tokens, 8, causal=True)  # noqa: E731
    planner = llama3_8b_head_planner(8192)
    assert planner.decide(layout(94_000)).plan.loss_chunk_tokens == 8192
    state = planner.state_dict()
    assert state["previous_stage"] == {"loss_chunk_tokens": 8192, "sequence_buffer": False}
    kept = planner.decide(layout(88_000))
    assert kept.kept_previous and kept.plan.loss_chunk_tokens == 8192
    assert llama3_8b_head_planner(8192).decide(layout(88_000)).plan.loss_chunk_tokens == 0
    resumed = llama3_8b_head_planner(8192)
    resumed.load_state_dict(state)
    assert resumed.decide(layout(88_000)).plan == kept.plan
