"""The time model that learns from measured micro-batches (megatron_paradyse.cost.correction): the update
rule, its fallbacks, the same factors on every rank (gloo), checkpoints, and planners that follow it."""

from __future__ import annotations

import math
import time

import pytest
import torch

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.core.plan import Plan
from megatron_paradyse.cost.base import StageOptions
from megatron_paradyse.cost.correction import CorrectedCostModel, TimeCorrections
from megatron_paradyse.planner.exploration import Exploration
from megatron_paradyse.run.log import Measurement, MicroBatchMeter

from helpers.planner_cost_models import physical_planner

GIB = 2**30
A, B = "tp_sp/tp_sp", "ring/zero3+rc"


def _learned(measurements, prior=1.0) -> TimeCorrections:
    corrections = TimeCorrections(prior)
    for plan, bucket, times, seconds in measurements:
        corrections.observe(Plan.from_options(plan), bucket, times, seconds)
    corrections.agree()
    return corrections


def test_a_plan_of_one_option_moves_its_factor_by_the_log_ratio_over_weight_plus_prior():
    corrections = _learned([([A] * 4, 1024, {A: 0.25}, 2.0)])  # predicted 1 s, measured 2 s
    assert corrections.factor(A, 1024) == pytest.approx(math.exp(math.log(2.0) / 2))
    for _ in range(40):  # converges to measured over predicted
        corrections.observe(Plan.from_options([A] * 4), 1024, {A: 0.25}, 2.0)
        corrections.agree()
    assert corrections.factor(A, 1024) == pytest.approx(2.0, rel=1e-6)


def test_a_mixed_plan_moves_each_option_by_its_share_of_the_prediction():
    # A: 3 layers x 0.1 s, B: 1 layer x 0.1 s -> shares 0.75 and 0.25 of 0.4 s; measured 0.8 s
    corrections = _learned([([A, A, A, B], 2048, {A: 0.1, B: 0.1}, 0.8)], prior=0.5)
    assert corrections.factor(A, 2048) == pytest.approx(math.exp(0.75 * math.log(2) / (0.75 + 0.5)))
    assert corrections.factor(B, 2048) == pytest.approx(math.exp(0.25 * math.log(2) / (0.25 + 0.5)))


def test_the_stage_time_outside_the_layers_is_not_corrected():
    # 4 layers of A predicted at 0.25 s each and 1 s of output layer and loss; measured 3 s: A takes 2x
    corrections = TimeCorrections()
    for _ in range(60):
        corrections.observe(Plan.from_options([A] * 4), 1024, {A: 0.25}, 3.0, fixed_s=1.0)
        corrections.agree()
    assert corrections.factor(A, 1024) == pytest.approx(2.0, rel=1e-6)


def test_unmeasured_buckets_and_options_fall_back_to_the_nearest_measured():
    corrections = TimeCorrections()
    assert corrections.factor(A, 512) == 1.0
    corrections = _learned([([A], 1024, {A: 1.0}, 4.0), ([A], 65536, {A: 1.0}, 0.25), ([B], 1024, {B: 1.0}, 1.0)])
    assert corrections.factor(A, 2048) == corrections.factor(A, 1024) == 2.0
    assert corrections.factor(A, 32768) == corrections.factor(A, 65536) == 0.5
    assert corrections.factor(B, 65536) == corrections.factor(B, 1024) == 1.0
    unseen = "ulysses/tp_sp"  # the mean log factor of the options measured at the nearest bucket
    assert corrections.factor(unseen, 1500) == pytest.approx(math.sqrt(2.0 * 1.0))
    assert corrections.factor(unseen, 40000) == 0.5


def test_factors_stay_within_a_hundredfold_and_bad_measurements_are_refused():
    corrections = TimeCorrections(prior=1e-9)
    corrections.observe(Plan.from_options([A]), 512, {A: 1.0}, 1e9)
    corrections.agree()
    assert corrections.factor(A, 512) == pytest.approx(100.0)
    with pytest.raises(ValueError, match=r"a measured time must be a positive finite number of seconds, got nan"):
        corrections.observe(Plan.from_options([A]), 512, {A: 1.0}, math.nan)
    with pytest.raises(ValueError, match=r"prior must be a positive finite number of micro-batches, got 0"):
        TimeCorrections(0)


