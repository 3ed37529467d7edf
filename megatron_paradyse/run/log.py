"""What a training run logs per iteration: lengths, plans, predicted against measured cost, loss.

:class:`MicroBatchMeter` (made only where the config's ``log.measure`` or ``planner.learn_time`` asks)
measures each micro-batch's forward + backward on this rank: its forward from the start of its
``forward_step`` until the model has returned, and its backward from the gradient reaching the model's
output until it has left the first transformer layer (CUDA events on a GPU); under pipeline
parallelism a stage runs other micro-batches between the two. With ``log.measure``, also the peak
memory from the forward's start to the backward's end (:class:`~megatron_paradyse.core.memory.PeakMemory`:
the CUDA allocator's peak, or on the CPU the bytes held by tensors created in the window) plus the
stage's static bytes, the same quantity the planner predicts: only where micro-batches run one after
another (its allocator reset synchronises the device).

Records are plain dataclasses: :func:`format_rows` makes the table the entry point prints,
:func:`write_iteration` sends an iteration's figures to Megatron's TensorBoard and W&B writers,
:func:`append_jsonl` / :func:`read_jsonl` keep them for tools, :func:`write_plot` draws a run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from megatron_paradyse.core.memory import PeakMemory

__all__ = [
    "ALLOCATOR_GREW",
    "WARM_UP",
    "IterationLog",
    "Measurement",
    "MicroBatchLog",
    "MicroBatchMeter",
    "append_jsonl",
    "format_header",
    "format_rows",
    "iteration_scalars",
    "plan_switches",
    "plans_markdown",
    "read_jsonl",
    "switches_in",
    "write_iteration",
    "write_plot",
]

_MIB = 2**20
_GIB = 2**30
_PLAN_WIDTH = 40


@dataclasses.dataclass
class MicroBatchLog:
    """One micro-batch on the logging rank."""

    tokens: int
    """Real tokens (padding excluded)."""
    documents: int
    padded: int
    plan: str
    """The stage's plan, compact (``"3x tp_sp/tp_sp, 1x ring/zero3+rc"``)."""
    predicted_time_s: float
    predicted_peak_bytes: float
    cached: bool
    kept_previous: bool
    explored: bool = False
    """The planner ran a runner-up plan to measure it (``planner.explore_share``), not its choice."""
    one_off: str | None = None
    """A one-time cost its measured time holds, so that the time model does not learn from it
    (``planner.learn_time``): :data:`WARM_UP`, or :data:`ALLOCATOR_GREW`."""
    measured_time_s: float | None = None
    measured_peak_bytes: float | None = None
    loss: float | None = None
    """Mean loss per token of this micro-batch (the last pipeline stage only)."""

    def take(self, measured: Measurement) -> None:
        """Record what the meter measured of this micro-batch."""
        self.measured_time_s, self.measured_peak_bytes = measured.time_s, measured.peak_bytes
        if measured.allocator_grew and self.one_off is None:
            self.one_off = ALLOCATOR_GREW


WARM_UP = "warm-up"
"""The process's first measured training micro-batch: its time holds the start's one-time costs (kernels
loaded and tuned, communicators set up on first use, the allocator's first requests)."""
ALLOCATOR_GREW = "allocator grew"
"""On CUDA, the caching allocator reserved more device memory while the micro-batch ran. Mapping it costs
time the steady state does not pay: on an H200, 1.4 to 3.4 s for such micro-batches of 4K to 8K tokens,
0.15 to 0.36 s for the next ones (benchmarks/results/train-peaks_h200_20261126_c9d5eef.md); a run whose
lengths only grow pays it at each new high.
Each rank tells its own allocator's. The ranks of a tensor-parallel group hold alike shards of one
micro-batch and grow alike; one that did not grow while another did still waited for it in their
collectives, and its time, learned from, holds that wait (the agreement merges what every rank learned)."""


