"""Pre-flight: before the first optimizer step, the training run proves on this machine that the micro-batches
its data will put at the highest predicted peak fit the memory budget, or shrinks the budget until they do.

The memory model predicts; the allocator, the kernels and the communicators of this machine decide. So once,
at the first training step (``memory.preflight``: on by default where CUDA is, off on the CPU), every rank
runs forward and backward, through the schedule and forward step the run uses, of the micro-batches chosen
from what the loader and the planners already know (:func:`peak_lengths`): the data's longest micro-batch,
the one of highest predicted peak, and the longest of every plan predicted to peak near the budget, each at
the length its plan was priced at. Their inputs are made up (token ids of that length), so the data
iterator is not drawn from. Each peak is measured as the
run's meter measures a micro-batch's (:class:`~megatron_paradyse.run.log.MicroBatchMeter`: the CUDA
allocator's peak, or on the CPU the memory tracker's), the gradients are zeroed and the random number
generators restored: the run then trains as it would have without the pass. Every rank takes the largest
excess of a measured peak over its prediction on any rank; where there is one, the budget shrinks by it
and every planner plans under the smaller budget from the first step on. One line says which, with the
pass's time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.data.batching import make_micro_batch
from megatron_paradyse.mcore.random_state import random_state_kept
from megatron_paradyse.planner import Decision, InfeasibleSequenceError, Planner
from megatron_paradyse.planner.decision import byte_sizes
from megatron_paradyse.run.log import MicroBatchMeter
from megatron_paradyse.run.planned_loader import PlannedMicroBatch, PlannedMicroBatches

from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine
from megatron.core.utils import get_attr_wrapped_model

__all__ = ["NEAR_BUDGET", "Flight", "fly", "peak_lengths", "preflight_line", "unflown", "wanted"]

NEAR_BUDGET = 0.1
"""A plan predicted to peak within this fraction of the budget is near it: its longest micro-batch runs too
(a faster plan a shorter micro-batch gets can peak as high as the longest one's leaner plan)."""


def wanted(setting: bool | str, device: torch.device) -> bool:
    """Whether the run flies a pre-flight (``memory.preflight``; ``auto``: where the device is a GPU)."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


@dataclasses.dataclass(frozen=True)
class Flight:
    """One micro-batch of the pre-flight, as some rank measured it."""

    tokens: int
    plan: str
    """The rank's plan for it, compact."""
    measured_bytes: float
    predicted_bytes: float
    rank: int

    @property
    def excess_bytes(self) -> float:
        return self.measured_bytes - self.predicted_bytes


def peak_lengths(
    planners: Sequence[Planner], *, shortest: int, longest: int, p: int, causal: bool
) -> dict[int, list[Decision]]:
    """The micro-batches to fly, by tokens (longest first), with every pipeline stage's decision for each:
    the longest, and on each stage the one of highest predicted peak and the longest of each plan predicted
    to peak within :data:`NEAR_BUDGET` of the budget; of one document, in the length buckets of ``shortest``
    to ``longest`` tokens, each at its bucket's upper edge, the length its plan is priced at (a bucket no
    plan fits is left out, as the run leaves its micro-batches out). Planned by copies of ``planners``: their
    previous plans and caches stay as they are."""
    decisions = _bucket_decisions(planners, shortest=shortest, longest=longest, p=p, causal=causal)
    if not decisions:
        return {}
    chosen = {max(decisions)}
    for stage, planner in enumerate(planners):
        # buckets ascending: each plan's longest micro-batch is the last one it was chosen for
        by_plan = {stages[stage].plan.compact(): (tokens, stages[stage].plan) for tokens, stages in decisions.items()}
        peaks = {tokens: plan.predicted_peak_bytes for tokens, plan in by_plan.values()}
        near = (1 - NEAR_BUDGET) * planner.budget_bytes
        chosen |= {max(peaks, key=peaks.get), *(tokens for tokens, peak in peaks.items() if peak >= near)}
    return {tokens: decisions[tokens] for tokens in sorted(chosen, reverse=True)}


def _bucket_decisions(
    planners: Sequence[Planner], *, shortest: int, longest: int, p: int, causal: bool
) -> dict[int, list[Decision]]:
    """Every stage's decision for each length bucket of ``shortest`` to ``longest`` tokens some plan fits, by
    the bucket's upper edge, in ascending order."""
    checkers = [planner.with_config(dataclasses.replace(planner.config, on_infeasible="stop")) for planner in planners]
    lengths, index = [], 0
    while not lengths or lengths[-1] < longest:
        edge = min(planners[0].buckets.edge_at(index, 2 * p), longest)
        if edge >= shortest:
            lengths.append(edge)
        index += 1
    decisions: dict[int, list[Decision]] = {}
    for tokens in lengths:
        layout = SequenceLayout.build([tokens], p, causal=causal)
        try:
            stages = [checker.decide(layout) for checker in checkers]
        except InfeasibleSequenceError:
            continue
        decisions[stages[0].bucket_length] = stages
    return decisions


def unflown(iterator: PlannedMicroBatches | None, *, chunks: int) -> str | None:
    """Why the pre-flight cannot fly, if it cannot: the data's longest micro-batch is unknown without the run's
    training iterator (``iterator``); and with several model chunks a stage (``chunks``: the interleaved
    schedule) no micro-batch's peak is its own."""
    if iterator is None:
        return "the data's longest micro-batch is unknown (no training data iterator)"
    if chunks > 1:
        return f"with {chunks} model chunks a stage, its peak holds other micro-batches' work"
    return None


def fly(job, iterator: PlannedMicroBatches | None, step: dict, forward: Callable, *, static_bytes: float) -> float:
    """Fly the pre-flight on this rank (every rank calls it at once, before the first training step) and return
    the budget to plan with from now on; rank 0 prints the line. ``iterator``: the run's training iterator
    (None: this rank has none); ``step``: the arguments of Megatron's ``train_step`` by name;
    ``forward(planned, model)``: the run's forward step for a micro-batch already drawn; ``static_bytes``:
    the stage's weights, gradients and optimizer state."""
    start = time.perf_counter()
    flights, skipped = _flights(job, iterator, step, forward, static_bytes)
    if skipped is not None:
        line, budget = f"pre-flight: skipped: {skipped}", job.budget_bytes
    else:
        line, budget = preflight_line(flights, job.budget_bytes, time.perf_counter() - start)
    if dist.get_rank() == 0:
        print(f"paradyse: {line}", flush=True)
    return budget


def _flights(job, iterator, step: dict, forward: Callable, static_bytes: float) -> tuple[list[Flight], str | None]:
    """Every rank's measurements (the same on every rank), or why nothing flies."""
    model = step["model"]
    reason = unflown(iterator, chunks=len(model))
    if reason is not None:
        return [], reason
    p, causal = iterator.loader.config.p, iterator.loader.config.causal
    shortest, longest = iterator.loader.length_range()
    flights = peak_lengths(iterator.planners, shortest=shortest, longest=longest, p=p, causal=causal)
    if not flights:
        return [], f"no plan fits a micro-batch of the data's lengths ({shortest} to {longest} tokens)"
    meter = MicroBatchMeter(job.device, static_bytes, memory=True)
    meter.attach(get_attr_wrapped_model(model[0], "decoder", return_model_obj=True))

    def forward_step(data_iterator, model_chunk):
        planned = next(data_iterator)
        meter.begin()
        return forward(planned, model_chunk)

    mine = []
    try:
        with random_state_kept(job.device), _inside_a_training_step():
            for tokens, decisions in flights.items():
                decision = decisions[iterator.stage]
                batch = make_micro_batch([np.zeros(tokens, np.int64)], [False], p=p, causal=causal, pad_id=job.pad_id)
                _forward_backward(step, forward_step, PlannedMicroBatch(batch, decision, 0.0), job.args)
                (measured,) = meter.collect()
                mine.append((measured.peak_bytes, decision.plan.predicted_peak_bytes))
    finally:
        meter.detach()
    return _every_rank(mine, flights, iterator.stage, job.device), None


def _forward_backward(step: dict, forward_step, planned: PlannedMicroBatch, args) -> None:
    """One micro-batch through the schedule Megatron's ``train_step`` runs (``step``: its arguments), its
    gradients then zeroed: the first step starts from the gradients it would have had."""
    model = step["model"]
    step["forward_backward_func"](
        forward_step_func=forward_step,
        data_iterator=iter([planned]),
        model=model,
        num_microbatches=1,
        seq_length=args.seq_length,
        micro_batch_size=1,
        decoder_seq_length=args.decoder_seq_length,
        forward_only=False,
        p2p_communicator=step.get("p2p_communicator"),
        pg_collection=step.get("pg_collection"),
    )
    for chunk in model:
        chunk.zero_grad_buffer()


@contextlib.contextmanager
def _inside_a_training_step() -> Iterator[None]:
    """Megatron's rerun state machine as a training step's forward and backward have it, for the checks of the
    loss and the gradients they run (Megatron's ``train_step`` sets it so); as it was, after. Before the
    process's first step those checks record nothing (in its default mode they start with the second)."""
    machine = get_rerun_state_machine()
    state, machine.state = machine.state, RerunState.INITIAL_RUN
    try:
        yield
    finally:
        machine.state = state


def _every_rank(mine: list, flights: dict, stage: int, device: torch.device) -> list[Flight]:
    """Every rank's measurements of the flights, gathered (one collective; a peak not measured counts as
    its prediction)."""
    figures = torch.tensor(
        [[predicted if measured is None else measured, predicted] for measured, predicted in mine],
        dtype=torch.float64,
        device=device,
    )
    stages = torch.tensor([stage], dtype=torch.float64, device=device).expand(len(mine), 1)
    gathered = [torch.empty(len(mine), 3, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.cat([figures, stages], dim=1))
    return [
        Flight(tokens, decisions[int(row[2])].plan.compact(), float(row[0]), float(row[1]), rank)
        for rank, rows in enumerate(gathered)
        for (tokens, decisions), row in zip(flights.items(), rows.tolist())
    ]


def preflight_line(flights: list[Flight], budget_bytes: float, seconds: float) -> tuple[str, float]:
    """The line the pass prints, and the budget to plan with: kept where no rank's measured peak exceeds its
    prediction, else shrunk by the largest excess."""
    worst = max(flights, key=lambda flight: flight.excess_bytes)
    count = len({flight.tokens for flight in flights})
    flown = f"{count} micro-batch{'es' * (count > 1)} flown"
    what = f"the micro-batch of {worst.tokens} tokens (plan [{worst.plan}])"
    if worst.excess_bytes <= 0:
        measured, predicted, budget = byte_sizes(worst.measured_bytes, worst.predicted_bytes, budget_bytes)
        line = (
            f"pre-flight: {what} peaks at {measured} of {predicted} predicted on rank {worst.rank}, the closest to "
            f"its prediction of {flown}; budget {budget} kept ({seconds:.1f} s)"
        )
        return line, budget_bytes
    shrunk = max(budget_bytes - worst.excess_bytes, 0.0)
    measured, predicted, budget, smaller = byte_sizes(worst.measured_bytes, worst.predicted_bytes, budget_bytes, shrunk)
    (excess,) = byte_sizes(worst.excess_bytes)
    line = (
        f"pre-flight: {what} on rank {worst.rank}: measured {measured} exceeds predicted {predicted} by {excess}, "
        f"the most of {flown}; budget shrunk from {budget} to {smaller} ({seconds:.1f} s)"
    )
    return line, shrunk