def test_corrections_round_trip_through_a_checkpoint_and_bump_the_version():
    corrections = _learned([([A, B], 1024, {A: 0.1, B: 0.3}, 0.7), ([B], 4096, {B: 1.0}, 0.5)])
    restored = TimeCorrections()
    version = restored.version
    restored.load_state_dict(corrections.state_dict())
    assert restored.state_dict()["log_factors"] == corrections.state_dict()["log_factors"]
    assert restored.version > version
    for option, bucket in ((A, 1024), (B, 1024), (B, 4096), (A, 9999)):
        assert restored.factor(option, bucket) == corrections.factor(option, bucket)
    with pytest.raises(ValueError, match=r"time corrections: expected"):
        restored.load_state_dict({"factors": {}})


def _agree_on_rank(rank: int, world_size: int, measurements: list) -> tuple[dict, list[str]]:
    corrections = TimeCorrections()
    for iteration in measurements:  # each iteration: this rank's own measurements, then one agreement
        for plan, bucket, times, seconds in iteration[rank]:
            corrections.observe(Plan.from_options(plan), bucket, times, seconds)
        corrections.agree(most_entries=2 * 2)  # at most two micro-batches of at most two options
    refusals = []  # a rank over a limit of the one gather: the same error on every rank, none left waiting
    for option, most_entries in ((A, 1), ("ring/lean+tile" + "9" * 60, 4)):
        observed = {1: [(option, 1024), (option, 2048)], 2: [(option, 512)]}.get(rank, [])
        for plan, bucket in observed:
            corrections.observe(Plan.from_options([plan]), bucket, {plan: 1.0}, 1.0)
        with pytest.raises(ValueError) as err:
            corrections.agree(most_entries=most_entries)
        refusals.append(str(err.value))
    with pytest.raises(ValueError) as err:
        corrections.agree()
    refusals.append(str(err.value))
    return corrections.state_dict(), refusals


def test_every_rank_agrees_on_the_same_factors_from_different_measurements():
    ranks = 3
    measurements = [
        [  # iteration 1: rank r's micro-batches
            [([A] * 2, 1024, {A: 0.11}, 0.37)],
            [([A, B], 1024, {A: 0.11, B: 0.29}, 0.53), ([B] * 2, 4096, {B: 0.9}, 1.1)],
            [],
        ],
        [  # iteration 2
            [([B] * 2, 4096, {B: 0.9}, 2.3)],
            [],
            [([A] * 2, 2048, {A: 0.2}, 0.31), ([A] * 2, 1024, {A: 0.11}, 0.19)],
        ],
    ]
    states, refusals = zip(*run_on_ranks(_agree_on_rank, ranks, args=(measurements,)))
    assert all(state == states[0] for state in states[1:])  # bit for bit
    expected_refusals = [
        "time corrections: the ranks cannot agree: rank 1 measured 2 (option, bucket) pairs, more than most_entries=1",
        "time corrections: the ranks cannot agree: rank 1 measured an option whose name is over 64 bytes; "
        "rank 2 measured an option whose name is over 64 bytes",
        "TimeCorrections.agree across ranks needs most_entries: the most (option, bucket) pairs a rank measured "
        "since the last agreement, the same on every rank; got None",
    ]
    assert list(refusals) == [expected_refusals] * ranks
    # the same as one process that sees every rank's measurements, rank by rank
    reference = TimeCorrections()
    for iteration in measurements:
        per_rank = []
        for entries in iteration:
            single = TimeCorrections()
            single.load_state_dict(reference.state_dict())
            for plan, bucket, times, seconds in entries:
                single.observe(Plan.from_options(plan), bucket, times, seconds)
            per_rank.append(sorted((k, (s.weighted_log_ratio, s.weight)) for k, s in single._pending.items()))
        reference._update(per_rank)
    assert states[0] == reference.state_dict()
    assert states[0]["log_factors"], "the ranks learned nothing"