@dataclasses.dataclass
class IterationLog:
    iteration: int
    loss: float | None
    """Megatron's ``lm loss`` of the iteration (averaged over the global batch's tokens)."""
    micro_batches: list[MicroBatchLog]
    skipped: list[dict]
    """Micro-batches no plan fits (``on_infeasible = "skip"``): ``{"tokens", "stage", "reason"}``."""
    time_s: float
    """Wall time since the previous iteration ended (Megatron's step, optimizer and logging included)."""
    rank: int
    dp_rank: int


# -- measurement ----------------------------------------------------------------------------------
class MicroBatchMeter:
    """Forward + backward time, and peak memory, of each micro-batch.

    ``begin()`` in ``forward_step`` before the model runs; the hooks :meth:`attach` installs on the model
    mark the end of its forward, the gradient's arrival at its output and the gradient's departure from
    its transformer block's input (tensor hooks: no tensor of the model's is replaced); ``collect()`` at
    the end of the iteration returns each micro-batch's :class:`Measurement`, in the order they began. A
    micro-batch's time is its forward plus its backward, whatever ran between the two (the loss's
    reduction; under pipeline parallelism, other micro-batches' forwards and backwards on the stage). A
    forward-only micro-batch (``begin(forward_only=True)``, evaluation) is its forward, loss included
    (Megatron's ``GPTModel`` computes the per-token loss).

    ``memory=True`` also measures the peak from a micro-batch's start to its backward's end: only for
    schedules that run each micro-batch's forward and backward back to back (no pipeline parallelism),
    since the window holds whatever else runs in it (so not with model chunks either). ``memory=False``
    measures time only (peaks None): no device synchronisation inside a step on CUDA (events, read at
    ``collect()``), and on the CPU no operator-watching dispatch mode, whose own cost would be measured
    with the work.
    """

    def __init__(self, device: torch.device, static_bytes: float, *, memory: bool = True) -> None:
        self.device = device
        self.static_bytes = static_bytes
        self.memory = memory
        self._open: _Window | None = None
        self._done: list[_Window] = []
        self._hooked: set[int] = set()
        self._hooks: list = []

    def attach(self, model: torch.nn.Module) -> None:
        """Mark the forward's end and the backward's start at ``model``'s output (a Megatron ``GPTModel``,
        or the stage of one), and the backward's end at its transformer block's input; once per model."""
        if id(model) in self._hooked:
            return
        self._hooked.add(id(model))

        def mark_block_input(module, args, kwargs):
            window = self._open
            # a later pipeline stage's block reads the tensor received from the stage before
            hidden = kwargs.get("hidden_states")
            hidden = getattr(module, "input_tensor", None) if hidden is None else hidden
            if window is not None and torch.is_grad_enabled() and hidden is not None and hidden.requires_grad:
                hidden.register_hook(window.gradient_left)

        def mark_output(module, args, output):
            window = self._open
            if window is None:
                return
            window.forward_returned()
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(window.gradient_arrived)

        self._hooks += [
            model.decoder.register_forward_pre_hook(mark_block_input, with_kwargs=True),
            model.register_forward_hook(mark_output),
        ]

    def detach(self) -> None:
        """Remove the hooks :meth:`attach` installed: a meter made for a while leaves the model as it was."""
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._hooked = [], set()

    def begin(self, *, forward_only: bool = False, chunk: int = 0) -> None:
        """A micro-batch's forward starts on model chunk ``chunk`` (Megatron's interleaved schedule runs
        each micro-batch through every chunk of the stage, the step's micro-batches in the same order)."""
        self._close()
        self._open = _Window(self.device, forward_only=forward_only, memory=self.memory, chunk=chunk)

    def collect(self) -> list[Measurement]:
        """Each micro-batch begun since the last call, in order: the ``k``-th begun on each chunk is one
        micro-batch, its time the sum of its chunks' (None where a chunk's is missing)."""
        self._close()
        done, self._done = self._done, []
        by_chunk: dict[int, list[Measurement]] = {}
        for window in done:
            by_chunk.setdefault(window.chunk, []).append(window.result(self.static_bytes))
        chunks = list(by_chunk.values())
        measurements = []
        for k in range(max(map(len, chunks), default=0)):
            parts = [chunk[k] for chunk in chunks if k < len(chunk)]
            times = [part.time_s for part in parts]
            complete = len(parts) == len(chunks) and None not in times
            peak = parts[0].peak_bytes if len(chunks) == 1 else None  # memory is measured with one chunk only
            grew = any(part.allocator_grew for part in parts)
            measurements.append(Measurement(math.fsum(times) if complete else None, peak, grew))
        return measurements

    def _close(self) -> None:
        if self._open is not None:
            if self._open.memory is not None:
                self._open.memory.__exit__(None, None, None)
            self._done.append(self._open)
            self._open = None


