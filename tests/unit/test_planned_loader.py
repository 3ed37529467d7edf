"""The training iterator: plans per micro-batch, a micro-batch no plan fits skipped by every pipeline
stage alike or stopped on by every data-parallel rank at the same step, the position resumed; and the
document subset that spreads a quick run over the corpus' lengths."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.base import LayerCost
from megatron_paradyse.data import DocumentDataset, DynamicSequenceLoader, LoaderConfig
from megatron_paradyse.data.indexed import write_documents
from megatron_paradyse.data.subset import DocumentSubset, spread_by_length
from megatron_paradyse.planner import InfeasibleSequenceError, Planner, PlannerConfig
from megatron_paradyse.run.planned_loader import PlannedMicroBatches

from helpers.planner_cost_models import FunctionCostModel

OPTIONS = (LayerOption("tp_sp", "tp_sp"), LayerOption("tp_sp", "tp_sp", recompute=True))
BUDGET = 4000.0


def _planner(static: float, on_infeasible: str, **in_flight) -> Planner:
    """Two layers; per layer: saved 4s (s/1 recomputed), transient s. The leanest stage peak is
    static + 3s, so a stage with static 0 fits s <= 1333, one with static 1000 fits s <= 1000."""

    def costs(option: LayerOption, s: int) -> LayerCost:
        return LayerCost(s * (2.0 if option.recompute else 1.0), s * (1.0 if option.recompute else 4.0), float(s))

    model = FunctionCostModel(costs, lambda saved, transient: static + saved + transient)
    config = PlannerConfig(on_infeasible=on_infeasible, bucket_tokens=4)
    return Planner(config, model, options=OPTIONS, num_layers=2, budget_bytes=BUDGET, **in_flight)


def _loader(tmp_path, lengths, *, dp_rank=0, dp_size=1, micro_batches_per_step=1) -> DynamicSequenceLoader:
    prefix = tmp_path / "docs"
    if not prefix.with_suffix(".idx").exists():
        write_documents(prefix, [np.arange(n) % 256 for n in lengths], vocab_size=258)
    config = LoaderConfig(
        p=2, max_len=max(lengths), sampler="curriculum", pad_id=257, micro_batches_per_step=micro_batches_per_step
    )
    return DynamicSequenceLoader(DocumentDataset(prefix), config, dp_rank=dp_rank, dp_size=dp_size)


def test_every_pipeline_stage_skips_what_one_stage_cannot_fit(tmp_path):
    # 1100 tokens fit the first stage (3 * 1100 <= 4000) but not the second (1000 + 3300 > 4000).
    lengths = [100, 1100, 200, 300, 400]
    stages = [
        PlannedMicroBatches(_loader(tmp_path, lengths), [_planner(0, "skip"), _planner(1000, "skip")], stage=stage)
        for stage in (0, 1)
    ]
    taken = [[next(it) for _ in range(6)] for it in stages]
    for it, planned in zip(stages, taken):
        assert [mb.layout.valid_len for mb in planned] == [100, 200, 300, 400, 100, 200]  # 1100 left out
        assert [(s.layout.valid_len, s.stage) for s in it.skipped] == [(1100, 1)]
        assert "a sequence of 1100 tokens" in str(it.skipped[0].report)
    # Each stage plans with its own planner, untouched by the feasibility checks.
    for stage, planned in enumerate(taken):
        fresh = _planner(1000 * stage, "skip")
        assert [mb.decision.plan for mb in planned] == [fresh.decide(mb.layout).plan for mb in planned]


def test_data_no_plan_fits_is_refused_before_it_would_be_skipped_forever(tmp_path):
    # the second stage's leanest peak is 1000 + 3s: over the budget from s = 1002, the shortest sample's length
    lengths = [1400, 1002, 1200]
    for stage in (0, 1):
        with pytest.raises(InfeasibleSequenceError) as error:
            PlannedMicroBatches(_loader(tmp_path, lengths), [_planner(0, "skip"), _planner(1000, "skip")], stage=stage)
        assert str(error.value).startswith(
            "no plan fits even the data's shortest sample on pipeline stage 1, so planner.on_infeasible=skip would "
            "skip every micro-batch: a sequence of 1002 tokens"
        ), str(error.value)
        # its leanest plan recomputes already: a memory-lean strategy is left to suggest; its peak and budget apart
        assert str(error.value).endswith(
            "the leanest (2x tp_sp/tp_sp+rc) is predicted to peak at 3.92 KiB, over the budget of 3.91 KiB; the "
            "longest that fits is 1000 tokens with this micro-batch size. Give the plans more memory "
            "(memory.budget_gib, more tensor- or pipeline-parallel ranks, fewer micro-batches in flight), or a "
            "memory-lean strategy"
        ), str(error.value)
    planned = PlannedMicroBatches(_loader(tmp_path, lengths), [_planner(0, "skip"), _planner(900, "skip")], stage=1)
    assert next(planned).layout.valid_len == 1002  # with 100 bytes more for the plans it fits (padded to 1004)


def test_every_data_parallel_rank_stops_at_the_step_holding_a_sequence_no_plan_fits(tmp_path):
    lengths = [100, 200, 300, 1500]  # curriculum: steps (100, 200) and (300, 1500); 1500 fits no plan
    ranks = [
        PlannedMicroBatches(_loader(tmp_path, lengths, dp_rank=r, dp_size=2), [_planner(0, "stop")], stage=0)
        for r in (0, 1)
    ]
    assert sorted(next(it).layout.valid_len for it in ranks) == [100, 200]
    for it in ranks:  # both raise, whichever of them holds the long sequence
        with pytest.raises(InfeasibleSequenceError, match=r"^a sequence of 1500 tokens .* longest that fits is 1332 "):
            next(it)


def test_forwards_in_flight_hold_what_the_steps_longest_holds(tmp_path):
    """Two forwards in flight, two micro-batches per step on each of two data-parallel ranks. At 400 tokens
    (any step's longest) two forwards fit alike only recomputed (RC: 2 x 800 held + 1200 running = 2800;
    FAST+RC holds 2000 and peaks at 2400: 4400 > 4000), so a forward may hold 800. The first step's
    micro-batches are all of 200 tokens, where two FAST forwards fit alike (1600 + 1800 = 3400): they run
    FAST, which the 800 would have ruled out. In the second step the one of 300 tokens holds to the
    global batch's longest, 400, on whichever rank it runs (at its own length it would run FAST+RC)."""
    lengths = [200, 200, 200, 200, 300, 400, 400, 400]
    fast, recomputed = (OPTIONS[0],) * 2, (OPTIONS[1],) * 2
    ranks = [
        PlannedMicroBatches(
            _loader(tmp_path, lengths, dp_rank=rank, dp_size=2, micro_batches_per_step=2),
            [_planner(0, "stop", forwards_in_flight=2, longest_tokens=400)],
            stage=0,
        )
        for rank in (0, 1)
    ]
    first = [[(mb.layout.valid_len, mb.decision.plan.layers) for mb in (next(it), next(it))] for it in ranks]
    assert first == [[(200, fast)] * 2] * 2
    second = sorted((mb.layout.valid_len, mb.decision.plan.layers) for it in ranks for mb in (next(it), next(it)))
    assert second == [(300, recomputed)] + [(400, recomputed)] * 3
    # the same planner told no step: any step's longest sets the hold
    unknown = _planner(0, "stop", forwards_in_flight=2, longest_tokens=400)
    assert unknown.decide(ranks[0].loader.sampler.layout((0,))).plan.layers == recomputed  # document 0: 200 tokens
    unknown.set_step_longest(300)
    assert unknown.decide(ranks[0].loader.sampler.layout((4,))).plan.layers not in (fast, recomputed)  # FAST+RC
    lengths = [100, 200, 300, 400, 500]
    it = PlannedMicroBatches(_loader(tmp_path, lengths), [_planner(0, "skip")], stage=0)
    next(it), next(it)
    state = it.save_state()
    resumed = PlannedMicroBatches(_loader(tmp_path, lengths), [_planner(0, "skip")], stage=0)
    resumed.load_state(state)
    assert [next(resumed).layout.valid_len for _ in range(3)] == [next(it).layout.valid_len for _ in range(3)]