def test_a_planner_follows_the_corrections_and_keeps_memory_as_it_was():
    planner = physical_planner(8, 60 * GIB, hysteresis=0.0)
    layout = SequenceLayout.build([16384], 8, causal=True)
    before = planner.decide(layout).plan
    assert len(set(before)) == 1, before.compact()
    problem = planner.stage_problem(layout)  # the runner-up: the fastest other option whose plan fits
    uniform = [problem.evaluate(problem.uniform(i)) for i in range(len(problem.options))]
    runner_up = min(
        (s for s, o in zip(uniform, problem.options) if o != before[0] and problem.fits(s)), key=lambda s: s.time_s
    )
    runner_up = problem.to_plan(runner_up)
    corrections = TimeCorrections()
    planner.cost_model = CorrectedCostModel(planner.cost_model, corrections)
    bucket = planner.bucket_layout(layout)
    for _ in range(10):  # the chosen plan runs 3x slower than predicted, the runner-up as predicted
        for plan, slower in ((before, 3.0), (runner_up, 1.0)):
            times = planner.cost_model.option_times(plan, bucket, 1)
            planner.observe_time(layout, plan, slower * sum(times[str(o)] for o in plan))
        assert corrections.agree()
        planner.clear_cache()
    after = planner.decide(layout).plan
    assert after.layers == runner_up.layers, (before.compact(), runner_up.compact(), after.compact())
    option = before[0]
    base = planner.cost_model.base.layer_cost(option, bucket, 1)
    corrected = planner.cost_model.layer_cost(option, bucket, 1)
    assert corrected.time_s == pytest.approx(3 * base.time_s, rel=2e-3)  # 3 ** (1 - 2 ** -10): halving the gap
    assert (corrected.saved_bytes, corrected.transient_bytes) == (base.saved_bytes, base.transient_bytes)


def test_a_resumed_planner_makes_the_decisions_of_an_uninterrupted_one():
    lengths = [16384, 15000, 14000, 13000, 11000, 10000, 9000, 7000]
    layouts = [SequenceLayout.build([n], 8, causal=True) for n in lengths]
    config = dict(hysteresis=0.5, bucket_tokens=1024)
    uninterrupted = physical_planner(8, 60 * GIB, **config)
    plans = [uninterrupted.decide(layout).plan.layers for layout in layouts]
    assert len(set(plans)) == 1 and any(d.kept_previous for d in [uninterrupted.decide(layouts[-1])])
    first = physical_planner(8, 60 * GIB, **config)
    for layout in layouts[:4]:
        first.decide(layout)
    resumed = physical_planner(8, 60 * GIB, **config)
    resumed.load_state_dict(first.state_dict())
    assert [resumed.decide(layout).plan.layers for layout in layouts[4:]] == plans[4:]
    fresh = physical_planner(8, 60 * GIB, **config)  # without the saved state, it would plan otherwise
    assert fresh.decide(layouts[-1]).plan.layers != plans[-1]
    with pytest.raises(ValueError, match=r"the saved previous plan counts 2 layer options, this planner has 24"):
        resumed.load_state_dict({"previous": [1, 7]})


class _Block(torch.nn.Module):
    """Stands in for Megatron's TransformerBlock: the meter hooks its ``hidden_states`` keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, *, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden_states).relu()


class _Model(torch.nn.Module):
    """Stands in for Megatron's GPTModel: its output is where the backward starts, its ``decoder`` ends it."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = _Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(hidden_states=x * 2)