class Measurement(NamedTuple):
    """One micro-batch as :class:`MicroBatchMeter` measured it (None: its backward never came)."""

    time_s: float | None
    peak_bytes: float | None
    allocator_grew: bool = False
    """On CUDA: the caching allocator reserved more device memory while it ran (:data:`ALLOCATOR_GREW`)."""


class _Window:
    """One micro-batch's measurement: opened in its forward step, ended by its backward (or, forward only,
    by its forward's return). Times are CUDA events, or ``time.perf_counter()`` on the CPU."""

    def __init__(self, device: torch.device, *, forward_only: bool, memory: bool, chunk: int) -> None:
        self.memory = PeakMemory(device).__enter__() if memory else None
        self.forward_only = forward_only
        self.chunk = chunk
        self.device = device
        self.cuda = device.type == "cuda"
        self.finished = False
        self.peak: int | None = None
        # the allocator's own count, read on the host: no synchronisation
        self.reserved = torch.cuda.memory_reserved(device) if self.cuda else 0
        self.allocator_grew = False
        self.start = self._now()
        self.forward_end = self.backward_start = self.end = None

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def forward_returned(self) -> None:
        if self.forward_end is None:
            self.forward_end = self._now()
            if self.forward_only:
                self.finish()

    def gradient_arrived(self, grad: torch.Tensor) -> None:
        if self.backward_start is None:
            self.backward_start = self._now()

    def gradient_left(self, grad: torch.Tensor) -> None:
        """The gradient has passed every layer of the block: the backward's end."""
        self.finish()

    def finish(self) -> None:
        self.finished = True
        if self.memory is not None:
            self.peak = self.memory.peak_until_now()
        self.end = self._now()
        if self.cuda:
            self.allocator_grew = torch.cuda.memory_reserved(self.device) > self.reserved

    def result(self, static_bytes: float) -> Measurement:
        if not self.finished or (not self.forward_only and self.backward_start is None):
            return Measurement(None, None)  # no backward seen (the step ran forward only, unplanned for it)
        if self.forward_only:
            seconds = self._seconds(self.start, self.end)
        else:
            seconds = self._seconds(self.start, self.forward_end) + self._seconds(self.backward_start, self.end)
        return Measurement(seconds, None if self.peak is None else static_bytes + self.peak, self.allocator_grew)

    def _seconds(self, begin, end) -> float:
        if not self.cuda:
            return end - begin
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


# -- the table ------------------------------------------------------------------------------------
def format_header() -> str:
    return (
        f"{'iter':>5} {'loss':>8} | {'mb':>2} {'tokens':>6}  {'plan':<{_PLAN_WIDTH}} "
        f"{'pred s':>7} {'meas s':>7} {'pred MiB':>8} {'meas MiB':>8}"
    )


