"""What ``bench e2e`` records (:mod:`megatron_paradyse.bench.e2e`): per corpus, each arm's steps (status,
peaks, times, losses, plans) and the ratios its report and last line give."""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import NamedTuple

import numpy as np

from megatron_paradyse.bench.memory import PAIRINGS

__all__ = [
    "ADAPTIVE",
    "INFEASIBLE",
    "LEARNING",
    "MEGATRON",
    "MIB",
    "OOM",
    "TRAINED",
    "ArmResult",
    "RankFigures",
    "Corpus",
    "CorpusResult",
    "SequenceResult",
    "length_bins",
    "time_ratio",
]


MIB = 2**20

ADAPTIVE = "adaptive"

LEARNING = "adaptive+learn"

MEGATRON = "megatron"

TRAINED, OOM, INFEASIBLE = "trained", "oom", "infeasible"


@dataclasses.dataclass
class SequenceResult:
    """One step: the micro-batch of every DP rank (one micro-batch in all without ``--dp``)."""

    document_tokens: tuple[tuple[int, ...], ...]
    """Per DP rank, the lengths of the documents of its micro-batch (one document each unless packed)."""
    status: str
    """``trained``; ``oom`` (measured peak over the budget); ``infeasible`` (the planner found no plan)."""
    peak_bytes: tuple[int, ...] = ()
    """Measured peak of each rank, in rank order (empty when not run)."""
    times_s: list[float] = dataclasses.field(default_factory=list)
    """Step time of each timed repeat (trained sequences only)."""
    losses: tuple[float, ...] = ()
    """Per DP rank, the mean loss per token of its micro-batch in the first timed repeat."""
    plans: tuple[str, ...] = ()
    """Per DP rank, the plan its TP group ran."""
    predicted_peak_bytes: tuple[float, ...] = ()
    """Per DP rank, the cost model's peak for its plan at its micro-batch's exact length (none for Megatron's
    layers)."""
    plans_run: list[tuple[str, ...]] = dataclasses.field(default_factory=list)
    """The adaptive+learn arm: per timed repeat, per DP rank, the plan its TP group ran (it learns, so they
    change; ``plans``, ``predicted_peak_bytes`` and ``peak_bytes`` are those of the plan of highest peak)."""
    explored: int = 0
    """The adaptive+learn arm: timed repeats in which this step ran a plan to measure it, not its choice."""
    creates_optimizer_state: bool = False
    """The arm's first step: Adam makes its moments in the optimizer step, after the activations are
    freed, so its peak is below the steady state's, which the cost model gives (it counts the moments as
    held: ``static_memory``)."""
    predicted_time_s: tuple[float, ...] = ()
    """Per DP rank, the cost model's forward + backward time of its plan at its micro-batch's exact length
    (``Planner.predicted_time_s``; none for Megatron's layers, nor for the adaptive+learn arm)."""
    rank_times_s: list[tuple[float, ...]] = dataclasses.field(default_factory=list)
    """Per timed repeat, every rank's forward + backward, in rank order, as the training loop measures a
    micro-batch (:class:`~megatron_paradyse.run.log.MicroBatchMeter`): what ``predicted_time_s`` predicts."""

    @property
    def tokens(self) -> int:
        """The step's length: its longest micro-batch's tokens."""
        return max(map(sum, self.document_tokens))

    @property
    def loss(self) -> float | None:
        """The mean over the DP ranks (what Megatron reports)."""
        return statistics.fmean(self.losses) if self.losses else None

    @property
    def time_s(self) -> float:
        return statistics.median(self.times_s)

    def rank_time_s(self, rank: int) -> float:
        """``rank``'s forward + backward, the median over the repeats."""
        return statistics.median(times[rank] for times in self.rank_times_s)

    def peaks_vs_predicted(self) -> list[tuple[int, str, float, int]]:
        """Per DP rank with a prediction: its micro-batch's tokens, its plan, the predicted peak and the
        highest measured peak of its TP group."""
        tp = len(self.peak_bytes) // len(self.document_tokens)
        measured = [max(self.peak_bytes[i : i + tp]) for i in range(0, len(self.peak_bytes), tp)]
        tokens = map(sum, self.document_tokens)
        return list(zip(tokens, self.plans, self.predicted_peak_bytes, measured))