@pytest.mark.parametrize("memory", [True, False])
def test_the_meter_times_forward_and_backward_and_measures_memory_only_when_asked(memory):
    model = _Model()
    meter = MicroBatchMeter(torch.device("cpu"), static_bytes=1000.0, memory=memory)
    meter.attach(model)
    for rows in (256, 512):
        meter.begin()
        x = torch.randn(rows, 64, requires_grad=True)
        model(x).sum().backward()
    (first, first_peak, first_grew), (second, second_peak, second_grew) = meter.collect()
    assert first > 0 and second > 0
    assert not first_grew and not second_grew  # the CPU has no caching allocator to grow
    if memory:  # the output and its gradient, at least, above the static bytes
        assert first_peak > 1000 + 256 * 64 * 4 and second_peak > 1000 + 512 * 64 * 4
    else:
        assert first_peak is None and second_peak is None
    meter.begin()  # a window whose backward never came (a forward-only step not planned for one)
    model(torch.randn(8, 64, requires_grad=True))
    assert meter.collect() == [Measurement(None, None)]
    meter.begin(forward_only=True)  # evaluation: the forward alone, ended by the model's return
    with torch.no_grad():
        model(torch.randn(8, 64))
    time.sleep(0.2)
    ((seconds, _, _),) = meter.collect()
    assert 0 < seconds < 0.2


def test_the_meter_leaves_out_what_a_pipeline_stage_runs_between_a_micro_batchs_forward_and_backward():
    """1F1B's order on a stage: the forwards of two micro-batches, then their backwards, with waits between
    (the next stage's work). Each micro-batch's time is its own forward and backward, not the waits."""
    model = _Model()
    meter = MicroBatchMeter(torch.device("cpu"), static_bytes=0.0, memory=False)
    meter.attach(model)
    outputs = []
    for rows in (256, 512):
        meter.begin()
        outputs.append(model(torch.randn(rows, 64, requires_grad=True)))
        time.sleep(0.2)
    for output in outputs:
        time.sleep(0.2)
        output.backward(torch.ones_like(output))  # as Megatron's schedule: the gradient from the next stage
    first, second = meter.collect()
    assert 0 < first.time_s < 0.2 and 0 < second.time_s < 0.2, (first, second)


def test_the_meter_adds_up_a_micro_batchs_model_chunks():
    """The interleaved schedule on a stage: each micro-batch runs through both model chunks (the second
    reads what the first sent on, as received from another stage), forwards first, backwards later, waits
    between. A micro-batch's time is its two chunks' forwards and backwards (the second chunk's forward
    takes 30 ms more); the waits are not in it."""

    class _SlowModel(_Model):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.03)
            return super().forward(x)

    wait = 0.3  # between passes: far longer than a micro-batch's passes, even on a loaded machine
    chunks = [_Model(), _SlowModel()]
    meter = MicroBatchMeter(torch.device("cpu"), static_bytes=0.0, memory=False)
    for model in chunks:
        meter.attach(model)
    sent = []  # per micro-batch: each chunk's (input, output)
    for rows in (256, 512):
        x, passes = torch.randn(rows, 64, requires_grad=True), []
        for index, model in enumerate(chunks):
            meter.begin(chunk=index)
            output = model(x)
            passes.append((x, output))
            x = output.detach().requires_grad_()
            time.sleep(wait)
        sent.append(passes)
    for passes in sent:
        grad = None
        for x, output in reversed(passes):
            time.sleep(wait)
            output.backward(torch.ones_like(output) if grad is None else grad)
            grad = x.grad
    measured = meter.collect()
    assert len(measured) == 2 and all(0.03 < m.time_s < wait for m in measured), measured


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("memory", [True, False])
def test_the_meter_tells_a_micro_batch_during_which_the_allocator_reserved_more_device_memory(memory):
    """Mapping new device memory costs time the steady state does not pay: such a micro-batch is marked,
    and the time model does not learn from it. The same micro-batch again reuses the cached blocks."""
    model = _Model().cuda()
    meter = MicroBatchMeter(torch.device("cuda"), static_bytes=0.0, memory=memory)
    meter.attach(model)
    torch.cuda.empty_cache()
    for _ in range(2):
        meter.begin()
        x = torch.randn(1 << 16, 64, device="cuda", requires_grad=True)  # 16 MiB, its output and gradients more
        model(x).sum().backward()
        del x
    first, second = meter.collect()
    assert first.time_s > 0 and second.time_s > 0
    assert first.allocator_grew and not second.allocator_grew