def test_the_first_stages_checkpoint_holds_every_stages_planner_as_its_own_ranks_left_it(tmp_path):
    """Megatron saves the data's position from the first pipeline stage's ranks only: each later stage's
    previous plan (hysteresis) must be in it as that stage's ranks left it, to resume as it would have gone on."""
    lengths = [100, 200, 300, 400, 500]
    stages = [
        PlannedMicroBatches(_loader(tmp_path, lengths), [_planner(0, "skip"), _planner(1000, "skip")], stage=stage)
        for stage in (0, 1)
    ]
    for it in stages:
        next(it), next(it)
    saved, own = stages[0].save_state()["planners"][1], stages[1].save_state()["planners"][1]
    assert saved == own and own["previous"] is not None


def test_spread_by_length_climbs_evenly_in_log_length(tmp_path):
    lengths = np.array([5, 3000, 40, 100, 100, 101, 700, 2000, 60, 260, 9000, 150])
    picked = spread_by_length(lengths, 5, 50, 3000)
    assert list(lengths[picked]) == [60, 150, 700, 2000, 3000]  # the first at or above 50, 139, 388, 1080, 3000
    assert list(spread_by_length(lengths, 3, 100, 101)) == [3, 4, 5]  # ties by index, each taken once
    with pytest.raises(ValueError, match=r"the dataset has 3 documents of 100 to 101 tokens, fewer than the 4 asked"):
        spread_by_length(lengths, 4, 100, 101)

    write_documents(tmp_path / "d", [np.full(n, 7) for n in lengths], vocab_size=258)
    subset = DocumentSubset(DocumentDataset(tmp_path / "d"), picked)
    assert list(subset.lengths) == [60, 150, 700, 2000, 3000]
    assert subset.read(1, 10, 5).tolist() == [7] * 5