def format_rows(record: IterationLog) -> list[str]:
    """One line per micro-batch (the iteration and loss on the first), then one per skipped one."""
    rows = []
    for i, mb in enumerate(record.micro_batches):
        head = f"{record.iteration:>5} {_number(record.loss, '.4f'):>8}" if i == 0 else " " * 14
        mark = " (explored)" * mb.explored + (f" ({mb.one_off})" if mb.one_off else "")
        room = _PLAN_WIDTH - len(mark)
        plan = (mb.plan if len(mb.plan) <= room else mb.plan[: room - 3] + "...") + mark
        rows.append(
            f"{head} | {i:>2} {mb.tokens:>6}  {plan:<{_PLAN_WIDTH}} {mb.predicted_time_s:>7.3f} "
            f"{_number(mb.measured_time_s, '7.3f'):>7} {mb.predicted_peak_bytes / _MIB:>8.1f} "
            f"{_number(None if mb.measured_peak_bytes is None else mb.measured_peak_bytes / _MIB, '8.1f'):>8}"
        )
    if not record.micro_batches:
        rows.append(f"{record.iteration:>5} {_number(record.loss, '.4f'):>8} |")
    for skip in record.skipped:
        rows.append(f"{'':14} |  - {skip['tokens']:>6}  skipped: no plan fits stage {skip['stage']}")
    return rows


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def plan_switches(records: Iterable[IterationLog]) -> tuple[int, dict[str, int]]:
    """(how often the plan changed from one micro-batch to the next, micro-batches per plan)."""
    switches, counts, previous = 0, {}, None
    for record in records:
        changed, previous = switches_in(record, previous)
        switches += changed
        for mb in record.micro_batches:
            counts[mb.plan] = counts.get(mb.plan, 0) + 1
    return switches, counts


def switches_in(record: IterationLog, previous: str | None) -> tuple[int, str | None]:
    """(how often the plan changed from one micro-batch of ``record`` to the next, its first compared
    with ``previous``, the plan of the micro-batch before it; the plan its last micro-batch ran)."""
    switches = 0
    for mb in record.micro_batches:
        switches += previous is not None and mb.plan != previous
        previous = mb.plan
    return switches, previous


# -- TensorBoard and W&B ---------------------------------------------------------------------------
def iteration_scalars(record: IterationLog, switches: int) -> dict[str, float]:
    """One iteration's figures on this rank, by TensorBoard/W&B tag. The micro-batches run one after
    another, so their forward + backward times add up (``time-*-s``) and the iteration's peak is the
    largest of theirs (``peak-*-gib``, static memory included, as the planner predicts it). Measured
    figures are left out where a micro-batch has none (pipeline parallelism; peaks where only time is
    measured, ``planner.learn_time`` without ``log.measure``)."""
    mbs = record.micro_batches
    scalars = {
        "paradyse/micro-batches": len(mbs),
        "paradyse/tokens": sum(mb.tokens for mb in mbs),
        "paradyse/plan-switches": switches,
        "paradyse/skipped-micro-batches": len(record.skipped),
    }
    if mbs:
        scalars["paradyse/time-predicted-s"] = sum(mb.predicted_time_s for mb in mbs)
        scalars["paradyse/peak-predicted-gib"] = max(mb.predicted_peak_bytes for mb in mbs) / _GIB
    if mbs and all(mb.measured_time_s is not None for mb in mbs):
        scalars["paradyse/time-measured-s"] = sum(mb.measured_time_s for mb in mbs)
    if mbs and all(mb.measured_peak_bytes is not None for mb in mbs):
        scalars["paradyse/peak-measured-gib"] = max(mb.measured_peak_bytes for mb in mbs) / _GIB
    return scalars


def plans_markdown(record: IterationLog) -> str:
    """The iteration's micro-batches and their plans as a Markdown table (TensorBoard renders it)."""
    lines = [
        "| mb | tokens | documents | plan | predicted s | measured s | predicted MiB | measured MiB |",
        "|---:|---:|---:|:---|---:|---:|---:|---:|",
    ]
    for i, mb in enumerate(record.micro_batches):
        measured_mib = None if mb.measured_peak_bytes is None else mb.measured_peak_bytes / _MIB
        lines.append(
            f"| {i} | {mb.tokens} | {mb.documents} | {mb.plan} | {mb.predicted_time_s:.4g} | "
            f"{_number(mb.measured_time_s, '.4g')} | {mb.predicted_peak_bytes / _MIB:.1f} | "
            f"{_number(measured_mib, '.1f')} |"
        )
    lines += [
        f"| - | {s['tokens']} | - | skipped: no plan fits stage {s['stage']} | - | - | - | - |" for s in record.skipped
    ]
    return "\n".join(lines)


