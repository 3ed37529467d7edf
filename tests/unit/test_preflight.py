"""The pre-flight's choices and words (megatron_paradyse.run.preflight): which micro-batches fly, the line it
prints and the budget it leaves, when it does not fly, and its config switch. The flight itself runs in
tests/e2e/test_preflight_run.py."""

from __future__ import annotations

import pytest
import torch
import yaml

from megatron_paradyse.config import ConfigError, load_config
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.base import LayerCost
from megatron_paradyse.planner import Planner, PlannerConfig
from megatron_paradyse.run.preflight import Flight, peak_lengths, preflight_line, unflown, wanted

from helpers.planner_cost_models import FunctionCostModel

MIB = 2**20
FAST, RECOMPUTED = LayerOption("tp_sp", "tp_sp"), LayerOption("tp_sp", "tp_sp", recompute=True)


def _planner(budget: float = 4000.0) -> Planner:
    """Two layers; per layer, saved 4s (s recomputed), transient s: both layers fast peak at 9s (fit s <= 444),
    one recomputed at 6s (s <= 666), both at 3s (s <= 1333)."""

    def costs(option: LayerOption, s: int) -> LayerCost:
        return LayerCost(s * (2.0 if option.recompute else 1.0), s * (1.0 if option.recompute else 4.0), float(s))

    model = FunctionCostModel(costs, lambda saved, transient: saved + transient)
    config = PlannerConfig(on_infeasible="skip", bucket_tokens=4)
    return Planner(config, model, options=(FAST, RECOMPUTED), num_layers=2, budget_bytes=budget)


def test_the_longest_micro_batch_and_every_plans_longest_near_the_budget_fly():
    planner = _planner()
    flights = peak_lengths([planner], shortest=100, longest=1000, p=2, causal=True)
    # 444 tokens: the last both layers fast (3996 of 4000), 664: one recomputed (3984); 1000: the longest
    assert {tokens: decisions[0].plan.compact() for tokens, decisions in flights.items()} == {
        1000: "2x tp_sp/tp_sp+rc",
        664: "1x tp_sp/tp_sp, 1x tp_sp/tp_sp+rc",
        444: "2x tp_sp/tp_sp",
    }
    assert [decisions[0].plan.predicted_peak_bytes for decisions in flights.values()] == [3000, 3984, 3996]
    # each at its length bucket's upper edge, what its plan is priced at (here, of 4 tokens)
    assert list(peak_lengths([planner], shortest=100, longest=997, p=2, causal=True)) == [1000, 664, 444]
    # a longer one no plan fits is left out, as the run skips it: the longest that fits flies instead
    assert list(peak_lengths([planner], shortest=100, longest=1400, p=2, causal=True)) == [1332, 664, 444]
    # the data's shortest bounds them too; each stage's plans count (a leaner stage's: none near its budget)
    assert list(peak_lengths([planner, _planner(10**6)], shortest=500, longest=1000, p=2, causal=True)) == [1000, 664]
    assert peak_lengths([planner], shortest=1400, longest=1400, p=2, causal=True) == {}
    # the run's planner is left as it was: no previous plan, nothing cached
    assert planner.state_dict() == {"previous": None}
    assert not planner.decide(SequenceLayout.build([1000], 2, causal=True)).cached


def test_the_line_keeps_the_budget_or_shrinks_it_by_the_largest_excess_over_the_ranks():
    flights = [
        Flight(4096, "2x tp_sp/tp_sp", 10 * MIB, 11 * MIB, rank=0),
        Flight(4096, "2x tp_sp/tp_sp", 10.5 * MIB, 11 * MIB, rank=1),
        Flight(2048, "2x ulysses/tp_sp", 9 * MIB, 11.5 * MIB, rank=0),
        Flight(2048, "2x ulysses/tp_sp", 9 * MIB, 11.5 * MIB, rank=1),
    ]
    assert preflight_line(flights, 12 * MIB, 1.23) == (
        "pre-flight: the micro-batch of 4096 tokens (plan [2x tp_sp/tp_sp]) peaks at 10.50 MiB of 11.00 MiB "
        "predicted on rank 1, the closest to its prediction of 2 micro-batches flown; budget 12.00 MiB kept (1.2 s)",
        12 * MIB,
    )
    flights[2] = Flight(2048, "2x ulysses/tp_sp", 11.5 * MIB + 300 * 2**10, 11.5 * MIB, rank=0)
    assert preflight_line(flights, 12 * MIB, 0.5) == (
        "pre-flight: the micro-batch of 2048 tokens (plan [2x ulysses/tp_sp]) on rank 0: measured 11.79 MiB "
        "exceeds predicted 11.50 MiB by 300.00 KiB, the most of 2 micro-batches flown; budget shrunk from "
        "12.00 MiB to 11.71 MiB (0.5 s)",
        12 * MIB - 300 * 2**10,
    )


def test_it_does_not_fly_without_the_datas_longest_micro_batch_nor_with_model_chunks():
    assert unflown(None, chunks=1) == "the data's longest micro-batch is unknown (no training data iterator)"
    assert unflown(object(), chunks=2) == "with 2 model chunks a stage, its peak holds other micro-batches' work"
    assert unflown(object(), chunks=1) is None


def test_the_switch_is_auto_true_or_false_and_auto_flies_on_gpus_only(tmp_path):
    path = tmp_path / "cfg.yaml"
    for text, setting in (
        ("memory: {}", "auto"),
        ("memory: {preflight: on}", True),
        ("memory: {preflight: off}", False),
    ):
        path.write_text(text)
        assert load_config(path).memory.preflight == setting
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert [wanted(setting, device) for setting in ("auto", True, False) for device in (cpu, cuda)] == [
        False, True, True, True, False, False,
    ]  # fmt: skip
    for value in ("sometimes", 1):
        path.write_text(yaml.safe_dump({"memory": {"preflight": value}}))
        with pytest.raises(ConfigError) as error:
            load_config(path)
        assert str(error.value) == f"{path}:\n  memory.preflight must be auto, true or false; got {value!r}"
