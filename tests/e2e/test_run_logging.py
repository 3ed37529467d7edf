"""What a run reports, where its users look: Megatron's TensorBoard and W&B writers and the table.

One 2-rank run of the entry point (TP=2, :mod:`helpers.job_ranks`) with ``--tensorboard-dir``,
``--wandb-project`` (the ``wandb`` module is the stand-in of ``tests/stand_ins``, which records every call)
and ``--log-interval 2``, each rank's output in its own file (the table is the last rank's); its JSONL log
is the reference the writers' figures are checked against. The cost profile is calibrated once for the
whole run (``quick_profile_p2``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from megatron_paradyse.config import ConfigError, load_config
from megatron_paradyse.run.log import IterationLog, read_jsonl

from helpers.job_ranks import launch
from helpers.paths import HELPERS

STAND_INS = HELPERS / "stand_ins"
GIB = 2**30
ITERATIONS = 4
# Eight files of 128 to 16K tokens in curriculum order, two per iteration, under 16 MiB per rank: the
# short ones run the fastest plans, the longest are skipped (no plan fits), so plans switch and skips
# happen within four iterations.
MODEL = [
    "--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "256", "--position-embedding-type", "rope", "--attention-dropout", "0",
    "--hidden-dropout", "0", "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", str(ITERATIONS),
]  # fmt: skip


@dataclass
class Run:
    stdout: str
    """The last rank's (the table's)."""
    records: list[IterationLog]
    tensorboard: Path
    wandb_calls: list[dict]


@pytest.fixture(scope="module")
def run(tmp_path_factory, cache_p2) -> Run:
    folder = tmp_path_factory.mktemp("run")
    config = folder / "cfg.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "memory": {"budget_gib": 21 / 1024},  # the ~4K file fits only recomputed, ~8K and ~16K not at all
                "cost": {"profile": str(cache_p2 / "profile.json"), "check_machine": False},
                "data": {
                    "dataset": "code",
                    "cache_dir": str(cache_p2),
                    "num_documents": 8,
                    "min_len": 128,
                    "max_len": 16384,
                },  # fmt: skip
                # Megatron's TP+SP with and without recompute: the recomputed layer is always the slower,
                # so short files run plain, longer ones recompute (a switch whatever the profile's rates)
                "planner": {"on_infeasible": "skip", "pairs": ["tp_sp/tp_sp"]},
                "log": {"jsonl": "log.jsonl", "measure": True},
            }
        )
    )
    flags = ["--tensorboard-dir", str(folder / "tb"), "--log-interval", "2"]
    flags += ["--wandb-project", "paradyse-test", "--wandb-exp-name", "run", "--wandb-save-dir", str(folder / "wandb")]
    env = {
        "PYTHONPATH": os.pathsep.join([str(STAND_INS), os.environ.get("PYTHONPATH", "")]),
        "WANDB_STAND_IN_LOG": str(folder / "wandb.jsonl"),
    }
    program = ["-m", "megatron_paradyse.pretrain_gpt", "--paradyse-config", str(config), *MODEL, *flags]
    result = launch(2, program, folder / "ranks", env=env)
    assert result.ok, result.output()
    calls = [json.loads(line) for line in (folder / "wandb.jsonl").read_text().splitlines()]
    return Run(result.ranks[1].out, read_jsonl(folder / "log.jsonl"), folder / "tb", calls)


def _expected(records: list[IterationLog]) -> dict[str, dict[int, float]]:
    """Per tag and iteration, the figures the JSONL log implies: times summed over the iteration's
    micro-batches, peaks the largest, switches counted from the previous micro-batch on."""
    out: dict[str, dict[int, float]] = {}
    previous = None
    for r in records:
        mbs = r.micro_batches
        switches = 0
        for mb in mbs:
            switches += previous is not None and mb.plan != previous
            previous = mb.plan
        figures = {
            "micro-batches": len(mbs),
            "tokens": sum(mb.tokens for mb in mbs),
            "plan-switches": switches,
            "skipped-micro-batches": len(r.skipped),
            "time-predicted-s": sum(mb.predicted_time_s for mb in mbs),
            "time-measured-s": sum(mb.measured_time_s for mb in mbs),
            "peak-predicted-gib": max(mb.predicted_peak_bytes for mb in mbs) / GIB,
            "peak-measured-gib": max(mb.measured_peak_bytes for mb in mbs) / GIB,
        }
        for tag, value in figures.items():
            out.setdefault(f"paradyse/{tag}", {})[r.iteration] = value
    return out


def test_the_run_switches_plans_and_skips(run):
    """What the other tests need of the run: plan switches and skipped micro-batches to report."""
    assert [r.iteration for r in run.records] == list(range(1, ITERATIONS + 1))
    expected = _expected(run.records)
    plans = [(mb.tokens, mb.plan) for r in run.records for mb in r.micro_batches]
    assert sum(expected["paradyse/plan-switches"].values()) >= 1, plans
    assert sum(expected["paradyse/skipped-micro-batches"].values()) >= 1


def test_tensorboard_gets_every_iterations_figures_and_plans(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run.tensorboard), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert "lm loss" in events.Tags()["scalars"]  # Megatron's own, in the same event file
    for tag, by_iteration in _expected(run.records).items():
        written = {e.step: e.value for e in events.Scalars(tag)}
        assert written == pytest.approx(by_iteration, rel=1e-6), tag  # event files hold float32
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("paradyse/plans/text_summary")}
    assert sorted(texts) == [r.iteration for r in run.records]
    for r in run.records:
        rows = [line for line in texts[r.iteration].splitlines() if re.match(r"\| (\d+|-) \|", line)]
        assert [row.split(" | ")[3] for row in rows] == [mb.plan for mb in r.micro_batches] + [
            f"skipped: no plan fits stage {s['stage']}" for s in r.skipped
        ]


def test_wandb_gets_the_same_figures_and_plans(run):
    logged: dict[int, dict] = {}
    for call in run.wandb_calls:
        if call["call"] == "log":
            logged.setdefault(call["step"], {}).update(call["data"])
    assert [c for c in run.wandb_calls if c["call"] == "init"] == [
        {"call": "init", "project": "paradyse-test", "name": "run"}
    ]
    for tag, by_iteration in _expected(run.records).items():
        assert {step: values[tag] for step, values in logged.items() if tag in values} == pytest.approx(by_iteration)
    for r in run.records:
        assert all(f"| {mb.plan} |" in logged[r.iteration]["paradyse/plans"] for mb in r.micro_batches)


def test_the_table_follows_the_log_interval(run):
    """Rows for the first iteration and every second one (``--log-interval 2``), as Megatron's own line."""
    shown = [int(m) for m in re.findall(r"^ *(\d+) +[\d.]+ \| +0 ", run.stdout, re.MULTILINE)]
    assert shown == [1, 2, 4]
    assert len(re.findall(r"^ *iter +loss \|", run.stdout, re.MULTILINE)) == 1  # the header, once
    skipped = sum(len(r.skipped) for r in run.records)
    assert len(re.findall(r"^paradyse: skipped on stage 0: ", run.stdout, re.MULTILINE)) == skipped  # every one