def _exploring_planner(share: float, margin: float):
    planner = physical_planner(8, 60 * GIB, hysteresis=0.0)
    corrections = TimeCorrections()
    planner.cost_model = CorrectedCostModel(planner.cost_model, corrections)
    planner.exploration = Exploration(corrections, share=share, margin=margin)
    return planner, corrections


def test_the_planner_explores_the_fastest_unmeasured_option_on_at_most_its_share_of_decisions():
    layout = SequenceLayout.build([16384], 8, causal=True)
    planner, corrections = _exploring_planner(share=0.25, margin=0.5)
    decisions = [planner.decide(layout) for _ in range(8)]
    assert [d.explored for d in decisions] == [False, False, False, True, False, False, False, True]
    best = decisions[0].plan
    problem = planner.stage_problem(layout)
    close = [  # uniform plans of other options that fit and are predicted within the margin
        problem.evaluate(problem.uniform(i))
        for i, option in enumerate(problem.options)
        if option != best[0] and problem.fits(problem.evaluate(problem.uniform(i)))
    ]
    close = [s for s in close if s.time_s <= 1.5 * best.predicted_time_s]
    fastest = problem.to_plan(min(close, key=lambda s: s.time_s))
    assert decisions[3].plan.layers == decisions[7].plan.layers == fastest.layers
    assert decisions[3].plan.predicted_time_s > best.predicted_time_s
    # once measured there, an option is not explored again at that length: the next close one is
    bucket = planner.bucket_layout(layout)
    times = planner.cost_model.option_times(fastest, bucket, 1)
    corrections.observe(fastest, bucket.padded_len, times, sum(times[str(o)] for o in fastest))
    corrections.agree()
    planner.clear_cache()
    later = [planner.decide(layout) for _ in range(4)]
    explored = [d.plan for d in later if d.explored]
    assert len(explored) == 1 and explored[0][0] != fastest[0] and explored[0][0] != best[0]
    # nothing predicted within the margin: nothing explored
    planner, _ = _exploring_planner(share=0.5, margin=0.0)
    assert not any(planner.decide(layout).explored for _ in range(8))


def test_exploration_counts_are_saved_with_the_planner():
    layout = SequenceLayout.build([16384], 8, causal=True)
    planner, _ = _exploring_planner(share=0.25, margin=0.5)
    uninterrupted = [planner.decide(layout).explored for _ in range(8)]
    first, _ = _exploring_planner(share=0.25, margin=0.5)
    for _ in range(5):
        first.decide(layout)
    resumed, _ = _exploring_planner(share=0.25, margin=0.5)
    resumed.load_state_dict(first.state_dict())
    assert [resumed.decide(layout).explored for _ in range(3)] == uninterrupted[5:] == [False, False, True]


def test_for_model_with_time_corrections_builds_a_learning_planner():
    from megatron_paradyse.bench.planner import bench_shape, build_cost_model
    from megatron_paradyse.planner import Planner, PlannerConfig

    cost, _ = build_cost_model(bench_shape(), 8, 8, gpu="h100")
    kwargs = dict(shape=bench_shape(), p=8, num_layers=8, budget_bytes=60 * GIB)
    layout = SequenceLayout.build([16384], 8, causal=True)
    fixed = Planner.for_model(PlannerConfig(), cost, **kwargs)
    assert fixed.cost_model is cost and fixed.exploration is None
    with pytest.raises(TypeError, match=r"^observe_time: this planner does not learn; build it with Planner"):
        fixed.observe_time(layout, fixed.decide(layout).plan, 1.0)

    corrections = TimeCorrections()
    learning = Planner.for_model(PlannerConfig(explore_share=0.25), cost, **kwargs, time_corrections=corrections)
    assert learning.cost_model.base is cost and learning.cost_model.corrections is corrections
    assert (learning.exploration.share, learning.exploration.margin) == (0.25, PlannerConfig().learning.explore_margin)
    no_exploring = Planner.for_model(PlannerConfig(explore_share=0.0), cost, **kwargs, time_corrections=corrections)
    assert no_exploring.exploration is None

    plan = learning.decide(layout).plan  # measured twice as slow as predicted: its factor at the bucket moves
    assert len(set(plan)) == 1, plan.compact()
    bucket = learning.bucket_layout(layout)
    predicted = sum(cost.layer_cost(option, bucket, 1).time_s for option in plan)
    learning.observe_time(layout, plan, 2 * predicted)
    assert corrections.agree()
    assert corrections.factor(plan[0], bucket.padded_len) == pytest.approx(math.sqrt(2.0))