@dataclasses.dataclass
class ArmResult:
    name: str
    sequences: list[SequenceResult]
    resident_bytes: int = 0
    """Weights + gradients + Adam moments a rank holds after training (every rank holds the same)."""
    first_decisions_s: float = 0.0
    """The planner's decisions in the memory pass: each length bucket planned for the first time."""
    weight_checksums: tuple[float, ...] = ()
    """Per rank, in rank order, the float64 sum of the parameters it holds after training."""
    time_corrections: str = ""
    """The adaptive+learn arm: what it learned, per option and length bucket (rank 0's; every rank agrees)."""
    host_syncs: tuple[str, ...] | None = None
    """The host synchronisations of its memory pass after its first step, on the rank with the most, each
    with where it happened (None: not watched: the adaptive+learn arm has no memory pass)."""

    def trained(self) -> dict[int, SequenceResult]:
        return {i: s for i, s in enumerate(self.sequences) if s.status == TRAINED}

    def longest(self) -> int:
        return max((s.tokens for s in self.trained().values()), default=0)

    def peak_errors(self) -> list[float]:
        """(predicted - measured) / measured peak of every micro-batch with a prediction, in the steady
        state (after the step that creates the optimizer's state)."""
        return [
            predicted / measured - 1
            for s in self.sequences
            if s.peak_bytes and not s.creates_optimizer_state
            for _, _, predicted, measured in s.peaks_vs_predicted()
        ]

    def per_rank(self) -> list[RankFigures]:
        """Every rank's predicted and measured figures, over the steps with a prediction (none: Megatron's
        layers): the step of the rank's largest measured peak in the steady state, its forward + backward
        summed over the steps the arm trained."""
        with_peak = [s for s in self.sequences if s.predicted_peak_bytes and not s.creates_optimizer_state]
        timed = [s for s in self.trained().values() if s.predicted_time_s and s.rank_times_s]
        if not with_peak or not timed:
            return []
        figures = []
        for rank in range(len(with_peak[0].peak_bytes)):
            dp_rank = rank * len(with_peak[0].document_tokens) // len(with_peak[0].peak_bytes)  # r // tp
            worst = max(with_peak, key=lambda s: s.peak_bytes[rank])
            figures.append(
                RankFigures(
                    rank,
                    worst.predicted_peak_bytes[dp_rank],
                    worst.peak_bytes[rank],
                    math.fsum(s.predicted_time_s[dp_rank] for s in timed),
                    math.fsum(s.rank_time_s(rank) for s in timed),
                )
            )
        return figures

    def peak_ratios(self) -> list[float]:
        """Predicted / measured peak of every rank at every step with a prediction, in the steady state."""
        return [
            s.predicted_peak_bytes[rank * len(s.document_tokens) // len(s.peak_bytes)] / peak
            for s in self.sequences
            if s.predicted_peak_bytes and not s.creates_optimizer_state
            for rank, peak in enumerate(s.peak_bytes)
        ]

    def tokens_per_s(self) -> float:
        """Tokens of every DP rank's micro-batches over the step times, over the steps the arm trained."""
        done = self.trained().values()
        return sum(sum(map(sum, s.document_tokens)) for s in done) / math.fsum(s.time_s for s in done)

    def completes(self) -> bool:
        return all(s.status == TRAINED for s in self.sequences)

    def time_on(self, indices) -> float:
        return sum(self.sequences[i].time_s for i in indices)

    def total_by_repeat(self) -> list[float]:
        done = self.trained().values()
        return [sum(r) for r in zip(*(s.times_s for s in done))] if done else []

    def replica_difference(self, tp: int) -> float:
        """The largest relative difference between a rank's weight checksum and its TP rank's on DP rank 0
        (0: the DP replicas hold the same weights)."""
        sums = self.weight_checksums
        return max((abs(c - sums[r % tp]) / max(abs(sums[r % tp]), 1e-30) for r, c in enumerate(sums)), default=0.0)


class RankFigures(NamedTuple):
    """One rank's predicted and measured peak (of one step) and forward + backward time (of all)."""

    rank: int
    predicted_peak_bytes: float
    peak_bytes: int
    predicted_s: float
    measured_s: float


@dataclasses.dataclass
class CorpusResult:
    corpus: str
    tp: int
    dp: int
    pack_tokens: int | None
    """``--pack``: the token budget of a packed micro-batch (None: one document each)."""
    budget_bytes: float
    budget_rule: str
    planner_static_bytes: float
    arms: dict[str, ArmResult]
    step_flops: tuple[float, ...] = ()
    """Model FLOPs of each step: its micro-batches' transformer layers, forward and backward
    (:func:`~megatron_paradyse.bench.frontier.training_flops`, per document)."""
    peak_flops: float = math.nan
    """The GPU's dense bf16 peak, FLOP/s (:data:`~megatron_paradyse.cost.hardware.HARDWARE`; nan: a CPU,
    or a GPU not listed there)."""

    def mfu(self, name: str) -> float:
        """Model FLOP utilisation of arm ``name``: the model FLOPs of the steps it trained over their times,
        all ranks at the GPU's bf16 peak (nan without one)."""
        arm = self.arms[name]
        done = arm.trained()
        seconds = math.fsum(s.time_s for s in done.values())
        ranks = self.tp * self.dp
        return math.fsum(self.step_flops[i] for i in done) / (seconds * ranks * self.peak_flops) if done else math.nan

    def ratios(self) -> dict[str, float]:
        adaptive = self.arms[ADAPTIVE]
        statics = [self.arms[name] for name in PAIRINGS if name in self.arms]
        complete = [a for a in statics if a.completes()]
        best = min(complete, key=lambda a: a.time_on(a.trained()), default=None)
        megatron = self.arms.get(MEGATRON)
        learning = self.arms.get(LEARNING)
        return {
            "adaptive_vs_best_static": time_ratio(adaptive, best) if best else math.nan,
            "adaptive_vs_megatron": time_ratio(adaptive, megatron) if megatron else math.nan,
            "max_len_ratio": adaptive.longest() / max(max(a.longest() for a in statics), 1),
            "adaptive_vs_best_per_bucket_max": self._worst_bucket(ADAPTIVE),
            "learn_vs_adaptive": time_ratio(learning, adaptive) if learning else math.nan,
            "learn_vs_best_per_bucket_max": self._worst_bucket(LEARNING) if learning else math.nan,
        }

    def _worst_bucket(self, arm: str) -> float:
        return max((ratio for _, _, _, ratio in self.per_bucket(arm) if not math.isnan(ratio)), default=math.nan)

    def bins(self) -> list[tuple[int, int]]:
        return length_bins([s.tokens for s in self.arms[ADAPTIVE].sequences])

    def per_bucket(self, arm: str = ADAPTIVE) -> list[tuple[int, int, str, float]]:
        """Per length bin: ``(low, high, best, ratio)``: the fastest static arm that trains every sequence
        of the bin, and ``arm``'s time over its time on the bin's sequences ``arm`` trained (``best``
        empty and ``ratio`` nan where no static arm trains the whole bin, or ``arm`` trains none of it)."""
        planned = self.arms[arm]
        trained = planned.trained()
        rows = []
        for low, high in self.bins():
            inside = [i for i, s in enumerate(planned.sequences) if low <= s.tokens < high]
            if not inside:
                continue
            statics = [self.arms[name] for name in PAIRINGS if name in self.arms]
            whole = [a for a in statics if all(i in a.trained() for i in inside)]
            both = [i for i in inside if i in trained]
            if not whole or not both:
                rows.append((low, high, "", math.nan))
                continue
            best = min(whole, key=lambda a: a.time_on(inside))
            rows.append((low, high, best.name, planned.time_on(both) / best.time_on(both)))
        return rows


def time_ratio(arm: ArmResult, other: ArmResult) -> float:
    both = arm.trained().keys() & other.trained().keys()
    return arm.time_on(both) / other.time_on(both) if both else math.nan


def length_bins(lengths: list[int]) -> list[tuple[int, int]]:
    """Power-of-two bins ``[2^k, 2^(k+1))`` covering ``lengths``."""
    low = 1 << (min(lengths).bit_length() - 1)
    bins = []
    while low <= max(lengths):
        bins.append((low, 2 * low))
        low *= 2
    return bins


@dataclasses.dataclass(frozen=True)
class Corpus:
    name: str
    documents: tuple[np.ndarray, ...]
    """Token ids, in curriculum order (short to long)."""
    micro_batches: tuple[tuple[int, ...], ...]
    """The documents (indices into ``documents``) of each micro-batch, in order: one each, or packed."""
    vocab_size: int
    pad_id: int

    def micro_batch_tokens(self, micro_batch: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(len(self.documents[d]) for d in micro_batch)