def write_iteration(record: IterationLog, switches: int, *, tensorboard=None, wandb=None) -> None:
    """Send one iteration's figures (:func:`iteration_scalars`) and plans (:func:`plans_markdown`,
    tag ``paradyse/plans``) to Megatron's writers: ``tensorboard`` a ``SummaryWriter``, ``wandb`` the
    ``wandb`` module (``get_tensorboard_writer()``, ``get_wandb_writer()``); None: not configured."""
    scalars = iteration_scalars(record, switches)
    text = plans_markdown(record)
    if tensorboard is not None:
        for tag, value in scalars.items():
            tensorboard.add_scalar(tag, value, record.iteration)
        tensorboard.add_text("paradyse/plans", text, record.iteration)
    if wandb is not None:
        wandb.log({**scalars, "paradyse/plans": text}, record.iteration)


# -- files ----------------------------------------------------------------------------------------
def append_jsonl(record: IterationLog, path: str | os.PathLike) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(dataclasses.asdict(record)) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[IterationLog]:
    """The records of a JSONL file; a last line still being written is left out."""
    records = []
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break
            data = json.loads(line)
            data["micro_batches"] = [MicroBatchLog(**mb) for mb in data["micro_batches"]]
            records.append(IterationLog(**data))
    return records


def write_plot(
    records: Sequence[IterationLog], path: str | os.PathLike, *, budget_bytes: float | None = None, title: str = ""
) -> None:
    """A PNG of the run, per iteration: tokens per micro-batch coloured by plan; predicted and measured
    forward + backward time; predicted and measured peak against the budget; the loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = list(dict.fromkeys(mb.plan for r in records for mb in r.micro_batches))
    colours = plt.get_cmap("tab10")
    fig, (ax_len, ax_time, ax_mem, ax_loss) = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    for k, plan in enumerate(plans):
        points = [(r.iteration, mb.tokens) for r in records for mb in r.micro_batches if mb.plan == plan]
        ax_len.scatter(*zip(*points), s=18, color=colours(k % 10), label=plan)
    skipped = [(r.iteration, s["tokens"]) for r in records for s in r.skipped]
    if skipped:
        ax_len.scatter(*zip(*skipped), s=24, marker="x", color="0.4", label="skipped (no plan fits)")
    ax_len.set_ylabel("tokens per micro-batch")
    ax_len.set_yscale("log")
    ax_len.legend(title="plan of the stage's layers", fontsize=8, title_fontsize=8, loc="upper left")
    runs = [(r.iteration, mb) for r in records for mb in r.micro_batches]
    _predicted_and_measured(ax_time, runs, "time_s", 1.0)
    ax_time.set_ylabel("forward + backward (s)")
    _predicted_and_measured(ax_mem, runs, "peak_bytes", 1 / _MIB)
    if budget_bytes is not None:
        ax_mem.axhline(budget_bytes / _MIB, color="0.3", linestyle="--", linewidth=1, label="budget")
    ax_mem.set_ylabel("peak per rank (MiB)")
    ax_mem.legend(fontsize=8, loc="lower right")
    losses = [(r.iteration, r.loss) for r in records if r.loss is not None]
    if losses:
        ax_loss.plot(*zip(*losses), marker=".")
    ax_loss.set_ylabel("loss")
    ax_loss.set_xlabel("iteration")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _predicted_and_measured(ax, runs: list[tuple[int, MicroBatchLog]], quantity: str, scale: float) -> None:
    predicted = [(i, getattr(mb, f"predicted_{quantity}") * scale) for i, mb in runs]
    measured = [(i, value * scale) for i, mb in runs if (value := getattr(mb, f"measured_{quantity}")) is not None]
    if predicted:
        ax.scatter(*zip(*predicted), s=12, label="predicted")
    if measured:
        ax.scatter(*zip(*measured), s=12, marker="^", label="measured")
    ax.legend(fontsize=8, loc="upper left")