def test_replanning_after_an_agreement_prices_nothing_again():
    planner = physical_planner(8, 60 * GIB, hysteresis=0.0)
    base = planner.cost_model
    calls = []
    price = base.layer_cost

    def counted(option, layout, micro_batch_size):
        calls.append(option)
        return price(option, layout, micro_batch_size)

    corrections = TimeCorrections()
    planner.cost_model = CorrectedCostModel(base, corrections)
    base.layer_cost = counted
    layout = SequenceLayout.build([16384], 8, causal=True)
    plan = planner.decide(layout).plan
    priced = len(calls)
    assert priced >= len(planner.options)
    planner.observe_time(layout, plan, 3 * plan.predicted_time_s)
    assert corrections.agree()
    planner.clear_cache()
    bucket = planner.bucket_layout(layout)  # a new layout object of the same value
    assert planner.decide(layout).plan and len(calls) == priced  # the base model priced nothing again
    for option in planner.options:
        corrected = planner.cost_model.layer_cost(option, bucket, 1)
        assert corrected.time_s == price(option, bucket, 1).time_s * corrections.factor(option, bucket.padded_len)


def test_a_micro_batch_is_predicted_and_learned_from_at_its_own_length_not_its_buckets_edge():
    """The planner prices a bucket at its upper edge (a bound for memory). A micro-batch's predicted time
    is its own length's, and a time model right at every length learns nothing from micro-batches
    anywhere in a bucket: priced at the edge, the factor would hold how far below it they were (up to
    2x in the (512, 1024] bucket), and options measured at different lengths would compare by length."""
    planner = physical_planner(8, 60 * GIB, hysteresis=0.0)
    base = planner.cost_model
    lengths = (528, 768, 1024)  # one bucket: its edge is 1024
    layouts = [SequenceLayout.build([n], 8, causal=True) for n in lengths]
    assert {planner.bucket_layout(layout).padded_len for layout in layouts} == {1024}
    plan = planner.decide(layouts[0]).plan
    own = [planner.predicted_time_s(plan, layout) for layout in layouts]
    assert own[0] < own[1] < own[2] == pytest.approx(plan.predicted_time_s, rel=1e-12)
    assert own[0] == math.fsum(base.layer_cost(o, layouts[0], 1).time_s for o in plan) + base.stage_time_s(
        layouts[0], 1, StageOptions.of(plan)
    )

    corrections = TimeCorrections()
    planner.cost_model = CorrectedCostModel(base, corrections)
    for layout, seconds in zip(layouts, own):  # each micro-batch measured as the model prices its length
        planner.observe_time(layout, plan, seconds)
    corrections.agree()
    assert {corrections.factor(o, 1024) for o in plan} == {1.0}
    assert [planner.predicted_time_s(plan, layout) for layout in layouts] == own

    planner.observe_time(layouts[0], plan, 2 * own[0])  # twice as slow as priced at its own length
    corrections.agree()
    assert all(corrections.factor(o, 1024) > 1.3 for o in plan)
    for layout in layouts:  # the bucket's factors, at each micro-batch's own length
        layers = math.fsum(base.layer_cost(o, layout, 1).time_s * corrections.factor(o, 1024) for o in plan)
        fixed = base.stage_time_s(layout, 1, StageOptions.of(plan))
        assert planner.predicted_time_s(plan, layout) == pytest.approx(layers + fixed, rel=1e-12)
