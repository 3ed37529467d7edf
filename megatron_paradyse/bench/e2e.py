"""End-to-end training on gloo ranks: every static strategy, stock Megatron TP+SP, and the adaptive planner.

    python -m megatron_paradyse.bench e2e                    # p=4, code and DNA corpora, 3 repeats
    python -m megatron_paradyse.bench e2e --quick            # a smoke run: short sequences, 1 repeat
    python -m megatron_paradyse.bench e2e --budget-mib 40 --corpora dna --json runs/e2e.json
    python -m megatron_paradyse.bench e2e --pack 4096        # packed documents, attention per document
    python -m megatron_paradyse.bench e2e --dp 2             # TP=4 x DP=2 on 8 ranks

One launch of ``--p`` x ``--dp`` ranks (Megatron's ``parallel_state``: TP = p with sequence parallelism,
data-parallel size ``--dp``; rank ``r`` is TP rank ``r % p`` of DP rank ``r // p``) trains the GPT of the
CPU demo (``configs/tiny-cpu.yaml``: 4 layers, h=128, 8 heads, FFN 512, RoPE, fp32) on each corpus's
documents in curriculum order (short to long), b = 1, with Adam, under these *arms*, each from the
same initial weights:

- the static strategies ``tp_sp/tp_sp``, ``ulysses/zero3``, ``ring/zero3``, ``lean/lean``: the same
  pair on every layer for every sequence (the Paradyse layer spec);
- ``megatron``: Megatron-Core's own local spec (:mod:`megatron_paradyse.mcore.stock_spec`), TP+SP, natural
  token order with Megatron's causal mask: what a user trains with today;
- ``adaptive``: the :class:`~megatron_paradyse.planner.Planner` (every attention x MLP strategy per
  layer, per-layer recompute) on the calibrated :class:`~megatron_paradyse.cost.AnalyticCostModel`,
  planning each micro-batch within the budget. A sequence it finds no plan for is skipped and reported.
- ``adaptive+learn``: the same planner learning from the run, as ``planner.learn_time`` makes a training
  run do (:mod:`megatron_paradyse.cost.correction`): each step's forward + backward is measured as the
  training loop measures a micro-batch (:class:`~megatron_paradyse.run.log.MicroBatchMeter`), corrects
  the predicted time of the options its plan ran, and the ranks agree on the corrections after the step
  (one gather); now and then it runs a plan the model cannot tell from its choice
  (:mod:`megatron_paradyse.planner.exploration`, the config's default share and margin). What it learned
  carries over from one pass to the next, as from one epoch to the next: ``--learn-passes`` untimed
  passes (a run's earlier epochs) come before its timed repeats, which go on learning. It trains the
  sequences the adaptive arm's memory pass found within budget; its plans change as it learns, so after
  its timed passes every plan it ran is measured again for its peak (as in a memory pass, with Adam's
  moments made), and a sequence one of them takes over the budget is an OOM.

**Micro-batches.** One document each by default. With ``--pack TOKENS``, consecutive documents (in
curriculum order) packed greedily into micro-batches of at most TOKENS tokens in all, by the loader's
own packing (:func:`megatron_paradyse.data.pack`, the loader's ``token_budget``); a document longer
than TOKENS fills a micro-batch alone. Attention stays within each document (the layout's segments).
Megatron's local spec cannot do that on CPU (its packed-sequence path needs Transformer Engine or
flash-attn), so packed runs leave the ``megatron`` arm out and print ``adaptive_vs_megatron=nan``.

**Data parallelism** (``--dp N``). Micro-batch ``i`` goes to DP rank ``i % N``; a trailing remainder of
fewer than N micro-batches is dropped (and reported), so every DP rank runs the same number of steps.
After backward, the gradients of the parameters every TP rank holds whole are all-reduced within TP
(as without DP), then every gradient is averaged over the DP group, as Megatron's DDP does (one flat
gradient buffer, allocated before any step). Each rank's planner plans its DP rank's own micro-batch;
the ranks of a TP group plan the same (checked), and a step runs on every DP rank or on none.
After training, each arm records a checksum of every rank's parameters: equal between the DP replicas
of a TP rank when the gradients were averaged.

**A sequence**, in the tables and ratios, is one *step*: the micro-batches the N DP ranks run together
(one micro-batch without ``--dp``). Its length, which sets its bin and the ``longest`` column, is the
total tokens of its longest micro-batch (its documents' tokens in all when packed). It is trained,
an OOM or infeasible as a whole.

**Peak memory** per rank (all p x N ranks) and sequence is *measured*: the bytes the rank holds before
the step, counted from its tensors (fp32 weights, fp32 gradients allocated up front as Megatron's
gradient buffer, and Adam's two fp32 moments once they exist: 16 bytes per parameter), plus the
high-water mark above them during forward + backward + gradient all-reduces, and during the optimizer
step, from :class:`~megatron_paradyse.core.memory.PeakMemory` (on CPU a dispatch mode that counts the
storages every operator creates until they are freed: tensor bytes, no allocator caching or
fragmentation). The step's inputs (tokens, labels, loss mask, positions, the layout's index tensors)
count as held before it; Megatron's all-gather buffer and rotary tables are released before each step
(:mod:`megatron_paradyse.mcore.step_buffers`, as the training entry point does), so the step's own
are measured.

**Budget** (``--budget-mib``, per rank). Default, per corpus: midway between the largest peak of
``lean/lean`` and the peak of ``tp_sp/tp_sp`` on the longest sequence, so the fast static strategy
cannot hold the longest sequences and the memory-lean one can. A sequence whose measured peak
exceeds the budget on any rank is an **OOM**, as on a device of that size: it is not trained, its
time is not counted, and it counts as a budget violation. Peaks do not depend on weight values, so
each arm first runs an untimed *memory pass* over every sequence; its **timed passes** (``--repeats``)
then train from the initial weights on the sequences within budget only, the arms taking turns at each
step (an order shuffled per repeat and step), so that the machine's drift hits every arm alike: with
whole passes in turn, adaptive measured ``tp_sp/tp_sp``'s own plan at 0.949x of that arm on one corpus
and 1.037x on the other in the same run.

**Time** of a sequence: forward + backward + gradient all-reduces + Adam step (the adaptive arm's
``Planner.decide`` included), between barriers of all the ranks (a DP step ends with its slowest DP
rank); the median over the repeats. Bins are powers of two of the sequence's length.

**Ratios** (per corpus; the last line takes the worst corpus: the largest time ratios, the smallest
length ratio; its five keys are always printed, nan where a ratio has nothing to compare)::

    adaptive_vs_best_static = adaptive time / time of the fastest static arm that trains every sequence
                              within budget, over the sequences both trained (nan if no static arm does)
    adaptive_vs_megatron    = adaptive time / megatron time, over the sequences both trained
                              (nan with --pack: no megatron arm)
    max_len_ratio           = adaptive's longest trained sequence / the longest any static arm trained
    adaptive_vs_best_per_bucket_max
                            = over the length bins: adaptive time / time of the fastest static arm that
                              trains every sequence of the bin, over the bin's sequences adaptive trained
                              (the worst bin; what a user who picked the right static strategy for those
                              lengths would compare with)
    step_mem_err_max        = over both corpora, the largest |predicted - measured| / measured peak of the
                              adaptive arm's steps, in percent: the whole step (weights, gradients, Adam,
                              embedding, layers, output layer and loss, optimizer step) against the cost
                              model's peak for its plan at the step's exact length, or its optimizer
                              step's, whichever is larger (target <= 2, which
                              lets the adaptive arm plan at ``--plan-margin 0.03``)
    learn_vs_adaptive       = adaptive+learn time / adaptive time, over the sequences both trained
    learn_vs_best_per_bucket_max
                            = adaptive_vs_best_per_bucket_max for the adaptive+learn arm
                              (both nan without the arm)

Everything here is measured on this machine; nothing is simulated (``bench simulate`` is).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_paradyse.bench.memory import PAIRINGS
from megatron_paradyse.calibration.startup import cached_quick_profile
from megatron_paradyse.core.memory import peak_bytes_of, storage_bytes
from megatron_paradyse.core.micro_batch import MicroBatch
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.core.plan import LayerOption, Plan
from megatron_paradyse.cost import AnalyticCostModel, load_profile
from megatron_paradyse.cost.correction import TimeCorrections
from megatron_paradyse.data import DocumentDataset, make_micro_batch, pack
from megatron_paradyse.data.corpora import build_code_corpus, build_dna_corpus
from megatron_paradyse.data.subset import spread_by_length
from megatron_paradyse.data.tokenizers import ByteTokenizer, KmerTokenizer
from megatron_paradyse.mcore.chunked_loss import micro_batch_loss
from megatron_paradyse.mcore.model_shape import model_shape, rotary_dim
from megatron_paradyse.mcore.spec import get_paradyse_layer_spec
from megatron_paradyse.mcore.static_memory import OptimizerSetup, pipeline_footprints, torch_optimizer_implementation
from megatron_paradyse.mcore.step_buffers import release_step_buffers
from megatron_paradyse.mcore.stock_spec import stock_block_spec
from megatron_paradyse.planner import Planner, PlannerConfig
from megatron_paradyse.run.log import MicroBatchMeter

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

__all__ = ["ArmResult", "CorpusResult", "SequenceResult", "main"]

MIB = 2**20
ADAPTIVE = "adaptive"
LEARNING = "adaptive+learn"
MEGATRON = "megatron"
TRAINED, OOM, INFEASIBLE = "trained", "oom", "infeasible"
MEGATRON_PLAN = "megatron local spec"
MEGATRON_CANNOT_PACK = (
    "Megatron's local spec has no per-document attention on CPU (its packed-sequence path needs "
    "Transformer Engine or flash-attn)"
)

MODEL = dict(num_layers=4, hidden_size=128, num_attention_heads=8, ffn_hidden_size=512, normalization="LayerNorm")
"""The CPU demo's GPT (``configs/tiny-cpu.yaml``)."""
LEARNING_RATE = 1e-3
SEED = 1234


