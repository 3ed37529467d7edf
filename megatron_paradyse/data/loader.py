"""The dynamic-sequence data loader: samples -> epoch order -> micro-batches -> this DP rank's share.

Per epoch, the samples (:class:`~megatron_paradyse.data.samplers.Spans`) are ordered by the sampler
and cut into micro-batches (one sample each, or packed to a token budget). Micro-batches stream on
across epochs; each optimizer step takes the next ``dp_size * micro_batches_per_step`` of them (the
global batch) and gives every DP rank ``micro_batches_per_step`` with balanced predicted work. Every
step is a pure function of (sample lengths, config, ``dp_size``, and the position: epoch, micro-batch
index, and the epoch's phase against the step grid): ranks agree without talking, and the state
resumes a run exactly.

Usage (one per DP rank; ``next`` once per micro-batch, as Megatron's schedules call it)::

    loader = DynamicSequenceLoader(DocumentDataset(prefix), LoaderConfig(p=tp, max_len=32768,
                                   token_budget=32768, sampler="bucketed"), dp_rank=r, dp_size=dp)
    batch = next(loader)              # see megatron_paradyse.data.batching for the keys
    state = loader.state_dict()       # save with the checkpoint; loader.load_state_dict(state) resumes
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, get_args

import numpy as np

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.data.balance import DEFAULT_WORK_MODEL, WorkFn, assign_to_ranks, imbalance, rank_loads
from megatron_paradyse.data.batching import make_micro_batch, pack
from megatron_paradyse.data.indexed import DocumentDataset
from megatron_paradyse.data.samplers import Overflow, SamplerName, Spans, epoch_order, shuffle_steps

__all__ = ["DynamicSequenceLoader", "LoaderConfig", "MicroBatchSampler", "GlobalBatch", "StreamPosition"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LoaderConfig:
    p: int
    """Ranks sharing one sequence (TP with SP): sequences are padded to a multiple of 2p and permuted."""
    max_len: int
    """Longest sample in tokens; longer documents are split or truncated (``overflow``)."""
    causal: bool = True
    """Causal attention (zigzag canonical order) or bidirectional (contiguous)."""
    overflow: Overflow = "split"
    token_budget: int | None = None
    """``None``: one sample per micro-batch. Otherwise samples are packed (THD) up to this many tokens;
    a multiple of ``2p`` and at least ``max_len``, so a packed micro-batch never pads past it."""
    sampler: SamplerName = "curriculum"
    bucket_size: int = 256
    """Samples per length bucket of the ``bucketed`` sampler."""
    seed: int = 0
    micro_batches_per_step: int = 1
    """Micro-batches per DP rank per optimizer step (Megatron's ``get_num_microbatches()``)."""
    pad_id: int = 0
    """Token id of padding and of missing labels; never attended to and never in the loss."""

    def __post_init__(self) -> None:
        for name in ("p", "max_len", "bucket_size", "micro_batches_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"LoaderConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("seed", "pad_id"):
            if getattr(self, name) < 0:
                raise ValueError(f"LoaderConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.sampler not in get_args(SamplerName):
            raise ValueError(f"LoaderConfig.sampler must be one of {get_args(SamplerName)}, got {self.sampler!r}")
        if self.token_budget is not None and (self.token_budget % (2 * self.p) or self.token_budget < self.max_len):
            raise ValueError(
                f"LoaderConfig.token_budget={self.token_budget} must be a multiple of 2p={2 * self.p} and at "
                f"least max_len={self.max_len}"
            )


class StreamPosition(NamedTuple):
    """Where a step starts in the stream of micro-batches."""

    epoch: int
    index: int
    """Micro-batch of the epoch."""
    phase: int
    """Micro-batches of the previous epoch in the step that spans into this one (0: the epoch began on a
    step boundary); the bucketed sampler aligns its global batches with it."""


@dataclasses.dataclass(frozen=True)
class GlobalBatch:
    """One optimizer step: its global batch and which micro-batches each DP rank runs."""

    micro_batches: list[tuple[int, ...]]
    """Sample ids of the global batch's micro-batches, in stream order."""
    assignment: list[list[int]]
    """Per DP rank, indices into ``micro_batches`` (stream order)."""
    works: list[float]
    next: StreamPosition

    @property
    def loads(self) -> np.ndarray:
        """Predicted work per DP rank."""
        return rank_loads(self.works, self.assignment)

    @property
    def imbalance(self) -> float:
        return imbalance(self.loads)


class MicroBatchSampler:
    """This DP rank's micro-batches, as tuples of sample ids, step after step, epoch after epoch.

    ``lengths[i]`` is the input tokens of sample ``i`` (``Spans.length``); ``work`` predicts a
    micro-batch's cost from its layout for the DP balance.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        config: LoaderConfig,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        work: WorkFn = DEFAULT_WORK_MODEL,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if not len(self.lengths):
            raise ValueError("the dataset has no sample with a label (every document is shorter than 2 tokens)")
        if self.lengths.max() > config.max_len:
            raise ValueError(f"a sample has {self.lengths.max()} tokens, more than max_len={config.max_len}")
        self.config = config
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.work = work
        self.position = StreamPosition(0, 0, 0)
        self.consumed = 0
        """This rank's micro-batches of the current step already returned."""
        self._epochs: dict[tuple[int, int], list[tuple[int, ...]]] = {}
        self._global_batch: GlobalBatch | None = None  # the current step's, reused by its micro_batches_per_step calls

    @property
    def step_size(self) -> int:
        """Micro-batches per global batch."""
        return self.dp_size * self.config.micro_batches_per_step

    def epoch_micro_batches(self, epoch: int, phase: int = 0) -> list[tuple[int, ...]]:
        """Every micro-batch of ``epoch`` in stream order; each sample is in exactly one."""
        key = (epoch, phase)
        if key not in self._epochs:
            c = self.config
            order = epoch_order(c.sampler, self.lengths, seed=c.seed, epoch=epoch, bucket_size=c.bucket_size)
            micro_batches = pack(order, self.lengths, c.token_budget)
            if c.sampler == "bucketed":
                head = (self.step_size - phase) % self.step_size
                micro_batches = shuffle_steps(
                    micro_batches, step_size=self.step_size, head=head, seed=c.seed, epoch=epoch
                )
            self._epochs = {k: v for k, v in self._epochs.items() if k[0] >= epoch - 1}
            self._epochs[key] = micro_batches
        return self._epochs[key]

    def global_batch(self, start: StreamPosition) -> GlobalBatch:
        """The step whose global batch starts at ``start``."""
        epoch, index, phase = start
        if not 0 <= index < len(self.epoch_micro_batches(epoch, phase)):
            raise ValueError(
                f"{start} is outside epoch {epoch}, which has {len(self.epoch_micro_batches(epoch))} micro-batches"
            )
        micro_batches: list[tuple[int, ...]] = []
        while len(micro_batches) < self.step_size:
            stream = self.epoch_micro_batches(epoch, phase)
            taken = stream[index : index + self.step_size - len(micro_batches)]
            micro_batches += taken
            index += len(taken)
            if index == len(stream):
                epoch, index, phase = epoch + 1, 0, len(micro_batches) % self.step_size
        works = [float(self.work(self.layout(mb))) for mb in micro_batches]
        return GlobalBatch(
            micro_batches, assign_to_ranks(works, self.dp_size), works, StreamPosition(epoch, index, phase)
        )

    def layout(self, micro_batch: tuple[int, ...]) -> SequenceLayout:
        return SequenceLayout.build(
            [int(self.lengths[i]) for i in micro_batch], self.config.p, causal=self.config.causal
        )

    def __iter__(self) -> MicroBatchSampler:
        return self

    def __next__(self) -> tuple[int, ...]:
        if self._global_batch is None:
            self._global_batch = self.global_batch(self.position)
        micro_batch = self._global_batch.micro_batches[self._global_batch.assignment[self.dp_rank][self.consumed]]
        self.consumed += 1
        if self.consumed == self.config.micro_batches_per_step:
            self.position, self.consumed, self._global_batch = self._global_batch.next, 0, None
        return micro_batch

    def state_dict(self) -> dict:
        """Where the next micro-batch comes from, and what it was computed from (checked on load)."""
        return {
            "position": tuple(self.position),
            "consumed": self.consumed,
            "config": dataclasses.asdict(self.config),
            "dp_size": self.dp_size,
            "num_samples": len(self.lengths),
            "num_tokens": int(self.lengths.sum()),
        }

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        differ = [k for k in ("config", "dp_size", "num_samples", "num_tokens") if state.get(k) != mine[k]]
        if differ:
            details = "; ".join(f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in differ)
            raise ValueError(f"cannot resume the data loader: the run differs from the saved one ({details})")
        if not 0 <= state["consumed"] < self.config.micro_batches_per_step:
            raise ValueError(f"saved consumed={state['consumed']} is not in [0, {self.config.micro_batches_per_step})")
        position = StreamPosition(*state["position"])
        self._global_batch = self.global_batch(position)  # checks the position
        self.position, self.consumed = position, state["consumed"]


class DynamicSequenceLoader:
    """Micro-batch dictionaries (:mod:`megatron_paradyse.data.batching`) of one DP rank, forever."""

    def __init__(
        self,
        dataset: DocumentDataset,
        config: LoaderConfig,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        work: WorkFn = DEFAULT_WORK_MODEL,
    ) -> None:
        self.dataset = dataset
        self.config = config
        self.spans = Spans.build(dataset.lengths, config.max_len, config.overflow)
        self.sampler = MicroBatchSampler(self.spans.length, config, dp_rank=dp_rank, dp_size=dp_size, work=work)

    def micro_batch(self, samples: tuple[int, ...]) -> dict:
        """The micro-batch of the given sample ids."""
        s = self.spans
        pieces = [
            self.dataset.read(int(s.doc[i]), int(s.offset[i]), int(s.length[i] + s.continues[i])) for i in samples
        ]
        c = self.config
        continues = [bool(s.continues[i]) for i in samples]
        return make_micro_batch(pieces, continues, p=c.p, causal=c.causal, pad_id=c.pad_id, samples=samples)

    def __iter__(self) -> DynamicSequenceLoader:
        return self

    def __next__(self) -> dict:
        return self.micro_batch(next(self.sampler))

    def length_range(self) -> tuple[int, int]:
        """(fewest, most) real tokens a micro-batch of this loader can hold: its shortest and longest sample;
        packed, up to the token budget (or every sample together, where that is less)."""
        lengths = self.sampler.lengths
        if self.config.token_budget is None:
            return int(lengths.min()), int(lengths.max())
        return int(lengths.min()), int(min(self.config.token_budget, lengths.sum()))

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
