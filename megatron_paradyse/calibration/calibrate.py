"""``paradyse calibrate``: measure this machine's kernels and links, fit them, return a profile.

Everything runs on ``p`` real ranks at once (gloo on CPU, NCCL on CUDA), because that is how a
layer runs: on a CPU shared by the ranks, a kernel timed alone is ~p/cores times faster than inside
the job. :func:`calibrate` starts the ranks; :func:`calibrate_on_group` runs in ranks that exist (a
job's tensor-parallel group at start-up, :func:`startup_profile`; or one process standing for rank 0 of
a fake group on one GPU, its collectives taken from another profile). Measured:

- GEMMs (``F.linear`` forward and backward) over a grid of shapes, fitted as
  ``c0 + c1 * FLOPs + c2 * bytes``;
- the attention kernel, causal and full, square and rectangular blocks, forward and backward: a
  per-call overhead and the time per (visible pair x head dim) at each block length;
- memory-bound elementwise work (bytes/s and per-op overhead);
- every collective the strategies use, for each requested group size, over message sizes, fitted as
  ``latency + bytes * per_byte``;
- how much of a ring hop hides behind a kernel running at the same time;
- optionally (``fit_correction``) a few whole layers, to fit the correction of DESIGN §4.

Given the model (``shape``, ``longest``: its layer and longest micro-batch), the grid also measures
that model's own work (:func:`model_grid`): every GEMM the strategies' cost terms run for its layer
at ``p`` ranks, at token counts up to the longest micro-batch, and its attention at its head dim up
to that length. The generic grid alone stops at 4096x3072x1024 GEMMs and 8K-token blocks: on an H200
its GEMMs are all launch overhead, the fit found no time per FLOP, and a 64K-token micro-batch of
four Llama-3-8B layers was predicted at 11.2 s against 2.7 s measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_paradyse.attention import get_kernel
from megatron_paradyse.core.comm import RingComm, all_gather_seq, all_to_all_seq_to_heads, reduce_scatter_seq
from megatron_paradyse.core.host_sync import wait_for_device
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.memory import PeakMemory
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.core.offload import ActivationOffload
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.analytic import AnalyticCostModel
from megatron_paradyse.cost.fitting import fit_nonnegative
from megatron_paradyse.cost.profile import ProfileError, fingerprint, load_profile, save_profile
from megatron_paradyse.cost.terms import sublayer_terms
from megatron_paradyse.strategies import ModelShape, strategy_names
from megatron_paradyse.strategies.dims import Dims
from megatron_paradyse.strategies.terms import COLLECTIVE_KINDS, AttentionCall

__all__ = [
    "correction_layers",
    "GRIDS",
    "Grid",
    "REFERENCE_SHAPE",
    "SAMPLE_BYTES",
    "SAMPLE_FLOPS",
    "calibrate",
    "calibrate_on_group",
    "cached_quick_profile",
    "fit_profile",
    "model_grid",
    "startup_profile",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Grid:
    gemm_m: tuple[int, ...]
    gemm_nk: tuple[tuple[int, int], ...]
    attention_blocks: tuple[tuple[int, int], ...]
    """(length, heads at hn=32): fewer heads for long blocks keep each sample's time bounded; the rate
    per (pair x head dim) does not depend on the head count, it does on the length (cache reuse)."""
    attention_hn: tuple[int, ...]
    attention_rect_max: int
    """Longest block also measured as a ring rectangle (``length x 2 length``)."""
    comm_bytes: tuple[int, ...]
    repeats: int
    correction_lengths: tuple[int, ...]
    gemms: tuple[tuple[int, int, int], ...] = ()
    """``(m, n, k)`` measured besides the ``gemm_m x gemm_nk`` product: a model's own (:func:`model_grid`)."""
    attention_calls: tuple[tuple[int, int, int, int, bool], ...] = ()
    """``(heads, hn, sq, sk, causal)`` blocks measured besides the generic ones: a model's own."""
    elementwise_bytes: tuple[int, ...] = (4 << 10, 256 << 10, 4 << 20, 16 << 20)
    """Sizes of the elementwise samples (fp32 bytes of each operand; a model adds its activations')."""


GRIDS = {
    "quick": Grid(
        gemm_m=(64, 512, 2048),
        gemm_nk=((256, 256), (768, 256), (1024, 256), (256, 1024)),
        attention_blocks=((128, 8), (512, 8), (2048, 2), (8192, 1)),
        attention_hn=(32,),
        attention_rect_max=2048,
        comm_bytes=(4 << 10, 256 << 10, 2 << 20, 8 << 20),
        repeats=3,
        correction_lengths=(512, 4096),
    ),
    "full": Grid(
        gemm_m=(32, 256, 1024, 4096),
        gemm_nk=((256, 256), (768, 256), (1024, 256), (256, 1024), (1024, 1024), (3072, 1024)),
        attention_blocks=((64, 8), (256, 8), (1024, 4), (2048, 2), (4096, 1), (8192, 1)),
        attention_hn=(32, 128),
        attention_rect_max=2048,
        comm_bytes=(1 << 10, 16 << 10, 128 << 10, 1 << 20, 4 << 20, 16 << 20),
        repeats=3,
        correction_lengths=(512, 4096),
    ),
}

SAMPLE_FLOPS = {"cpu": 2e10, "cuda": 4e12}
"""The most forward FLOPs of one sample of a model's own work: a few milliseconds on a GPU, a fraction of
a second on a CPU core. Longer GEMMs and attention blocks are priced at the rate of the longest one
measured of their shape (the rates are flat beyond the measured sizes)."""
SAMPLE_BYTES = {"cpu": 1 << 28, "cuda": 1 << 31}
"""The largest operand of an elementwise sample of a model's activations (fp32 bytes): a millisecond on
a GPU, a tenth of a second on a CPU core."""