def demo_config(p: int):
    """The demo GPT's :data:`MODEL` as a Megatron ``TransformerConfig`` for TP=``p`` with sequence
    parallelism, fp32 on the CPU, no dropout."""
    return TransformerConfig(
        **MODEL,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=p,
        sequence_parallel=p > 1,
    )


# -- results ------------------------------------------------------------------------------------------
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

    def ratios(self) -> dict[str, float]:
        adaptive = self.arms[ADAPTIVE]
        statics = [self.arms[name] for name in PAIRINGS if name in self.arms]
        complete = [a for a in statics if a.completes()]
        best = min(complete, key=lambda a: a.time_on(a.trained()), default=None)
        megatron = self.arms.get(MEGATRON)
        learning = self.arms.get(LEARNING)
        return {
            "adaptive_vs_best_static": _time_ratio(adaptive, best) if best else math.nan,
            "adaptive_vs_megatron": _time_ratio(adaptive, megatron) if megatron else math.nan,
            "max_len_ratio": adaptive.longest() / max(max(a.longest() for a in statics), 1),
            "adaptive_vs_best_per_bucket_max": self._worst_bucket(ADAPTIVE),
            "learn_vs_adaptive": _time_ratio(learning, adaptive) if learning else math.nan,
            "learn_vs_best_per_bucket_max": self._worst_bucket(LEARNING) if learning else math.nan,
        }

    def _worst_bucket(self, arm: str) -> float:
        return max((ratio for _, _, _, ratio in self.per_bucket(arm) if not math.isnan(ratio)), default=math.nan)

    def bins(self) -> list[tuple[int, int]]:
        return _bins([s.tokens for s in self.arms[ADAPTIVE].sequences])

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


def _arm_order(names: Sequence[str], repeat: int, step: int) -> list[str]:
    """The order in which the arms run step ``step`` of pass ``repeat``: shuffled with both as seed, the
    same on every rank, so that no arm always follows the same one (at 54be9b7, with the order fixed, the
    adaptive arm, always after Megatron's, ran ``tp_sp/tp_sp``'s own plan slower than that arm in 56 of
    78 sequence-repeat pairs)."""
    order = list(names)
    random.Random(repeat * 1_000_003 + step).shuffle(order)
    return order


def _time_ratio(arm: ArmResult, other: ArmResult) -> float:
    both = arm.trained().keys() & other.trained().keys()
    return arm.time_on(both) / other.time_on(both) if both else math.nan


