"""Measure one transformer layer under one option on the calling rank: what the cost models predict.

The layer is the unit the planner prices: ``x + attention(LN1(x))``, then ``+ mlp(LN2(.))``, on this
rank's ``[s/p, b, h]`` shard, run under a :class:`LayerOption` (recompute wraps the whole layer).
Its *time* is forward + backward (+ the recomputed forward), the slowest rank's, median over
repeats after warm-up. Its *memory*, from :class:`PeakMemory` above the layer's input, weights and
gradient buffers (the plan-independent static part):

- ``saved_bytes``: still allocated when the forward returns (kept for backward, output included);
- ``peak_bytes``: the high-water mark over forward and backward, the backward run as in a training step
  (the output gone, its gradient made inside the backward and freed once used);
- ``transient_bytes = peak_bytes - saved_bytes``.

A stage composes them in the order its layers run (:func:`cost.base.stage_layer_bytes`): each layer's
working set on top of the saved activations of the layers before it.
Used by the benchmark, by ``paradyse calibrate`` (its optional fitted correction) and by the tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from megatron_paradyse.attention import get_kernel
from megatron_paradyse.core.host_sync import wait_for_device
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.memory import (
    GradientRoot,
    PeakMemory,
    collective_buffers_freed_promptly,
    recurring_least,
)
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.mcore.bare_layer import make_layer_params, run_layer
from megatron_paradyse.mcore.linears import gather_buffer_scope, reserve_gather_buffer
from megatron_paradyse.strategies import (
    AttentionContext,
    MLPContext,
    ModelShape,
)

__all__ = ["LayerMeasurement", "measure_layer"]


@dataclasses.dataclass(frozen=True)
class LayerMeasurement:
    """One layer option on one micro-batch, as measured (see the module docstring)."""

    time_s: float
    saved_bytes: int
    peak_bytes: int

    @property
    def transient_bytes(self) -> int:
        return self.peak_bytes - self.saved_bytes


@gather_buffer_scope()  # Megatron's gather buffer, where this call made it, gone with the layer
def measure_layer(
    option: LayerOption,
    layout: SequenceLayout,
    shape: ModelShape,
    group: ProcessGroup,
    *,
    micro_batch_size: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    kernel: str = "auto",
    bias: bool = True,
    warmup: int = 1,
    repeats: int = 3,
    memory_runs: int = 6,
    seed: int = 0,
    metered: bool = False,
) -> LayerMeasurement:
    """Forward + backward of one layer on every rank of ``group`` (a collective: all ranks call it).

    Memory comes from at most ``memory_runs`` tracked runs (exact on CPU, the allocator's count on CUDA),
    the least figures once they recur (:func:`~megatron_paradyse.core.memory.recurring_least`). A finished
    send's or receive's buffers are released by gloo's worker thread, which needs the GIL for it: the runs
    switch threads every microsecond
    (:func:`~megatron_paradyse.core.memory.collective_buffers_freed_promptly`), or a buffer the code
    has dropped would outlive it until this thread next waits, by chance and load (the tracker waits
    for a collective's itself). Time
    comes from ``repeats`` untracked runs after ``warmup`` (``repeats=0``: memory only;
    ``memory_runs=0``: time only, memory 0): per run the slowest rank's, then the median; ``metered``: each
    timed run inside a :class:`PeakMemory` window, as a job that measures every micro-batch's peak runs it.
    """
    device = torch.device(device)
    rank, p = group.rank(), group.size()
    params = make_layer_params(shape, p, rank, group=group, bias=bias, dtype=dtype, device=device, seed=seed)
    actx = AttentionContext(
        group=group,
        layout=layout,
        shape=shape,
        kernel=get_kernel(kernel, device, dtype),
        softmax_scale=shape.kv_channels**-0.5,
    )
    mctx = MLPContext(group=group, shape=shape, activation=F.silu if shape.gated_mlp else F.gelu)
    gen = torch.Generator().manual_seed(seed + 7)
    size = (layout.local_len, micro_batch_size, shape.hidden_size)
    x_local = torch.randn(size, generator=gen).to(device, dtype).requires_grad_()
    dy_local = torch.randn(size, generator=gen).to(device, dtype)
    layout.indices(device)  # on the device before the layer runs, as the entry point does

    def step() -> None:
        run_layer(x_local, params, option, actx, mctx).backward(dy_local)
        x_local.grad = None

    for _ in range(warmup):
        step()
    if p > 1:  # held outside the layer, as a step's other layers leave it
        reserve_gather_buffer(layout.padded_len * micro_batch_size, shape.hidden_size, dtype, device)

    def memory_run() -> tuple[int, int]:
        with PeakMemory(device) as memory:
            y_local = run_layer(x_local, params, option, actx, mctx)
            time.sleep(0.001)  # the GIL for gloo's worker thread to release the last collective's buffers
            saved = memory.current_bytes()
            root = GradientRoot(y_local, dy_local)  # the output gone, its gradient made in backward
            del y_local
            root.backward()
            x_local.grad = None
        return saved, memory.peak_bytes

    saved, peak = 0, 0
    if memory_runs:
        with collective_buffers_freed_promptly():
            saved, peak = recurring_least(memory_run, most_runs=memory_runs, group=group)
    times = []
    for _ in range(repeats):
        dist.barrier(group)
        wait_for_device(device)
        start = time.perf_counter()
        with PeakMemory(device) if metered else contextlib.nullcontext():
            step()
        wait_for_device(device)
        times.append(time.perf_counter() - start)
    if not times:  # memory only
        return LayerMeasurement(float("nan"), saved, peak)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return LayerMeasurement(statistics.median(slowest.cpu().tolist()), saved, peak)