def model_grid(grid: Grid, shape: ModelShape, p: int, longest: int, device: str) -> Grid:
    """``grid`` with the work of ``shape``'s layer at ``p`` ranks added, for micro-batches up to ``longest``
    tokens: the ``(n, k)`` of every GEMM the cost terms of every strategy run (so nothing priced is
    extrapolated from other shapes), at token counts from 256 up to ``longest`` in steps of 4x, and
    causal and full attention blocks at the model's head dim up to ``longest``; samples
    over :data:`SAMPLE_FLOPS` are left out (a GEMM shape keeps its smallest token count). On a GPU the
    attention blocks run as many heads as the model's kernel calls do (fewer where a sample would pass
    the cap): on an H200 one head of 8K tokens left most of the GPU idle, and its rate priced a Llama-3-8B
    layer's attention at 2.7x its time (a CPU's rate per head does not depend on the count). Elementwise
    samples of one activation at those token counts, up to :data:`SAMPLE_BYTES` (on an H200 the generic
    ones, 16 MB at most, are launch overhead: their fit priced no byte). The correction
    is fitted on the model's own layers, at the grid's correction lengths, none over ``longest``, and on
    a GPU at 4x the longest of them too: on an H200 the reference layer's are launch overhead, and a
    correction fitted on them halved the model's compute (predicted 0.83 s for 2.72 s measured). A CPU
    computes at the grid's lengths already; a layer 4x longer there took nine tenths of a start-up
    calibration (117 of 131 s for a p=2 job's twelve layers at 16K tokens)."""
    if longest < 1 or p < 1:
        raise ValueError(f"model_grid needs longest >= 1 and p >= 1, got longest={longest}, p={p}")
    cap = SAMPLE_FLOPS[device]
    s = 2 * p * 64  # any length: the GEMMs' (n, k) do not depend on it
    dims = Dims(shape, p, s, 1, 2)
    layout = SequenceLayout.build(s, p, causal=True)
    nk = sorted(
        {
            (g.n, g.k)
            for kind in ("attention", "mlp")
            for name in strategy_names(kind)
            for terms in [sublayer_terms(kind, name, dims, layout)]
            for g in (*terms.gemms, *terms.recompute_gemms)
        }
    )
    tokens = sorted({*(256 * 4**i for i in range(32) if 256 * 4**i < longest), longest})
    gemms = []
    for n, k in nk:
        fitting = [m for m in tokens if 2 * m * n * k <= cap] or tokens[:1]
        gemms += [(m, n, k) for m in fitting]
    hn = shape.kv_channels
    most_heads = 1 if device == "cpu" else _most_heads_per_call(shape, dims, layout, strategy_names("attention"))
    calls = []
    for length in sorted({*(128 * 4**i for i in range(32) if 128 * 4**i < longest), longest}):
        for causal in (True, False):
            heads = min(most_heads, int(cap // AttentionCall(1, 1, length, length, hn, causal).flops))
            if heads >= 1:
                calls.append((heads, hn, length, length, causal))
    launch_bound = () if device == "cpu" else (4 * max(grid.correction_lengths),)
    corrections = sorted({min(n, longest) for n in (*grid.correction_lengths, *launch_bound)})
    activations = [m * shape.hidden_size * 4 for m in tokens if m * shape.hidden_size * 4 <= SAMPLE_BYTES[device]]
    return dataclasses.replace(
        grid,
        gemms=tuple(gemms),
        attention_calls=tuple(calls),
        correction_lengths=tuple(corrections),
        elementwise_bytes=tuple(sorted({*grid.elementwise_bytes, *activations})),
    )


def _most_heads_per_call(shape: ModelShape, dims: Dims, layout: SequenceLayout, strategies) -> int:
    """The most heads one of the model's attention kernel calls runs under any of ``strategies``."""
    most = 1
    for name in strategies:
        terms = sublayer_terms("attention", name, dims, layout)
        ring_calls = (call for ring in terms.rings for hop in ring.hops for call in hop)
        most = max(most, *(call.heads for call in (*terms.attention, *ring_calls)))
    return most


def model_key(shape: ModelShape) -> str:
    """A short name for the layer a profile measured (cache file names)."""
    text = json.dumps(dataclasses.asdict(shape), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


REFERENCE_SHAPE = ModelShape(
    hidden_size=256, num_attention_heads=8, num_query_groups=8, kv_channels=32, ffn_hidden_size=1024
)
"""The layer the correction is fitted on (the benchmark's layer)."""


def correction_layers() -> tuple[LayerOption, ...]:
    """Options the correction is fitted on (no recompute): every pair of the library, lean's included (its
    many streamed hops must weigh in the per-synchronisation cost); the benchmark's held-out MAPE excludes
    these at the grid's ``correction_lengths``."""
    return tuple(LayerOption(a, m) for a in strategy_names("attention") for m in strategy_names("mlp"))


MIN_SCALE = 0.5
"""Smallest correction scale of the compute and communication terms."""
_SAMPLE_S = 0.02  # each timing sample lasts at least this long
# The ring overlap is a difference of three times over the shorter one: one estimate read 0.0 in some
# calibrations of the same quiet machine and 1.0 in others; the median of 9, each from the three measured
# side by side, read 0.0 to 0.25.
_OVERLAP_SAMPLES = 9


class Progress:
    """A one-line progress bar on stderr: ``[#####.....] 12/40 what``."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30):
        self.total, self.done, self.enabled, self.width = max(total, 1), 0, enabled, width

    def step(self, what: str) -> None:
        self.done += 1
        if self.enabled:
            filled = self.width * self.done // self.total
            bar = "#" * filled + "." * (self.width - filled)
            sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {what:<40.40s}")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


class SampleFailedElsewhere(RuntimeError):
    """Another rank of the calibrating group could not run a sample (its own error says why)."""


@contextlib.contextmanager
def _all_or_none(group, device: torch.device):
    """The block's work succeeds on every rank of ``group`` or raises on every rank: its own error where
    it failed, :class:`SampleFailedElsewhere` naming those ranks on the others. One rank out of memory for
    a sample's operands would otherwise leave the rest waiting in the sample's next collective until the
    group's timeout."""
    error = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised below, once the other ranks have heard of it
        error = e
    group = group or dist.group.WORLD
    failed = torch.zeros(group.size(), device=device)
    failed[dist.get_rank(group)] = error is not None
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    ranks = [dist.get_global_rank(group, r) for r in failed.nonzero().flatten().tolist()]
    if ranks:
        raise SampleFailedElsewhere(f"rank {', '.join(map(str, ranks))} could not run a calibration sample")


def _median_time(fn: Callable[[], Any], repeats: int, device: torch.device, group=None) -> float:
    """Median seconds per call of ``fn``, every rank of ``group`` running it at once.

    Each sample times enough back-to-back calls to last ~20 ms (the same count on every rank), so the
    ranks really overlap: a single short call would slip between the others' and look p/cores times
    faster than it runs inside the job. A sample is the slowest rank's time, as in a job, where the
    ranks meet at every collective: on an oversubscribed CPU one rank's own time depends on its share
    of the cores (three calibrations read one rate from 33 to 58 ps), all ranks' wall time does not.
    """
    with _all_or_none(group, device):  # the first call's outputs are allocated on every rank, or no rank goes on
        wait_for_device(device)
        start = time.perf_counter()
        fn()
        wait_for_device(device)
    once = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(once, op=dist.ReduceOp.MAX, group=group)
    calls = max(1, min(1000, int(_SAMPLE_S / max(once.item(), 1e-7))))
    times = []
    for _ in range(repeats):
        dist.barrier(group)
        wait_for_device(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        wait_for_device(device)
        times.append((time.perf_counter() - start) / calls)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(slowest.tolist())


def _time_linear(m: int, n: int, k: int, repeats: int, device, dtype, group) -> tuple[float, float]:
    """(forward, backward) seconds of ``F.linear(x [m, k], w [n, k])``."""
    with _all_or_none(group, device):
        x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(n, k, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn(m, n, device=device, dtype=dtype)
        y = F.linear(x, w)
    forward = _median_time(lambda: F.linear(x, w), repeats, device, group)
    backward = _median_time(lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True), repeats, device, group)
    return forward, backward


def _gemm_samples(grid: Grid, device, dtype, group, progress: Progress) -> list[dict]:
    samples = []
    for m, n, k in _gemm_shapes(grid):
        fwd, bwd = _time_linear(m, n, k, grid.repeats, device, dtype, group)
        samples.append({"m": m, "n": n, "k": k, "forward_s": fwd, "backward_s": bwd})
        progress.step(f"gemm {m}x{n}x{k}")
    return samples


def _gemm_shapes(grid: Grid) -> list[tuple[int, int, int]]:
    return [*((m, n, k) for m in grid.gemm_m for n, k in grid.gemm_nk), *grid.gemms]


def _time_attention(kernel, heads: int, hn: int, sq: int, sk: int, causal: bool, repeats: int, device, dtype, group):
    """(forward, backward) seconds of one kernel call on a ``[1, heads, sq | sk, hn]`` block, laid out
    sequence-major as the strategies hand it over (on CUDA with ``attention.kernels.CUDNN_LENGTH_BUCKETS``
    set, cuDNN's graphs by length bucket then apply, as in the job)."""
    scale = hn**-0.5
    with _all_or_none(group, device):
        q = torch.randn(1, sq, heads, hn, device=device, dtype=dtype).transpose(1, 2)
        k = torch.randn(1, sk, heads, hn, device=device, dtype=dtype).transpose(1, 2)
        v = torch.randn_like(k)
        out, lse = kernel.forward(q, k, v, causal, scale)
        dout = torch.randn_like(out)
    forward = _median_time(lambda: kernel.forward(q, k, v, causal, scale), repeats, device, group)
    backward = _median_time(lambda: kernel.backward(dout, q, k, v, out, lse, causal, scale), repeats, device, group)
    return forward, backward


def _attention_blocks(grid: Grid) -> list[tuple[int, int, int, int, bool]]:
    """(heads, hn, sq, sk, causal) of every measured block: causal and full squares, ring rectangles, at
    each of the grid's head dims; then the model's own blocks."""
    blocks = []
    for hn in grid.attention_hn:
        for length, heads in grid.attention_blocks:
            heads = max(1, heads * 32 // hn)  # the grid's head counts are for hn=32: the same work per block
            blocks += [(heads, hn, length, length, True), (heads, hn, length, length, False)]
            if length <= grid.attention_rect_max:
                blocks.append((heads, hn, length, 2 * length, False))
    return [*blocks, *grid.attention_calls]


def _attention_samples(grid: Grid, device, dtype, group, progress: Progress) -> list[dict]:
    kernel = get_kernel("auto", device, dtype)
    samples = []
    for heads, hn, sq, sk, causal in _attention_blocks(grid):
        fwd, bwd = _time_attention(kernel, heads, hn, sq, sk, causal, grid.repeats, device, dtype, group)
        samples.append(
            {"heads": heads, "hn": hn, "sq": sq, "sk": sk, "causal": causal} | {"forward_s": fwd, "backward_s": bwd}
        )
        progress.step(f"attention {sq}x{sk} {'causal' if causal else 'full'} hn={hn}")
    return samples


def _time_add(nbytes: int, repeats: int, device, dtype, group) -> float:
    with _all_or_none(group, device):
        a = torch.randn(nbytes // 4, device=device).to(dtype)
        b = torch.randn_like(a)
    return _median_time(lambda: torch.add(a, b), repeats, device, group)


def _elementwise_samples(grid: Grid, device, dtype, group, progress: Progress) -> list[dict]:
    samples = []
    element_size = torch.empty((), dtype=dtype).element_size()
    for nbytes in grid.elementwise_bytes:
        seconds = _time_add(nbytes, grid.repeats, device, dtype, group)
        samples.append({"bytes": 3 * nbytes // 4 * element_size, "seconds": seconds})  # read 2, write 1
        progress.step(f"elementwise {nbytes >> 10} KiB")
    return samples


def _collective_ops(group, numel: int, device) -> dict[str, Callable[[], None]]:
    """The collectives exactly as the strategies call them (``comm``, ``streaming``), on ``numel``
    fp32 elements in the unit their terms count: all-gather output, reduce-scatter input, all-to-all
    send buffer, broadcast/reduce message (the root rotating, as ``lean``'s shard owners do)."""
    p = group.size()
    full = torch.randn(numel, device=device)
    shard = torch.randn(numel // p, device=device)
    seq_local = full.view(numel // p, 1, p)  # [s/p, b, p*w]: w = 1 column per rank
    message = torch.zeros(numel, device=device)  # reduced in place: zeros stay finite
    ring = RingComm(group)
    roots = itertools.cycle([dist.get_global_rank(group, r) for r in range(p)])  # the same on every rank

    def send_recv() -> None:
        ring.send_recv(full)
        ring.wait()

    return {
        "all_gather": lambda: all_gather_seq(shard, group),
        "reduce_scatter": lambda: reduce_scatter_seq(full, group),
        "all_to_all": lambda: all_to_all_seq_to_heads(seq_local, group),
        "send_recv": send_recv,
        "broadcast": lambda: dist.broadcast(message, src=next(roots), group=group),
        "reduce": lambda: dist.reduce(message, dst=next(roots), group=group),
    }


def _collective_samples(grid: Grid, link_groups: dict[int, Any], device, progress: Progress) -> dict[str, dict]:
    """Every collective on each of ``link_groups`` (group size -> the group, or a non-member's placeholder)."""
    out: dict[str, dict] = {}
    for p, group in sorted(link_groups.items()):
        if not _is_member(group):
            for _ in range(len(COLLECTIVE_KINDS) * len(grid.comm_bytes)):
                progress.step("")
            continue
        per_kind: dict[str, list] = {kind: [] for kind in COLLECTIVE_KINDS}
        for nbytes in grid.comm_bytes:
            numel = max(nbytes // 4 // p * p, p)
            with _all_or_none(group, device):
                ops = _collective_ops(group, numel, device)
            for kind, fn in ops.items():
                per_kind[kind].append((numel * 4, _median_time(fn, grid.repeats, device, group)))
                progress.step(f"{kind} p={p} {nbytes >> 10} KiB")
        out[str(p)] = per_kind
    return out


def _is_member(group) -> bool:
    return dist.get_rank(group) >= 0


def _overlap_sample(grid: Grid, group, device, dtype, progress: Progress) -> float:
    """Fraction of the shorter of (a ring hop, a kernel call) hidden when both run together, on ``group``
    (None, or a group this rank is not in: nothing measured)."""
    if group is None or not _is_member(group):
        progress.step("ring overlap")
        return 0.0
    kernel = get_kernel("auto", device, dtype)
    ring = RingComm(group)
    length, heads, hn = 1024, 4, grid.attention_hn[0]
    with _all_or_none(group, device):
        q = torch.randn(1, heads, length, hn, device=device, dtype=dtype)
        kv = torch.randn(2, 1, heads, length, hn, device=device, dtype=dtype)

    def compute():
        kernel.forward(q, kv[0], kv[1], False, 0.1)

    def hop():
        ring.send_recv(kv)
        ring.wait()

    def both():
        ring.send_recv(kv)
        compute()
        ring.wait()

    estimates = []
    for _ in range(_OVERLAP_SAMPLES):  # the three side by side: a change in the machine's load hits all alike
        c, m, o = (_median_time(fn, 1, device, group) for fn in (compute, hop, both))
        estimates.append(float(np.clip((c + m - o) / max(min(c, m), 1e-12), 0.0, 1.0)))
    progress.step("ring overlap")
    return statistics.median(estimates)


def _host_link_sample(grid: Grid, device, dtype, group, progress: Progress) -> dict[str, Any]:
    """Offload's copies (:class:`~megatron_paradyse.core.offload.ActivationOffload`), to the host and
    back, at the collectives' sizes: ``(bytes, seconds)`` of the slower direction; and the fraction of
    the shorter of a copy and a GEMM that running both at once hides (on CPU the copy runs in line: 0)."""
    points = []
    for nbytes in grid.comm_bytes:
        with _all_or_none(group, device):
            x = torch.randn(nbytes // 4, device=device).to(dtype)
        to_host = _median_time(lambda x=x: ActivationOffload().store(x), grid.repeats, device, group)
        both = _median_time(lambda x=x: _round_trip(x), grid.repeats, device, group)
        points.append((x.nbytes, max(to_host, both - to_host)))
        progress.step(f"host copies {x.nbytes} B")
    overlap = 0.0
    if device.type == "cuda":
        with _all_or_none(group, device):
            x = torch.randn(grid.comm_bytes[-1] // 4, device=device).to(dtype)
            a = torch.randn(2048, 2048, device=device, dtype=dtype)
        c = _median_time(lambda: a @ a, grid.repeats, device, group)
        m = _median_time(lambda: ActivationOffload().store(x), grid.repeats, device, group)
        o = _median_time(lambda: (ActivationOffload().store(x), a @ a), grid.repeats, device, group)
        overlap = float(np.clip((c + m - o) / max(min(c, m), 1e-12), 0.0, 1.0))
    progress.step("host copy overlap")
    return {"points": points, "overlap": overlap}


def _round_trip(x: torch.Tensor) -> torch.Tensor:
    offload = ActivationOffload()
    return offload.restore(offload.store(x))


def _rank_device(rank: int, device_type: str) -> torch.device:
    """This rank's device: its own GPU (set as current, as NCCL wants), or the CPU."""
    if device_type != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    return device


def _measure_samples(group, grid: Grid, link_groups: dict[int, Any], device, dtype, show: bool) -> dict[str, Any]:
    """Every sample of ``grid``, each one run by all ranks of ``group`` at once (a collective over it; a
    sample is the slowest rank's time, so every rank returns the same), the collectives on each of
    ``link_groups`` (none: not measured), the ring overlap on the largest of them."""
    steps = (
        len(_gemm_shapes(grid))
        + len(_attention_blocks(grid))
        + len(grid.elementwise_bytes)
        + len(link_groups) * len(COLLECTIVE_KINDS) * len(grid.comm_bytes)
        + 1
        + len(grid.comm_bytes)
        + 1
    )
    progress = Progress(steps, enabled=show)
    return {
        "gemm": _gemm_samples(grid, device, dtype, group, progress),
        "attention": _attention_samples(grid, device, dtype, group, progress),
        "elementwise": _elementwise_samples(grid, device, dtype, group, progress),
        "collectives": _collective_samples(grid, link_groups, device, progress),
        "ring_overlap": _overlap_sample(
            grid, link_groups[max(link_groups)] if link_groups else None, device, dtype, progress
        ),
        "host_link": _host_link_sample(grid, device, dtype, group, progress),
    }


def _measure_on_rank(rank: int, world: int, grid: Grid, p_values, device_type: str, dtype_name: str, show: bool):
    device = _rank_device(rank, device_type)
    link_groups = {p: dist.new_group(list(range(p))) for p in p_values}  # every rank makes every group
    samples = _measure_samples(
        dist.group.WORLD, grid, link_groups, device, getattr(torch, dtype_name), show and rank == 0
    )
    return samples if rank == 0 else None


def fit_profile(samples: dict[str, Any], element_size: int) -> dict[str, Any]:
    """The fitted parameters of a profile from raw samples."""
    gemm = samples["gemm"]
    gemm_features = np.array(
        [
            [1.0, 2.0 * g["m"] * g["n"] * g["k"], element_size * (g["m"] * g["k"] + g["n"] * g["k"] + g["m"] * g["n"])]
            for g in gemm
        ]
    )
    fitted: dict[str, Any] = {
        "gemm": {
            d: {
                "coef": fit_nonnegative(gemm_features, [g[f"{d}_s"] for g in gemm]).tolist(),
                "by_shape": _gemm_rates(gemm, f"{d}_s"),
            }
            for d in ("forward", "backward")
        },
        "attention": {"forward": {}, "backward": {}},
    }
    for causal, mask in ((True, "causal"), (False, "full")):
        rows = [a for a in samples["attention"] if a["causal"] == causal]
        for d in ("forward", "backward"):
            fitted["attention"][d][mask] = _fit_attention(rows, f"{d}_s")
    ew = samples["elementwise"]
    c0, c1 = fit_nonnegative(np.array([[1.0, e["bytes"]] for e in ew]), [e["seconds"] for e in ew])
    fitted["elementwise"] = {"per_op_s": float(c0), "per_byte_s": float(c1)}
    fitted["collectives"] = {}
    for p, kinds in samples["collectives"].items():
        fitted["collectives"][p] = {}
        for kind, points in kinds.items():
            latency, per_byte = fit_nonnegative(np.array([[1.0, b] for b, _ in points]), [s for _, s in points])
            fitted["collectives"][p][kind] = {"latency_s": float(latency), "per_byte_s": float(per_byte)}
    fitted["ring_overlap"] = samples["ring_overlap"]
    if "host_link" in samples:  # profiles calibrated before offload have none
        link = samples["host_link"]
        sizes, seconds = zip(*link["points"])
        latency, per_byte = fit_nonnegative(np.array([[1.0, b] for b in sizes]), list(seconds))
        fitted["host_link"] = {"latency_s": float(latency), "per_byte_s": float(per_byte), "overlap": link["overlap"]}
    return fitted


def _gemm_rates(samples: list[dict], key: str) -> dict[str, dict[str, list[float]]]:
    """Per measured ``(n, k)`` (key ``"<n>x<k>"``), the seconds per FLOP at each measured ``m``. On a GPU
    a GEMM's efficiency changes with its shape, and not linearly: on an H200 the linear fit over a
    Llama-3-8B layer's own GEMMs priced them at 820 TFLOP/s, where they ran at 645 to 801; a shape that
    was measured is interpolated (:meth:`~megatron_paradyse.cost.pricing.TermPrices.gemm`), the fit
    prices the others."""
    rates: dict[str, dict[int, list[float]]] = {}
    for g in samples:
        flops = 2 * g["m"] * g["n"] * g["k"]
        rates.setdefault(f"{g['n']}x{g['k']}", {}).setdefault(g["m"], []).append(g[key] / flops)
    return {
        shape: {"m": sorted(by_m), "per_flop_s": [float(np.mean(by_m[m])) for m in sorted(by_m)]}
        for shape, by_m in sorted(rates.items())
    }


def _fit_attention(rows: list[dict], key: str) -> dict[str, Any]:
    """Per-call overhead, and per head dim the time per (pair x head dim) at each measured block
    length: the rate changes with the length (how far K/V outgrow the caches) and the head dim (how
    much work each loaded row carries), so it is interpolated, not fitted."""
    calls = [AttentionCall(1, a["heads"], a["sq"], a["sk"], a["hn"], a["causal"]) for a in rows]
    units = np.array([c.flops / 4 for c in calls])
    seconds = np.array([a[key] for a in rows])
    per_call = fit_nonnegative(np.stack([np.ones_like(units), units], axis=1), seconds)[0]
    rates: dict[int, dict[float, list[float]]] = {}
    for call, unit, t in zip(calls, units, seconds):
        rates.setdefault(call.hn, {}).setdefault(call.length, []).append(max(t - per_call, 0.1 * t) / unit)
    return {
        "per_call_s": float(per_call),
        "by_head_dim": {
            str(hn): {
                "lengths": sorted(by_length),
                "per_unit_s": [float(np.mean(by_length[g])) for g in sorted(by_length)],
            }
            for hn, by_length in sorted(rates.items())
        },
    }


def calibrate(
    p_values: Sequence[int] = (4,),
    *,
    device: str = "cpu",
    grid: str = "quick",
    dtype: torch.dtype = torch.float32,
    fit_correction: bool = False,
    show_progress: bool = True,
    timeout_s: float = 1800.0,
    shape: ModelShape | None = None,
    longest: int | None = None,
) -> dict[str, Any]:
    """Measure and fit on ``max(p_values)`` ranks started for it; returns the profile (see
    :mod:`cost.profile`). With ``shape`` and ``longest``, the grid has that model's own work at
    ``max(p_values)`` ranks too (:func:`model_grid`). A job's ranks calibrate on themselves with
    :func:`calibrate_on_group`."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    p_values = sorted({int(p) for p in p_values})
    if not p_values or p_values[0] < 1:
        raise ValueError(f"group sizes must be >= 1, got {p_values}")
    world = max(p_values)
    measured = _grid(grid, shape, world, longest, device)
    if device == "cuda" and world > torch.cuda.device_count():
        raise ValueError(
            f"calibrating p={world} on CUDA needs {world} GPUs (one per rank), this machine has "
            f"{torch.cuda.device_count()}"
        )
    backend = "nccl" if device == "cuda" else "gloo"
    dtype_name = str(dtype).removeprefix("torch.")
    samples = run_on_ranks(
        _measure_on_rank,
        world,
        args=(measured, [p for p in p_values if p > 1], device, dtype_name, show_progress),
        timeout_s=timeout_s,
        backend=backend,
    )[0]
    profile = _profile_of(samples, grid, device, dtype, world, shape, longest)
    if fit_correction:
        layers = REFERENCE_SHAPE if shape is None else shape
        times = run_on_ranks(
            _correction_layers_on_rank,
            world,
            args=(layers, measured.correction_lengths, device, dtype_name),
            timeout_s=timeout_s,
            backend=backend,
        )[0]
        profile["correction"] = _fit_correction(profile, times, world, dtype, layers)
    return profile


def calibrate_on_group(
    group,
    *,
    device: torch.device,
    dtype: torch.dtype,
    grid: str = "quick",
    fit_correction: bool = True,
    shape: ModelShape | None = None,
    longest: int | None = None,
    links: dict[str, Any] | None = None,
    show_progress: bool = False,
    metered: bool = False,
) -> dict[str, Any]:
    """:func:`calibrate` in the processes of ``group``, which all call it (a collective over it); returns
    its first rank's profile on every rank.

    It starts no process: a job's tensor-parallel group measures itself at start-up, on the GPUs and the
    links it trains on, beside what it already holds. A process alone in a fake group of ``p``
    (:func:`~megatron_paradyse.mcore.trace.fake_world`) measures one rank's compute at ``p`` ranks' shapes
    on one GPU. A fake group's collectives move nothing in no time, so it needs ``links``: a profile with
    collectives for ``group.size()`` (calibrated on the real cluster, or a published node's,
    :func:`~megatron_paradyse.cost.hardware.hardware_profile`), whose collectives and ring overlap the
    profile takes instead of measuring them; its correction is then fitted on the compute terms alone.
    ``metered``: the correction's layers timed under the memory meter, as a job with ``log.measure`` runs
    its layers (where the meter slows them, :meth:`~megatron_paradyse.core.memory.PeakMemory.slows_work`,
    the correction takes its cost in).
    """
    p = group.size()
    if links is not None and p > 1 and str(p) not in links.get("collectives", {}):
        raise ValueError(
            f"the links profile has no collectives for p={p} (it has p in "
            f"{sorted(links.get('collectives', {}), key=int)}); calibrate them on the cluster with `paradyse "
            f"calibrate --p {p}`"
        )
    measured = _grid(grid, shape, p, longest, device.type)
    link_groups = {} if links is not None or p == 1 else {p: group}
    first = dist.get_rank(group) == 0
    # the job's RNG untouched; gradients on even inside a recomputed forward (a drop-in layer's first call)
    rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
    with rng, torch.enable_grad():
        samples = _measure_samples(group, measured, link_groups, device, dtype, show_progress and first)
        profile = _profile_of(samples, grid, device.type, dtype, p, shape, longest)
        if links is not None:
            profile["collectives"] = {str(p): links["collectives"][str(p)]} if p > 1 else {}
            profile["ring_overlap"] = links["ring_overlap"]
            profile["links"] = {"fingerprint": links["fingerprint"], "grid": links["grid"]}
        if fit_correction:
            layers = REFERENCE_SHAPE if shape is None else shape
            times = _correction_layers(group, layers, measured.correction_lengths, device, dtype, metered=metered)
            profile["correction"] = _fit_correction(
                profile, times, p, dtype, layers, comm_measured=links is None, metered=metered
            )
    if device.type == "cuda":  # the job's allocator starts from its own blocks, not the samples'
        torch.cuda.empty_cache()
    message = [profile]
    dist.broadcast_object_list(message, group_src=0, group=group)
    return message[0]


def _grid(name: str, shape: ModelShape | None, p: int, longest: int | None, device: str) -> Grid:
    if name not in GRIDS:
        raise ValueError(f"unknown calibration grid {name!r}; known: {', '.join(GRIDS)}")
    if (shape is None) != (longest is None):
        raise ValueError("a model's own work is measured with both its shape and its longest micro-batch, or neither")
    return GRIDS[name] if shape is None else model_grid(GRIDS[name], shape, p, longest, device)


def _profile_of(
    samples: dict[str, Any],
    grid: str,
    device: str,
    dtype: torch.dtype,
    concurrency: int,
    shape: ModelShape | None,
    longest: int | None,
) -> dict[str, Any]:
    """The profile of ``samples`` measured by ``concurrency`` ranks at once, without its correction."""
    profile = {
        "grid": grid,
        "fingerprint": fingerprint(device),
        "dtype": str(dtype).removeprefix("torch."),
        "concurrency": concurrency,
        "attention": {"kernel": get_kernel("auto", torch.device(device), dtype).name},
        # the CUDA caching allocator rounds and fragments; the CPU tracker counts tensor bytes exactly,
        # but gloo's worker thread frees finished collectives' buffers when it gets the GIL, and the
        # model's small tensors outside the terms (RoPE's temporaries, norms' gradients) add up
        "allocator_slack": 0.05,
        "correction": None,
        "model": None if shape is None else {"shape": dataclasses.asdict(shape), "p": concurrency, "longest": longest},
        "samples": samples,
    }
    fitted = fit_profile(samples, torch.empty((), dtype=dtype).element_size())
    profile["attention"].update(fitted.pop("attention"))
    profile.update(fitted)
    return profile


def _correction_layers(
    group, shape: ModelShape, lengths, device: torch.device, dtype: torch.dtype, *, metered: bool = False
):
    """``(option, tokens, seconds)`` of each correction layer at each length, on ``group`` (a collective)."""
    from megatron_paradyse.calibration.measure import measure_layer  # megatron-core: only to fit the correction

    p = group.size()
    out = []
    for s in lengths:
        layout = SequenceLayout.build(s, p, causal=True)
        for option in correction_layers():
            m = measure_layer(option, layout, shape, group, dtype=dtype, device=device, memory_runs=0, metered=metered)
            out.append((str(option), s, m.time_s))
    return out


def _correction_layers_on_rank(rank: int, world: int, shape: ModelShape, lengths, device_type: str, dtype_name: str):
    device = _rank_device(rank, device_type)
    return _correction_layers(dist.group.WORLD, shape, lengths, device, getattr(torch, dtype_name))


def _fit_correction(
    profile, measured, p: int, dtype, shape: ModelShape, *, comm_measured: bool = True, metered: bool = False
) -> dict:
    """Fit ``time = k_compute * compute + k_comm * comm + per_sync_s * syncs + per_layer_s`` on the
    ``measured`` layers of ``shape`` at ``p`` ranks (``syncs``: collectives and ring hops, each a point
    where ranks wait for each other: on an oversubscribed CPU a rank that arrives early waits for the
    scheduler to run the rest). Where the layers' collectives took no time (``comm_measured=False``:
    a fake group), on the compute terms alone: ``k_comm`` 1, no time per synchronisation. ``metered``:
    the layers were timed under the memory meter (recorded, so that a profile says what its times hold)."""
    model = AnalyticCostModel(profile, shape, p, dtype=dtype, use_correction=False)
    features, target = [], []
    for option, s, seconds in measured:
        b = model.time_breakdown(LayerOption.parse(option), SequenceLayout.build(s, p, causal=True), 1)
        features.append([b.compute_s, b.comm_s, b.syncs, 1.0])
        target.append(seconds)
    features, target = np.array(features), np.array(target)
    # The scales may stretch the calibrated terms, not delete them: a noisy fit on few layers must not
    # leave a model in which longer sequences cost nothing more.
    if comm_measured:
        k_compute, k_comm, per_sync, per_layer = fit_nonnegative(features, target, floor=[MIN_SCALE, MIN_SCALE, 0, 0])
    else:  # the layers' collectives took no time: nothing to fit their terms on
        k_compute, per_layer = fit_nonnegative(features[:, [0, 3]], target, floor=[MIN_SCALE, 0])
        k_comm, per_sync = 1.0, 0.0
    return {
        "compute": float(k_compute),
        "comm": float(k_comm),
        "per_sync_s": float(per_sync),
        "per_layer_s": float(per_layer),
        "fitted_on": [f"{option}@{s}" for option, s, _ in measured],
        "metered": metered,
    }


def _cache_path(
    cache_dir, p: int, device: str, dtype: torch.dtype, shape: ModelShape | None, *, metered: bool = False
) -> Path:
    name = str(dtype).removeprefix("torch.")
    model = "" if shape is None else f"-model{model_key(shape)}"
    meter = "-metered" if metered else ""
    return Path(cache_dir) / f"cost-profile-quick-corrected-{device}-p{p}-{name}{model}{meter}.json"


def _cached(path: Path, p: int, longest: int | None) -> dict[str, Any] | None:
    """The profile an earlier run saved at ``path``, if it serves a longest micro-batch of ``longest``
    tokens (it measured as many or more), else None. A profile calibrated before offload, or before its
    GEMM shapes had their own rates (and a GPU's attention samples the model's heads), is made again: a
    cache is this module's, and what it measures better should not wait for someone to delete it."""
    try:
        profile = load_profile(path, p=p, host_link=True)
    except ProfileError:
        return None
    if "by_shape" not in profile["gemm"]["forward"]:
        return None
    if longest is None or profile.get("model") and profile["model"]["longest"] >= longest:
        print(f"paradyse: no cost.profile: using the quick profile calibrated before, {path}", flush=True)
        return profile
    return None


def cached_quick_profile(
    cache_dir: str | os.PathLike,
    p: int,
    *,
    device: str,
    dtype: torch.dtype,
    shape: ModelShape | None = None,
    longest: int | None = None,
) -> dict[str, Any]:
    """The quick profile with its correction fitted on measured layers, for ``p`` ranks on ``device`` in
    ``dtype`` (with ``shape`` and ``longest``: measuring that model's own work too, :func:`model_grid`):
    the one an earlier run saved in ``cache_dir`` (for the same model, up to ``longest`` tokens or more),
    else calibrated now on ``p`` ranks started for it (a minute or two on a CPU) and saved there. For a
    process outside any group (the benchmarks); a job's ranks use :func:`startup_profile`."""
    path = _cache_path(cache_dir, p, device, dtype, shape)
    profile = _cached(path, p, longest)
    if profile is not None:
        return profile
    print(f"paradyse: no cost.profile: calibrating a quick profile for p={p} into {path} ...", flush=True)
    start = time.perf_counter()
    profile = calibrate(
        [p],
        device=device,
        grid="quick",
        dtype=dtype,
        fit_correction=True,
        show_progress=False,
        shape=shape,
        longest=longest,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, path)
    print(f"paradyse: calibrated in {time.perf_counter() - start:.0f} s", flush=True)
    return profile


def startup_profile(
    cache_dir: str | os.PathLike,
    measure_group,
    share_group,
    *,
    device: torch.device,
    dtype: torch.dtype,
    shape: ModelShape,
    longest: int,
    metered: bool = False,
) -> dict[str, Any]:
    """A job without ``cost.profile``: the quick profile with its correction fitted on the model's own
    layers, the same on every rank of ``share_group`` (a collective over it, made of whole
    ``measure_group`` s: the job's tensor-parallel groups). ``metered``: the job measures every
    micro-batch's peak (``log.measure``); where that slows its layers (the CPU's meter), the correction is
    fitted on layers timed under the same meter, so that the times predicted are the job's, and the profile
    is cached apart from an unmetered job's.

    The first rank of ``share_group`` reads the one an earlier run saved in ``cache_dir`` (this layer at
    this group size, up to ``longest`` tokens or more). Else each ``measure_group`` calibrates on itself
    at once (:func:`calibrate_on_group`: the job's own processes, GPUs and links; no process started),
    and the first rank saves its group's profile there and sends it to all. A failure on any rank
    raises on every rank."""
    p = measure_group.size()
    metered = metered and PeakMemory.slows_work(device)
    path = _cache_path(cache_dir, p, device.type, dtype, shape, metered=metered)
    first = dist.get_rank(share_group) == 0
    message: list = [_cached(path, p, longest) if first else None]
    dist.broadcast_object_list(message, group_src=0, group=share_group)
    if message[0] is not None:
        return message[0]
    if first:
        print(
            f"paradyse: no cost.profile: calibrating a quick profile for p={p} on the job's ranks into {path} ...",
            flush=True,
        )
    start = time.perf_counter()
    profile, error = None, None
    try:
        profile = calibrate_on_group(
            measure_group, device=device, dtype=dtype, shape=shape, longest=longest, metered=metered
        )
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, not wait in the next collective
        error = f"rank {dist.get_rank()}: {e}"
    errors: list = [None] * share_group.size()
    dist.all_gather_object(errors, error, group=share_group)
    failed = [e for e in errors if e]
    message = [ProfileError(f"could not calibrate a cost profile ({'; '.join(failed)})") if failed else profile]
    if first and not failed:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_profile(profile, path)
            print(f"paradyse: calibrated in {time.perf_counter() - start:.0f} s", flush=True)
        except OSError as e:
            message[0] = ProfileError(f"could not save the calibrated cost profile to {path} ({e})")
    dist.broadcast_object_list(message, group_src=0, group=share_group)
    if isinstance(message[0], Exception):
        raise ProfileError(f"{message[0]}; make one with `paradyse calibrate --p {p}` and name it in cost.profile")
    return message[0]