# -- what runs on every rank --------------------------------------------------------------------------
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    tp: int
    dp: int
    pack_tokens: int | None
    """``--pack`` (None: one document per micro-batch)."""
    repeats: int
    budget_bytes: float | None
    """None: derived per corpus (see the module docstring)."""
    profile: dict
    arms: tuple[str, ...]
    plan_margin: float
    """The adaptive arm plans to ``budget * (1 - plan_margin)``: room for the memory model's error."""
    learn_passes: int
    """Untimed passes of the adaptive+learn arm before its timed repeats."""


def _bench_on_rank(rank: int, world_size: int, corpora: list[Corpus], settings: Settings) -> list[CorpusResult]:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=settings.tp)
    try:
        placement = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_data_parallel_rank())
        if placement != (rank % settings.tp, rank // settings.tp):  # the results' rank order relies on it
            raise RuntimeError(f"rank {rank} is (TP rank, DP rank) {placement}, not r % tp, r // tp")
        model_parallel_cuda_manual_seed(SEED)
        return [_CorpusBench(corpus, settings).run() for corpus in corpora]
    finally:
        parallel_state.destroy_model_parallel()


class _CorpusBench:
    """The arms on one corpus, on this rank: models, batches, memory passes, timed passes."""

    def __init__(self, corpus: Corpus, settings: Settings) -> None:
        p, dp = settings.tp, settings.dp
        self.corpus, self.p, self.settings = corpus, p, settings
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.config = demo_config(p)
        multiple = 128 * p  # Megatron's --make-vocab-size-divisible-by 128, times TP
        self.vocab_size = -(-corpus.vocab_size // multiple) * multiple
        longest = max(sum(corpus.micro_batch_tokens(m)) for m in corpus.micro_batches)

        def build(spec) -> torch.nn.Module:
            torch.manual_seed(SEED)
            return GPTModel(
                self.config,
                spec,
                vocab_size=self.vocab_size,
                max_sequence_length=longest + 2 * p,
                position_embedding_type="rope",
                share_embeddings_and_output_weights=True,  # Megatron's default (no --untie-embeddings-...)
            )

        self.stock = build(stock_block_spec(self.config))  # also without the megatron arm: the initial weights
        self.paradyse = build(get_paradyse_layer_spec(self.config))
        self.initial = {k: v.clone() if torch.is_tensor(v) else v for k, v in self.stock.state_dict().items()}
        (self.footprint,) = pipeline_footprints(
            self.config,
            vocab_size=self.vocab_size,
            tied_embeddings=True,
            learned_positions=0,
            optimizer=OptimizerSetup(torch_optimizer_implementation("cpu"), weight_decay=False),  # _reset's Adam
            grads_in_fp32=True,
        )
        self.cost_model = AnalyticCostModel(
            settings.profile,
            model_shape(self.config),
            p,
            dtype=torch.float32,
            static_bytes=self.footprint.static_bytes,
            vocab_size=self.vocab_size,
            rotary_dim=rotary_dim(self.config, "rope"),
            bias=self.config.add_bias_linear,
            normalization=self.config.normalization,
            tied_unfused_output=not self.config.gradient_accumulation_fusion,  # tied, one stage
        )
        # Step k runs micro-batch k * dp + d on DP rank d; a trailing remainder of fewer than dp is dropped.
        steps = [corpus.micro_batches[k * dp : (k + 1) * dp] for k in range(len(corpus.micro_batches) // dp)]
        self.document_tokens = [tuple(map(corpus.micro_batch_tokens, step)) for step in steps]
        self.batches = []  # this DP rank's micro-batch of each step
        for step in steps:
            documents = [corpus.documents[d] for d in step[self.dp_rank]]
            self.batches.append(
                make_micro_batch(documents, [False] * len(documents), p=p, causal=True, pad_id=corpus.pad_id)
            )
        if MEGATRON in settings.arms:
            for batch in self.batches:  # what Megatron's stock layers take: natural order, padding kept (last)
                order = batch["layout"].canonical_index
                keys = ("tokens", "labels", "loss_mask", "position_ids")
                batch["natural"] = {k: batch[k].index_select(1, order) for k in keys}

    # -- arms -------------------------------------------------------------------------------------
    def run(self) -> CorpusResult:
        names = self.settings.arms
        results = {}
        for name in (n for n in names if n not in (ADAPTIVE, LEARNING)):  # the planners plan within the
            self._progress(f"memory pass, {name}")  # budget the static arms' peaks set
            results[name] = self._memory_pass(name)
        budget, rule = self._budget(results)
        self._progress(f"memory pass, {ADAPTIVE} (budget {budget / MIB:.1f} MiB)")
        results[ADAPTIVE] = self._memory_pass(ADAPTIVE, budget=budget)
        for arm in results.values():
            for s in arm.sequences:
                if s.status == TRAINED and max(s.peak_bytes) > budget:
                    s.status = OOM
        if LEARNING in names:  # it trains what the adaptive arm holds within budget; its peaks come after
            self.learning_planner = self._planner(budget, learn=True)
            self.learning_meter = MicroBatchMeter(torch.device("cpu"), 0.0, memory=False)  # time only
            self.learning_meter.attach(self.paradyse)
            adaptive = results[ADAPTIVE].sequences
            results[LEARNING] = ArmResult(LEARNING, [SequenceResult(s.document_tokens, s.status) for s in adaptive])
            self._learned_plans: dict[tuple[int, int], object] = {}  # (sequence, repeat): this rank's plan
            for learn_pass in range(self.settings.learn_passes):
                self._progress(f"untimed pass {learn_pass + 1}/{self.settings.learn_passes}, {LEARNING}")
                self._pass([results[LEARNING]], learn_pass, first=False, timed=False)
        for repeat in range(self.settings.repeats):
            self._progress(f"timed pass {repeat + 1}/{self.settings.repeats}, the arms taking turns at each step")
            self._pass([results[name] for name in names], repeat, first=repeat == 0)
        if LEARNING in names:
            self._progress(f"memory pass, {LEARNING}: every plan it ran")
            self._learned_peaks(results[LEARNING], budget)
        arms = {n: results[n] for n in names}
        s = self.settings
        return CorpusResult(
            self.corpus.name, s.tp, s.dp, s.pack_tokens, budget, rule, self.footprint.static_bytes, arms
        )

    def _progress(self, what: str) -> None:
        if dist.get_rank() == 0:
            print(f"bench e2e: {self.corpus.name}: {what}", file=sys.stderr, flush=True)

    def _budget(self, results: dict[str, ArmResult]) -> tuple[float, str]:
        if self.settings.budget_bytes is not None:
            return self.settings.budget_bytes, "--budget-mib"
        lean = max(max(s.peak_bytes) for s in results["lean/lean"].sequences)
        fast = max(max(results["tp_sp/tp_sp"].sequences, key=lambda s: s.tokens).peak_bytes)
        if lean >= fast:
            raise ValueError(
                f"{self.corpus.name}: lean/lean peaks at {lean / MIB:.1f} MiB, not below tp_sp/tp_sp's "
                f"{fast / MIB:.1f} MiB on the longest sequence: no budget separates them; use longer "
                f"sequences (--max-len) or give --budget-mib"
            )
        return (lean + fast) / 2, "midway between lean/lean's largest peak and tp_sp/tp_sp's on the longest sequence"

    def _planner(self, budget: float, *, learn: bool = False):
        config = PlannerConfig(on_infeasible="skip", learn_time=learn)
        return Planner.for_model(
            config,
            self.cost_model,
            shape=self.cost_model.shape,
            p=self.p,
            num_layers=self.footprint.layers,
            budget_bytes=budget * (1.0 - self.settings.plan_margin),
            time_corrections=TimeCorrections(config.learning.learn_prior) if learn else None,
        )

    def _arm_plan(self, name: str, planner, layout):
        """The plan of a micro-batch (None: Megatron's own layers); raises _Infeasible for the planner."""
        if name == MEGATRON:
            return None
        if name in (ADAPTIVE, LEARNING):
            decision = planner.decide(layout)
            if decision is None:
                raise _Infeasible
            return decision.plan
        return Plan.uniform(LayerOption.parse(name), self.config.num_layers)

    def _reset(self, name: str):
        """The arm's model at the initial weights, its Adam, and its flat gradient buffer."""
        model = self._model(name)
        model.load_state_dict(self.initial)
        return model, torch.optim.Adam(model.parameters(), lr=LEARNING_RATE), _gradient_buffer(model)

    def _model(self, name: str) -> torch.nn.Module:
        return self.stock if name == MEGATRON else self.paradyse

    def _gather(self, value) -> list:
        """``value`` of every rank, in rank order."""
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
        return values

    def _per_dp_rank(self, values: list) -> tuple:
        """One value per DP rank from every rank's, which the ranks of each TP group must agree on."""
        groups = [values[i : i + self.p] for i in range(0, len(values), self.p)]
        for d, group in enumerate(groups):
            if any(v != group[0] for v in group):
                raise RuntimeError(f"the TP ranks of DP rank {d} disagree: {group}")
        return tuple(group[0] for group in groups)

    # -- passes -----------------------------------------------------------------------------------
    def _memory_pass(self, name: str, budget: float | None = None) -> ArmResult:
        """Every sequence once, untimed, under the storage tracker: the peak of each rank."""
        model, optimizer, grads = self._reset(name)
        planner = self._planner(budget) if name == ADAPTIVE else None
        if planner is not None:
            self.adaptive_planner = planner  # the timed passes reuse its cached plans
        results, deciding = [], 0.0
        for batch, document_tokens in zip(self.batches, self.document_tokens):
            layout = batch["layout"]
            try:
                start = time.perf_counter()
                try:
                    plan = self._arm_plan(name, planner, layout)
                finally:
                    deciding += time.perf_counter() - start
                planned = (
                    (MEGATRON_PLAN, None) if plan is None else (plan.compact(), self._predicted_peak(plan, layout))
                )
            except _Infeasible:
                planned = None
            plans = self._per_dp_rank(self._gather(planned))
            if None in plans:  # a step runs on every DP rank or on none
                results.append(SequenceResult(document_tokens, INFEASIBLE))
                continue
            creates_optimizer_state = not optimizer.state
            peaks = self._measured_peaks(model, optimizer, grads, batch, plan)
            results.append(
                SequenceResult(
                    document_tokens,
                    TRAINED,
                    tuple(peaks),
                    plans=tuple(text for text, _ in plans),
                    predicted_peak_bytes=tuple(peak for _, peak in plans if peak is not None),
                    creates_optimizer_state=creates_optimizer_state,
                )
            )
        return ArmResult(name, results, first_decisions_s=deciding if planner is not None else 0.0)

    def _predicted_peak(self, plan, layout) -> float:
        """The cost model's peak of one step of ``plan`` at ``layout``: its micro-batch's, or the optimizer
        step's (the footprint's), whichever is larger."""
        step = self.footprint.static_bytes + self.footprint.optimizer_step_bytes
        return max(self.cost_model.plan_peak_bytes(plan, layout, 1), step)

    def _measured_peaks(self, model, optimizer, grads: torch.Tensor, batch: dict, plan) -> list[int]:
        """Every rank's peak of one step of ``plan`` (None: Megatron's layers) on ``batch``: what it holds
        before the step, plus the high-water mark of forward + backward + all-reduces or of Adam's step."""
        release_step_buffers()  # Megatron's all-gather buffer and rotary tables: the step's own
        resident = _resident_bytes(model, optimizer) + _input_bytes(batch, plan)
        forward_backward = peak_bytes_of(functools.partial(self._forward_backward, model, grads, batch, plan))
        step = peak_bytes_of(lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=False)))
        return self._gather(resident + max(forward_backward, step))

    def _pass(self, arms: list[ArmResult], repeat: int, *, first: bool, timed: bool = True) -> None:
        """Train each of ``arms`` from the initial weights on the sequences it holds within budget, the arms
        taking turns at each step in an order shuffled per ``repeat`` and step (the same on every rank), so
        that a change in the machine's load hits them alike; time each step (``timed``: record the times;
        ``first``: the losses too). The arms of one model keep their own weights and Adam between their
        steps, swapped in and out of it outside the timed window."""
        models = {id(model): model for model in (self._model(arm.name) for arm in arms)}
        grads = {key: _gradient_buffer(model) for key, model in models.items()}  # one per model, shared
        turns = {arm.name: self._turn(arm, grads) for arm in arms}
        for index in range(len(self.batches)):
            for name in _arm_order(list(turns), repeat, index):
                turn = turns[name]
                turn.swap_in()
                self._step(turn, index, first=first, timed=timed)
                turn.swap_out()
        for turn in turns.values():
            turn.swap_in()
            turn.arm.resident_bytes = _resident_bytes(turn.model, turn.optimizer)
            checksum = sum(float(param.detach().double().sum()) for param in turn.model.parameters())
            turn.arm.weight_checksums = tuple(self._gather(checksum))

    def _turn(self, arm: ArmResult, grads: dict) -> _Turn:
        model = self._model(arm.name)
        planner, meter = None, None
        if arm.name == ADAPTIVE:  # plans cached by the memory pass, as in a run where length buckets recur
            planner = self.adaptive_planner
        if arm.name == LEARNING:  # what it learned in the passes before, as in a run's later epochs
            planner, meter = self.learning_planner, self.learning_meter
        if planner is not None:
            planner.forget_previous()
        initial = [self.initial[name].clone() for name, _ in model.named_parameters()]
        optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
        return _Turn(arm, model, optimizer, grads[id(model)], initial, planner, meter)

    def _step(self, turn: _Turn, index: int, *, first: bool, timed: bool) -> None:
        """``turn``'s arm trains on sequence ``index`` (if it holds it within budget), timed between barriers."""
        arm, planner, meter = turn.arm, turn.planner, turn.meter
        batch, result = self.batches[index], turn.arm.sequences[index]
        if result.status != TRAINED:
            if planner is not None:  # the planner sees every sequence, as in the memory pass (hysteresis)
                planner.decide(batch["layout"])
            return
        explored = _explorations(planner)
        dist.barrier()
        start = time.perf_counter()
        plan = self._arm_plan(arm.name, planner, batch["layout"])
        if meter is not None:
            meter.begin()
        loss = self._forward_backward(turn.model, turn.grads, batch, plan)
        turn.optimizer.step()
        turn.optimizer.zero_grad(set_to_none=False)
        if meter is not None:
            self._learn(planner, meter, batch["layout"], plan)
        dist.barrier()
        if timed:
            result.times_s.append(time.perf_counter() - start)
        if first:
            result.losses = tuple(self._gather(loss)[:: self.p])
        if meter is not None:
            self._learned_plans[(index, len(result.plans_run))] = plan
            result.plans_run.append(self._per_dp_rank(self._gather(plan.compact())))
            result.explored += _explorations(planner) > explored
        elif plan is not None and plan.compact() != result.plans[self.dp_rank]:
            raise RuntimeError(
                f"{arm.name}: plan {plan.compact()} differs from the memory pass's {result.plans[self.dp_rank]}"
            )

    @staticmethod
    def _learn(planner, meter, layout, plan) -> None:
        """What the training loop does with a measured micro-batch when ``planner.learn_time`` is on, here
        after every step: correct the time model, agree on it across the ranks, and plan with it."""
        (measured,) = meter.collect()
        planner.observe_time(layout, plan, measured.time_s)
        if planner.cost_model.corrections.agree(most_entries=len(planner.options)):  # one micro-batch a step
            planner.clear_cache()

    def _learned_peaks(self, arm: ArmResult, budget: float) -> None:
        """Measure each plan the adaptive+learn arm ran on each sequence, in the steady state (Adam's
        moments made); a sequence one of them takes over ``budget`` on any rank becomes an OOM."""
        model, optimizer, grads = self._reset(arm.name)
        optimizer.step()  # makes Adam's moments; the gradients are zero, so the weights do not move
        for index, result in enumerate(arm.sequences):
            if result.status != TRAINED:
                continue
            measured = {}  # the plans of every DP rank -> (every rank's peak, each DP rank's predicted peak)
            for repeat, plans in enumerate(result.plans_run):
                if plans not in measured:
                    plan, batch = self._learned_plans[(index, repeat)], self.batches[index]
                    peaks = self._measured_peaks(model, optimizer, grads, batch, plan)
                    predicted = self._gather(self._predicted_peak(plan, batch["layout"]))
                    measured[plans] = (tuple(peaks), self._per_dp_rank(predicted))
            result.plans, (result.peak_bytes, result.predicted_peak_bytes) = max(
                measured.items(), key=lambda item: max(item[1][0])
            )
            if max(result.peak_bytes) > budget:  # as any arm's OOM: not trained, its time not counted
                result.status, result.times_s, result.losses = OOM, [], ()
        learned = self._gather(self.learning_planner.cost_model.corrections.summary())
        if any(summary != learned[0] for summary in learned):
            raise RuntimeError(f"{LEARNING}: the ranks learned different time corrections: {learned}")
        arm.time_corrections = learned[0]

    def _forward_backward(self, model, grads: torch.Tensor, batch: dict, plan) -> float:
        """Mean loss per token of one micro-batch, backward, Megatron's TP all-reduce of the gradients of
        parameters every rank holds whole (norms, row-parallel biases), and the average over the DP ranks
        of every gradient (``grads``: the flat buffer they live in)."""
        if plan is None:  # Megatron's own layers: natural token order (padding last), its causal mask
            natural = batch["natural"]
            per_token = model(natural["tokens"], natural["position_ids"], None, labels=natural["labels"])
            loss = (per_token * natural["loss_mask"]).sum() / natural["loss_mask"].sum()
        else:
            loss = micro_batch_loss(model, batch, MicroBatch(layout=batch["layout"], plan=plan))
        loss.backward()
        for param in model.parameters():
            if getattr(param, "sequence_parallel", False) and self.p > 1:
                dist.all_reduce(param.grad, group=self.tp_group)
        if self.settings.dp > 1:
            dist.all_reduce(grads, group=self.dp_group)
            grads.div_(self.settings.dp)
        return loss.item()


@dataclasses.dataclass
class _Turn:
    """An arm during a pass: its own weights (in its model only while it runs a step), Adam and planner."""

    arm: ArmResult
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    grads: torch.Tensor
    """The model's flat gradient buffer, shared by the arms of that model (each step zeroes it)."""
    weights: list[torch.Tensor]
    planner: object | None
    meter: object | None

    def swap_in(self) -> None:
        with torch.no_grad():
            for param, weight in zip(self.model.parameters(), self.weights):
                param.copy_(weight)

    def swap_out(self) -> None:
        with torch.no_grad():
            for param, weight in zip(self.model.parameters(), self.weights):
                weight.copy_(param)


def _gradient_buffer(model: torch.nn.Module) -> torch.Tensor:
    """One flat buffer holding every parameter's gradient, made before any step, as Megatron's DDP keeps
    them (one DP all-reduce)."""
    params = list(model.parameters())
    grads = torch.zeros(sum(param.numel() for param in params))
    offset = 0
    for param in params:
        param.grad = grads[offset : offset + param.numel()].view_as(param)
        offset += param.numel()
    return grads


def _explorations(planner) -> int:
    """How many of ``planner``'s decisions ran a plan to measure it (0 where it does not explore)."""
    return 0 if planner is None or planner.exploration is None else planner.exploration.explored


class _Infeasible(Exception):
    """The planner found no plan that fits the budget for this micro-batch."""


def _input_bytes(batch: dict, plan) -> int:
    """Bytes of the micro-batch's inputs the step reads (Megatron's layers: natural order, no index
    tensors), which exist before it starts: the cost model counts them (``stage_bytes``)."""
    if plan is None:
        tensors = list(batch["natural"].values())
    else:
        tensors = [batch[k] for k in ("tokens", "labels", "loss_mask", "position_ids")]
        tensors += list(batch["layout"].indices("cpu"))
    return storage_bytes(tensors)


def _resident_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages of ``model``'s parameters and gradients and ``optimizer``'s state."""
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    return storage_bytes(tensors)


# -- the command --------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_paradyse.bench e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--p", type=int, default=4, help="tensor-parallel size (default 4)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size: p x dp gloo ranks (default 1)")
    parser.add_argument(
        "--pack",
        type=int,
        metavar="TOKENS",
        help="pack consecutive documents into micro-batches of at most TOKENS tokens (default: one document each)",
    )
    parser.add_argument("--corpora", default="code,dna", help="comma-separated: code, dna (default both)")
    parser.add_argument("--sequences", type=int, default=16, help="documents per corpus (default 16)")
    parser.add_argument("--min-len", type=int, default=256, help="shortest document, tokens (default 256)")
    parser.add_argument("--max-len", type=int, default=4096, help="longest document, tokens (default 4096)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per arm; medians (default 3)")
    parser.add_argument("--budget-mib", type=float, help="memory budget per rank (default: derived per corpus)")
    parser.add_argument(
        "--plan-margin",
        type=float,
        default=0.03,
        help="the adaptive arm plans to the budget times 1 - this, room for the memory model's error (default 0.03)",
    )
    parser.add_argument("--arms", help="arms to run (default: all; no megatron with --pack)")
    parser.add_argument(
        "--learn-passes",
        type=int,
        default=10,
        help="untimed passes of the adaptive+learn arm before its timed repeats, learning (default 10)",
    )
    parser.add_argument("--cache-dir", type=Path, default=Path("paradyse-bench-cache"), help="corpora, profile")
    parser.add_argument("--profile", type=Path, help="cost profile (default: calibrated once into --cache-dir)")
    parser.add_argument("--json", type=Path, help="write every sequence's result here")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 6 sequences of 128..1024 tokens, 1 repeat (flags win)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.quick:
        given = set(argv or ())
        quick = {"sequences": 6, "min_len": 128, "max_len": 1024, "repeats": 1, "learn_passes": 1}
        for name, value in quick.items():
            if f"--{name.replace('_', '-')}" not in given:
                setattr(args, name, value)
    try:
        if min(args.repeats, args.p, args.dp) < 1 or (args.pack is not None and args.pack < 1):
            raise ValueError(
                f"--repeats, --p, --dp and --pack must be >= 1, got {args.repeats}, {args.p}, {args.dp}, {args.pack}"
            )
        if args.learn_passes < 0:
            raise ValueError(f"--learn-passes must be >= 0, got {args.learn_passes}")
        arms = _arms(args.arms, args.budget_mib, packed=args.pack is not None)
        corpora = [_corpus(name, args) for name in _names(args.corpora)]
        for corpus in corpora:
            if len(corpus.micro_batches) < args.dp:
                raise ValueError(f"{corpus.name}: {len(corpus.micro_batches)} micro-batches, fewer than --dp {args.dp}")
        if not 0.0 <= args.plan_margin < 1.0:
            raise ValueError(f"--plan-margin must be in [0, 1), got {args.plan_margin}")
        profile, where = _profile(args)
    except ValueError as e:  # ProfileError included
        parser.exit(2, f"bench e2e: error: {e}\n")
    settings = Settings(
        tp=args.p,
        dp=args.dp,
        pack_tokens=args.pack,
        repeats=args.repeats,
        budget_bytes=None if args.budget_mib is None else args.budget_mib * MIB,
        profile=profile,
        arms=arms,
        plan_margin=args.plan_margin,
        learn_passes=args.learn_passes,
    )
    data_parallel = f"; DP={args.dp}, gradients averaged over the DP ranks" if args.dp > 1 else ""
    micro_batches = (
        "one document per micro-batch"
        if args.pack is None
        else f"consecutive documents packed into micro-batches of at most {args.pack} tokens, attention per document"
    )
    print(
        f"bench e2e: {args.p * args.dp} gloo ranks (TP={args.p}, sequence parallel{data_parallel}), GPT "
        f"{_model_text()}, fp32, Adam lr={LEARNING_RATE}, b=1, {micro_batches}, curriculum order; {args.repeats} "
        f"timed repeat(s), medians; cost profile: {where}; adaptive plans to {1 - args.plan_margin:.0%} of the budget"
        + (f"; {LEARNING} learns over {args.learn_passes} untimed passes first" if LEARNING in arms else ""),
        flush=True,
    )
    print(
        "peak = weights + gradients + Adam moments held by the rank (16 B/param, counted from its tensors) "
        "+ the micro-batch's inputs and index tensors + the high-water mark above them in "
        "forward+backward+all-reduces and in the optimizer step, measured by "
        "megatron_paradyse.core.memory.PeakMemory (CPU: a dispatch mode tracking every storage operators "
        "create: tensor bytes, no allocator caching); OOM = measured peak over the budget on any rank; "
        "peak vs model and step_mem_err_max leave out each arm's first step (Adam makes its moments there)",
        flush=True,
    )
    if args.pack is not None:
        print(f"megatron arm: not run with --pack: {MEGATRON_CANNOT_PACK}; adaptive_vs_megatron=nan", flush=True)
    start = time.perf_counter()
    results = run_on_ranks(_bench_on_rank, args.p * args.dp, args=(corpora, settings), timeout_s=3 * 3600)[0]
    for result in results:
        _print_corpus(result, next(c for c in corpora if c.name == result.corpus))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    print(f"bench e2e: {time.perf_counter() - start:.0f} s")
    print(_summary_line(results))
    return 0


def _names(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in ("code", "dna")]
    if unknown or not names:
        raise ValueError(f"--corpora takes code and/or dna, got {text!r}")
    return names


def _arms(text: str | None, budget_mib: float | None, *, packed: bool) -> tuple[str, ...]:
    known = (*PAIRINGS, MEGATRON, ADAPTIVE, LEARNING)
    if text is None:
        return tuple(a for a in known if not (packed and a == MEGATRON))
    arms = tuple(a for a in text.split(",") if a)
    unknown = [a for a in arms if a not in known]
    if unknown:
        raise ValueError(f"--arms: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    if packed and MEGATRON in arms:
        raise ValueError(f"--arms: megatron cannot run with --pack: {MEGATRON_CANNOT_PACK}")
    required = {ADAPTIVE, PAIRINGS[0]} | (set() if packed else {MEGATRON})
    required |= set() if budget_mib else {"tp_sp/tp_sp", "lean/lean"}
    missing = sorted(required - set(arms))
    if missing:
        raise ValueError(f"--arms must include {', '.join(missing)} (the ratios and the derived budget need them)")
    return tuple(a for a in known if a in arms)


def _corpus(name: str, args: argparse.Namespace) -> Corpus:
    """``args.sequences`` documents of ``args.min_len..args.max_len`` tokens spread evenly in log length,
    in micro-batches of one document each or packed to ``args.pack`` tokens."""
    if name == "code":
        prefix, tokenizer = build_code_corpus(args.cache_dir), ByteTokenizer()
    else:
        # The binned lengths need a corpus of at least a few thousand tokens at the top.
        prefix, tokenizer = build_dna_corpus(args.cache_dir, max_len=max(args.max_len, 4096)), KmerTokenizer(3)
    dataset = DocumentDataset(prefix)
    docs = spread_by_length(dataset.lengths, args.sequences, args.min_len, args.max_len)
    documents = tuple(np.asarray(dataset[int(d)], dtype=np.int64) for d in docs)
    lengths = np.array([len(d) for d in documents])
    if args.pack is not None:  # a longer document counts as the budget: the packing puts it alone
        lengths = np.minimum(lengths, args.pack)
    micro_batches = tuple(pack(np.arange(len(documents)), lengths, args.pack))
    return Corpus(name, documents, micro_batches, tokenizer.vocab_size, tokenizer.pad_id)


def _profile(args: argparse.Namespace) -> tuple[dict, str]:
    """The ``--profile`` given, or the quick one with its fitted correction, read from or calibrated into
    ``--cache-dir`` (:func:`~megatron_paradyse.calibration.startup.cached_quick_profile`)."""
    if args.profile is not None:
        return load_profile(args.profile, p=args.p, check_machine=False), str(args.profile)
    profile = cached_quick_profile(args.cache_dir, args.p, device="cpu", dtype=torch.float32)
    return profile, f"the quick profile in {args.cache_dir}"


# -- output -------------------------------------------------------------------------------------------
def _model_text() -> str:
    m = MODEL
    return (
        f"{m['num_layers']} layers h={m['hidden_size']} heads={m['num_attention_heads']} "
        f"ffn={m['ffn_hidden_size']} RoPE"
    )


def _bins(lengths: list[int]) -> list[tuple[int, int]]:
    """Power-of-two bins ``[2^k, 2^(k+1))`` covering ``lengths``."""
    low = 1 << (min(lengths).bit_length() - 1)
    bins = []
    while low <= max(lengths):
        bins.append((low, 2 * low))
        low *= 2
    return bins


def _fmt_len(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _print_corpus(result: CorpusResult, corpus: Corpus) -> None:
    lengths = [len(d) for d in corpus.documents]
    bins = result.bins()
    arms = result.arms
    print(
        f"\n== {result.corpus} corpus: {len(lengths)} documents of {min(lengths)}..{max(lengths)} tokens; "
        f"budget {result.budget_bytes / MIB:.1f} MiB per rank ({result.budget_rule}); the planner counts "
        f"{result.planner_static_bytes / MIB:.2f} MiB of weights, gradients and Adam state, the ranks hold "
        f"{max(a.resident_bytes for a in arms.values()) / MIB:.2f} MiB"
    )
    _print_steps(result, corpus)
    head = ["arm", "trained", "longest", "total s (range)"]
    head += [f"[{_fmt_len(a)},{_fmt_len(b)})" for a, b in bins]
    head += ["peak MiB", "over budget", "peak vs model", "last loss"]
    rows = []
    for arm in arms.values():
        trained = arm.trained()
        totals = arm.total_by_repeat()
        cells = [
            arm.name,
            f"{len(trained)}/{len(arm.sequences)}",
            str(arm.longest()),
            f"{arm.time_on(trained):.2f} ({min(totals):.2f}-{max(totals):.2f})" if totals else "-",
        ]
        for low, high in bins:
            inside = [i for i, s in enumerate(arm.sequences) if low <= s.tokens < high]
            done = [i for i in inside if i in trained]
            text = f"{arm.time_on(done):.2f}" if done else "-"
            if len(done) < len(inside):
                text += f" ({len(inside) - len(done)} not)"
            cells.append(text)
        run = [s for s in arm.sequences if s.peak_bytes]
        peak = max((max(s.peak_bytes) for s in trained.values()), default=0)
        over = [s for s in run if s.status == OOM]
        cells += [
            f"{peak / MIB:.1f}",
            f"{len(over)}" + (f" (worst {max(max(s.peak_bytes) for s in over) / MIB:.1f})" if over else ""),
            _model_error(run),
            f"{trained[max(trained)].loss:.4f}" if trained else "-",
        ]
        rows.append(cells)
    _print_table(head, rows)
    adaptive = arms[ADAPTIVE]
    skipped = [s.tokens for s in adaptive.sequences if s.status == INFEASIBLE]
    if skipped:
        print(f"adaptive: no plan fits the budget for {len(skipped)} sequence(s): {skipped} tokens (skipped)")
    _print_predictions(adaptive)
    print("adaptive plans: " + _plan_counts(s.plans for s in adaptive.trained().values()))
    print(
        f"adaptive: the planner's first decision of each length bucket took {adaptive.first_decisions_s:.3f} s "
        f"in all (memory pass); timed passes reuse its cached plans (decisions included in their times)"
    )
    learning = arms.get(LEARNING)
    if learning is not None:
        done = learning.trained().values()
        print(
            f"{LEARNING} plans, last repeat: {_plan_counts(s.plans_run[-1] for s in done)}; every pass: "
            f"{_plan_counts(plans for s in done for plans in s.plans_run)}; explored in "
            f"{sum(s.explored for s in done)} of {sum(len(s.plans_run) for s in done)} steps"
        )
        print(f"{LEARNING}: time corrections learned (option x[bucket: factor]): {learning.time_corrections}")
    for name in (n for n in (ADAPTIVE, LEARNING) if n in arms):
        print(
            f"{name} / the fastest static arm of each length bin: "
            + "; ".join(
                f"[{_fmt_len(low)},{_fmt_len(high)}) " + (f"{ratio:.3f} vs {best}" if best else "-")
                for low, high, best, ratio in result.per_bucket(name)
            )
        )
    for name, arm in arms.items():
        if name != ADAPTIVE:
            both = adaptive.trained().keys() & arm.trained().keys()
            ratio = _time_ratio(adaptive, arm)
            print(f"adaptive / {name}: {ratio:.3f} over the {len(both)} sequences both trained")
    if result.dp > 1:
        print(
            "weights after training, largest relative difference of a rank's parameter checksum from its TP "
            "rank's on DP rank 0 (0: the DP replicas agree): "
            + ", ".join(f"{name} {arm.replica_difference(result.tp):.1e}" for name, arm in arms.items())
        )
    print(" ".join(f"{k}={v:.3f}" for k, v in result.ratios().items()) + f" ({result.corpus})")


def _plan_counts(plans_per_step) -> str:
    """``"3x [plan]; 1x [other plan]"`` over the DP ranks' plans of each step, in order of first use."""
    counts: dict[str, int] = {}
    for plans in plans_per_step:
        for plan in plans:
            counts[plan] = counts.get(plan, 0) + 1
    return "; ".join(f"{n}x [{plan}]" for plan, n in counts.items())


def _print_steps(result: CorpusResult, corpus: Corpus) -> None:
    """How the documents became micro-batches and the micro-batches steps (nothing to say for the default)."""
    count = len(corpus.micro_batches)
    if result.pack_tokens is not None:
        totals = [sum(corpus.micro_batch_tokens(m)) for m in corpus.micro_batches]
        sizes = [len(m) for m in corpus.micro_batches]
        print(
            f"packed into {count} micro-batches of {min(totals)}..{max(totals)} tokens and {min(sizes)}..{max(sizes)} "
            f"documents (at most {result.pack_tokens} tokens each, a longer document alone); a sequence's "
            f"length is its micro-batch's total tokens"
        )
    if result.dp > 1:
        steps = count // result.dp
        print(
            f"DP={result.dp}: micro-batch i on DP rank i % {result.dp}; {steps} steps of {result.dp} micro-batches, "
            f"the last {count - steps * result.dp} micro-batch(es) dropped; a sequence below is one step (its "
            f"length: its longest micro-batch's tokens; its time: between barriers of all {result.tp * result.dp} "
            f"ranks; its peaks: of every rank)"
        )


def _model_error(sequences: list[SequenceResult]) -> str:
    """The range of (measured peak / the cost model's) - 1 over the micro-batches of ``sequences`` after
    the step that creates the optimizer's state."""
    errors = [
        measured / predicted - 1
        for s in sequences
        if not s.creates_optimizer_state
        for _, _, predicted, measured in s.peaks_vs_predicted()
    ]
    return f"{min(errors):+.1%}..{max(errors):+.1%}" if errors else "-"


def _print_predictions(adaptive: ArmResult) -> None:
    """How the planner's predicted peaks compare with the measured ones (the worst under-prediction)."""
    rows = [row for s in adaptive.sequences if s.peak_bytes for row in s.peaks_vs_predicted()]
    if not rows:
        return
    tokens, plan, predicted, measured = max(rows, key=lambda row: row[3] - row[2])
    print(
        f"adaptive: predicted vs measured peak: worst at {tokens} tokens [{plan}]: predicted "
        f"{predicted / MIB:.2f} MiB, measured {measured / MIB:.2f} MiB ({(measured - predicted) / predicted:+.1%})"
    )


def _print_table(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for row in [head, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))


def _summary_line(results: list[CorpusResult]) -> str:
    ratios = [r.ratios() for r in results]

    def worst(key: str, pick) -> float:
        values = [r[key] for r in ratios]
        return math.nan if any(math.isnan(v) for v in values) else pick(values)

    errors = [abs(e) for r in results for e in r.arms[ADAPTIVE].peak_errors()]
    return (
        f"adaptive_vs_best_static={worst('adaptive_vs_best_static', max):.3f} "
        f"adaptive_vs_megatron={worst('adaptive_vs_megatron', max):.3f} "
        f"max_len_ratio={worst('max_len_ratio', min):.3f} "
        f"adaptive_vs_best_per_bucket_max={worst('adaptive_vs_best_per_bucket_max', max):.3f} "
        f"step_mem_err_max={max(errors, default=math.nan) * 100:.2f} "
        f"learn_vs_adaptive={worst('learn_vs_adaptive', max):.3f} "
        f"learn_vs_best_per_bucket_max={worst('learn_vs_best_per_bucket_max', max):.3f}"
    )


if __name__ == "__main__":
    sys.exit(main())