def test_log_every_is_refused_with_what_replaced_it(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("log:\n  every: 10\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"{path}:\n  log.every: no longer a key: the table follows Megatron's --log-interval (megatron_args or "
        "the command line)"
    )


def test_the_table_marks_an_explored_plan_and_a_one_time_cost():
    """A micro-batch the planner ran on a runner-up plan to measure it says so in its row, within the
    plan column; its choice does not. So does one whose time holds a one-time cost: the process's first
    measured micro-batch (the warm-up), or one during which the CUDA allocator reserved more memory."""
    from megatron_paradyse.run.log import WARM_UP, Measurement, MicroBatchLog, format_rows

    def record(plan: str, explored: bool, warmup: bool = False, grew: bool = False) -> MicroBatchLog:
        mb = MicroBatchLog(300, 1, 304, plan, 0.1, 2**20, False, False, explored, one_off=WARM_UP if warmup else None)
        mb.take(Measurement(0.2, None, allocator_grew=grew))
        return mb

    def row(plan: str, explored: bool, warmup: bool = False, grew: bool = False) -> str:
        (line,) = format_rows(IterationLog(1, 2.0, [record(plan, explored, warmup, grew)], [], 1.0, 0, 0))
        return line

    assert [record("4x ring/lean", False, *marks).one_off for marks in ((), (True,), (False, True), (True, True))] == [
        None,
        "warm-up",
        "allocator grew",
        "warm-up",  # the first cost named stays
    ]
    assert "4x ring/lean (allocator grew)   " in row("4x ring/lean", False, grew=True)

    long_plan = "1x tp_sp/tp_sp, 1x ulysses/zero3+rc, 1x ring/lean, 1x lean/lean+rc"
    assert "(explored)" in row("4x ring/lean", True) and "(explored)" not in row("4x ring/lean", False)
    assert "... (explored)   0.100" in row(long_plan, True)  # cut to leave the mark in the column
    assert len(row(long_plan, True)) == len(row(long_plan, False))
    assert "4x ring/lean (warm-up)   " in row("4x ring/lean", False, warmup=True)
    assert "(warm-up)" not in row("4x ring/lean", True)
    assert "... (explored) (warm-up)   0.100" in row(long_plan, True, warmup=True)


def test_a_run_that_measures_time_without_memory_logs_and_plots_its_times(tmp_path):
    """``planner.learn_time`` without ``log.measure``: the meter times every micro-batch but measures no
    peak; the writers' figures and the plot take the times and leave the peaks out."""
    from megatron_paradyse.run.log import MicroBatchLog, iteration_scalars, write_plot

    def timed(tokens: int, seconds: float) -> MicroBatchLog:
        mb = MicroBatchLog(tokens, 1, tokens, "4x tp_sp/tp_sp", 0.1, 2**20, cached=False, kept_previous=False)
        mb.measured_time_s = seconds
        return mb

    records = [IterationLog(i, 2.0, [timed(300, 0.25), timed(400, 0.5)], [], 1.0, rank=0, dp_rank=0) for i in (1, 2)]
    scalars = iteration_scalars(records[0], switches=0)
    assert scalars["paradyse/time-measured-s"] == 0.75
    assert "paradyse/peak-measured-gib" not in scalars and scalars["paradyse/peak-predicted-gib"] == 2**20 / GIB
    write_plot(records, tmp_path / "run.png", budget_bytes=2**21)
    assert (tmp_path / "run.png").stat().st_size > 0
