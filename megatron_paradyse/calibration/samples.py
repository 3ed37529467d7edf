"""Timing samples, each run by every rank of a group at once (a sample is the slowest rank's time, as in
a job whose ranks meet at every collective): GEMMs, attention blocks, elementwise work, collectives,
the ring's overlap with compute and the host link; a failure on one rank raises on all
(:class:`SampleFailedElsewhere`)."""

from __future__ import annotations

import contextlib
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_paradyse.attention import get_kernel
from megatron_paradyse.calibration.grid import Grid
from megatron_paradyse.core.comm import RingComm, all_gather_seq, all_to_all_seq_to_heads, reduce_scatter_seq
from megatron_paradyse.core.host_sync import wait_for_device
from megatron_paradyse.core.offload import ActivationOffload
from megatron_paradyse.strategies.terms import COLLECTIVE_KINDS

__all__ = [
    "Progress",
    "SampleFailedElsewhere",
    "attention_blocks",
    "gemm_shapes",
    "measure_samples",
    "median_time",
    "time_attention",
]


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


def median_time(fn: Callable[[], Any], repeats: int, device: torch.device, group=None) -> float:
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
    forward = median_time(lambda: F.linear(x, w), repeats, device, group)
    backward = median_time(lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True), repeats, device, group)
    return forward, backward


def _gemm_samples(grid: Grid, device, dtype, group, progress: Progress) -> list[dict]:
    samples = []
    for m, n, k in gemm_shapes(grid):
        fwd, bwd = _time_linear(m, n, k, grid.repeats, device, dtype, group)
        samples.append({"m": m, "n": n, "k": k, "forward_s": fwd, "backward_s": bwd})
        progress.step(f"gemm {m}x{n}x{k}")
    return samples


def gemm_shapes(grid: Grid) -> list[tuple[int, int, int]]:
    return [*((m, n, k) for m in grid.gemm_m for n, k in grid.gemm_nk), *grid.gemms]


def time_attention(kernel, heads: int, hn: int, sq: int, sk: int, causal: bool, repeats: int, device, dtype, group):
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
    forward = median_time(lambda: kernel.forward(q, k, v, causal, scale), repeats, device, group)
    backward = median_time(lambda: kernel.backward(dout, q, k, v, out, lse, causal, scale), repeats, device, group)
    return forward, backward


def attention_blocks(grid: Grid) -> list[tuple[int, int, int, int, bool]]:
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
    for heads, hn, sq, sk, causal in attention_blocks(grid):
        fwd, bwd = time_attention(kernel, heads, hn, sq, sk, causal, grid.repeats, device, dtype, group)
        samples.append(
            {"heads": heads, "hn": hn, "sq": sq, "sk": sk, "causal": causal} | {"forward_s": fwd, "backward_s": bwd}
        )
        progress.step(f"attention {sq}x{sk} {'causal' if causal else 'full'} hn={hn}")
    return samples


def _time_add(nbytes: int, repeats: int, device, dtype, group) -> float:
    with _all_or_none(group, device):
        a = torch.randn(nbytes // 4, device=device).to(dtype)
        b = torch.randn_like(a)
    return median_time(lambda: torch.add(a, b), repeats, device, group)


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
                per_kind[kind].append((numel * 4, median_time(fn, grid.repeats, device, group)))
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
        c, m, o = (median_time(fn, 1, device, group) for fn in (compute, hop, both))
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
        to_host = median_time(lambda x=x: ActivationOffload().store(x), grid.repeats, device, group)
        both = median_time(lambda x=x: _round_trip(x), grid.repeats, device, group)
        points.append((x.nbytes, max(to_host, both - to_host)))
        progress.step(f"host copies {x.nbytes} B")
    overlap = 0.0
    if device.type == "cuda":
        with _all_or_none(group, device):
            x = torch.randn(grid.comm_bytes[-1] // 4, device=device).to(dtype)
            a = torch.randn(2048, 2048, device=device, dtype=dtype)
        c = median_time(lambda: a @ a, grid.repeats, device, group)
        m = median_time(lambda: ActivationOffload().store(x), grid.repeats, device, group)
        o = median_time(lambda: (ActivationOffload().store(x), a @ a), grid.repeats, device, group)
        overlap = float(np.clip((c + m - o) / max(min(c, m), 1e-12), 0.0, 1.0))
    progress.step("host copy overlap")
    return {"points": points, "overlap": overlap}


def _round_trip(x: torch.Tensor) -> torch.Tensor:
    offload = ActivationOffload()
    return offload.restore(offload.store(x))


def measure_samples(group, grid: Grid, link_groups: dict[int, Any], device, dtype, show: bool) -> dict[str, Any]:
    """Every sample of ``grid``, each one run by all ranks of ``group`` at once (a collective over it; a
    sample is the slowest rank's time, so every rank returns the same), the collectives on each of
    ``link_groups`` (none: not measured), the ring overlap on the largest of them."""
    steps = (
        len(gemm_shapes(grid))
        + len(attention_blocks(grid))
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
