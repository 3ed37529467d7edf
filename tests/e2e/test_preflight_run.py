"""The pre-flight (megatron_paradyse.run.preflight) on two gloo ranks (TP=2) of the entry point, started as
``srun`` would (:mod:`helpers.job_ranks`), the CPU's memory tracker measuring.

A run with the pre-flight trains with the losses of one without, dropout on: the pass draws no data and
leaves the gradients and random numbers as they were; it finds the model within its prediction (hidden
dropout's masks included) and keeps the budget. A model whose memory exceeds its prediction by a known
amount (rank 1 allocates :data:`EXTRA` bytes more in its first layer's forward and keeps them until that
layer's backward, :mod:`helpers.injections`) has its budget shrunk by at least that much, and the run then
completes under it: every micro-batch's measured peak, the extra bytes included, within the configured
budget, which the plans of the unshrunk budget exceed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_paradyse.run.log import read_jsonl

from helpers import entry_point
from helpers.injections import Injection
from helpers.job_ranks import Job, launch

MIB, GIB = 2**20, 2**30
BUDGET = 9 * MIB
EXTRA = 3 * MIB
PLANNER = {"on_infeasible": "skip", "pairs": ["tp_sp/tp_sp"]}
"""One pair, so that the plans do not depend on the calibrated profile's rates: ``tp_sp/tp_sp`` at 1000
tokens, whose prediction leaves less than :data:`EXTRA` of the budget, and the same recomputed in a layer
or two under a smaller budget."""
MODEL = [
    *entry_point.SMALL_GPT,
    *("--hidden-dropout", "0.1", "--tensor-model-parallel-size", "2", "--global-batch-size", "1"),
    *("--log-interval", "1", "--train-iters", "3"),
]
# Twelve files of 900 to 1000 tokens: one length bucket, which ends at the longest (--seq-length 1000); the
# pre-flight flies one micro-batch, of 1000 tokens, under the plan the budget gives that bucket.
DOCS = {"num_documents": 12, "min_len": 900, "max_len": 1000}
SIZE = r"([\d.]+ [KMG]iB)"
KEPT = re.compile(
    rf"paradyse: pre-flight: the micro-batch of 1000 tokens \(plan \[([^]]+)\]\) peaks at {SIZE} of {SIZE} "
    rf"predicted on rank [01], the closest to its prediction of 1 micro-batch flown; budget {SIZE} kept "
    r"\(\d+\.\d s\)"
)
SHRUNK = re.compile(
    rf"paradyse: pre-flight: the micro-batch of 1000 tokens \(plan \[([^]]+)\]\) on rank ([01]): measured {SIZE} "
    rf"exceeds predicted {SIZE} by {SIZE}, the most of 1 micro-batch flown; budget shrunk from {SIZE} to "
    rf"{SIZE} \(\d+\.\d s\)"
)


def _train(folder: Path, cache: Path, preflight: bool, inject: Injection | None = None) -> tuple[Job, list]:
    config = entry_point.small_job_config(
        folder / "cfg.yaml",
        cache,
        memory={"budget_gib": BUDGET / GIB, "preflight": preflight},
        data={"dataset": "code", "cache_dir": str(cache), **DOCS},
        log={"jsonl": "log.jsonl", "measure": True},
        planner=PLANNER,
    )
    program = ["-m", "megatron_paradyse.pretrain_gpt", "--paradyse-config", str(config), *MODEL]
    # Megatron's start-up warms its fused kernels up with torch.compile, ~13 s a rank on this CPU: eager here
    job = launch(2, program, folder / "ranks", env={"TORCH_COMPILE_DISABLE": "1"}, before=inject)
    assert job.ok, job.output()
    return job, read_jsonl(folder / "log.jsonl")


def _line(job: Job) -> str:
    (line,) = [line for line in job.stdout.splitlines() if line.startswith("paradyse: pre-flight")]
    return line


def _mib(size: str) -> float:
    number, unit = size.split()
    return float(number) * {"KiB": 2**-10, "MiB": 1, "GiB": 2**10}[unit]


def _excess_mib(line: str) -> float:
    """By how much the line says the model exceeds its prediction (under it: negative)."""
    if kept := KEPT.fullmatch(line):
        return _mib(kept[2]) - _mib(kept[3])
    shrunk = SHRUNK.fullmatch(line)
    assert shrunk, line
    return _mib(shrunk[5])


@pytest.fixture(scope="module")
def flown(tmp_path_factory, cache_p2) -> tuple[Job, list]:
    return _train(tmp_path_factory.mktemp("flown"), cache_p2, preflight=True)


def test_a_run_with_the_preflight_trains_as_one_without(tmp_path, cache_p2, flown):
    without, plain = _train(tmp_path, cache_p2, preflight=False)
    assert "pre-flight" not in without.stdout
    job, records = flown
    line = _line(job)
    assert KEPT.fullmatch(line), line  # the memory model prices the step, hidden dropout included
    # the same data, plans and losses (each micro-batch's too), to the last bit
    assert len(plain) == 3
    assert [(r.loss, [(mb.tokens, mb.plan, mb.loss) for mb in r.micro_batches]) for r in records] == [
        (r.loss, [(mb.tokens, mb.plan, mb.loss) for mb in r.micro_batches]) for r in plain
    ]


def test_a_model_over_its_prediction_has_its_budget_shrunk_by_the_excess_and_runs_within_it(tmp_path, cache_p2, flown):
    inject = Injection("extra-bytes", rank=1, iteration=0, nbytes=EXTRA)
    job, records = _train(tmp_path, cache_p2, preflight=True, inject=inject)
    line = _line(job)
    print(f"without the extra bytes: {_line(flown[0])}\nwith them: {line}")
    shrunk = SHRUNK.fullmatch(line)
    assert shrunk, line
    plan, rank, (measured, predicted, excess, budget, smaller) = shrunk[1], shrunk[2], map(_mib, shrunk.groups()[2:])
    assert rank == "1" and budget == BUDGET / MIB
    # the model alone is within its prediction by what the run without the extra bytes measured: with them
    # it exceeds it by EXTRA less that, and the budget shrinks by it
    known = EXTRA / MIB + _excess_mib(_line(flown[0]))
    assert budget - smaller >= known - 0.01, (line, _line(flown[0]))
    assert abs(excess - (budget - smaller)) <= 0.01 and abs(measured - predicted - excess) <= 0.01
    assert measured > BUDGET / MIB  # the plan the unshrunk budget gave overflows it
    # the run completes under it: every micro-batch planned within the shrunk budget (not the plan the
    # budget gave before), measured (rank 1's, the extra bytes included) within the configured one
    micro_batches = [mb for r in records for mb in r.micro_batches]
    assert len(records) == 3 and all(mb.predicted_peak_bytes <= smaller * MIB for mb in micro_batches)
    assert all(mb.plan != plan for mb in micro_batches), (plan, [mb.plan for mb in micro_batches])
    assert all(mb.measured_peak_bytes <= BUDGET for mb in micro_batches), [
        (mb.predicted_peak_bytes / MIB, mb.measured_peak_bytes / MIB) for mb in micro_batches
    ]
