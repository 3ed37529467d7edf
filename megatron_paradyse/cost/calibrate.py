"""``paradyse calibrate``: measure this machine's kernels and links, fit them, return a profile.

Everything runs on ``p`` real ranks at once (gloo on CPU, NCCL on CUDA), because that is how a
layer runs: on a CPU shared by the ranks, a kernel timed alone is ~p/cores times faster than inside
the job. Measured:

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
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.core.offload import ActivationOffload
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.fitting import fit_nonnegative
from megatron_paradyse.cost.profile import fingerprint
from megatron_paradyse.cost.terms import COLLECTIVE_KINDS, AttentionCall, Dims, sublayer_terms, supported_options
from megatron_paradyse.strategies import ModelShape

__all__ = [
    "CORRECTION_LAYERS",
    "GRIDS",
    "Grid",
    "REFERENCE_SHAPE",
    "SAMPLE_BYTES",
    "SAMPLE_FLOPS",
    "calibrate",
    "fit_profile",
    "model_grid",
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
a second on a CPU core. Longer GEMMs are priced by the fit (linear in FLOPs and bytes), longer attention
blocks at the rate of the longest one measured (the rates are flat beyond the measured lengths)."""
SAMPLE_BYTES = {"cpu": 1 << 28, "cuda": 1 << 31}
"""The largest operand of an elementwise sample of a model's activations (fp32 bytes): a millisecond on
a GPU, a tenth of a second on a CPU core."""


def model_grid(grid: Grid, shape: ModelShape, p: int, longest: int, device: str) -> Grid:
    """``grid`` with the work of ``shape``'s layer at ``p`` ranks added, for micro-batches up to ``longest``
    tokens: the ``(n, k)`` of every GEMM the cost terms of every strategy run (so nothing priced is
    extrapolated from other shapes), at token counts from 256 up to ``longest`` in steps of 4x, and
    causal and full attention blocks at the model's head dim up to ``longest``, one head each; samples
    over :data:`SAMPLE_FLOPS` are left out (a GEMM shape keeps its smallest token count); elementwise
    samples of one activation at those token counts, up to :data:`SAMPLE_BYTES` (on an H200 the generic
    ones, 16 MB at most, are launch overhead: their fit priced no byte). The correction
    is fitted on the model's own layers, at the grid's correction lengths and 4x the longest of them,
    none over ``longest``: on an H200 the reference layer's are launch overhead, and a correction fitted
    on them halved the model's compute (predicted 0.83 s for 2.72 s measured)."""
    if longest < 1 or p < 1:
        raise ValueError(f"model_grid needs longest >= 1 and p >= 1, got longest={longest}, p={p}")
    cap = SAMPLE_FLOPS[device]
    s = 2 * p * 64  # any length: the GEMMs' (n, k) do not depend on it
    dims = Dims(shape, p, s, 1, 2)
    layout = SequenceLayout.build(s, p, causal=True)
    attention, mlp = supported_options()
    nk = sorted(
        {
            (g.n, g.k)
            for kind, names in (("attention", attention), ("mlp", mlp))
            for name in names
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
    calls = []
    for length in sorted({*(128 * 4**i for i in range(32) if 128 * 4**i < longest), longest}):
        for causal in (True, False):
            if AttentionCall(1, 1, length, length, hn, causal).flops <= cap:
                calls.append((1, hn, length, length, causal))
    corrections = sorted({min(n, longest) for n in (*grid.correction_lengths, 4 * max(grid.correction_lengths))})
    activations = [m * shape.hidden_size * 4 for m in tokens if m * shape.hidden_size * 4 <= SAMPLE_BYTES[device]]
    return dataclasses.replace(
        grid,
        gemms=tuple(gemms),
        attention_calls=tuple(calls),
        correction_lengths=tuple(corrections),
        elementwise_bytes=tuple(sorted({*grid.elementwise_bytes, *activations})),
    )


def model_key(shape: ModelShape) -> str:
    """A short name for the layer a profile measured (cache file names)."""
    text = json.dumps(dataclasses.asdict(shape), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


REFERENCE_SHAPE = ModelShape(
    hidden_size=256, num_attention_heads=8, num_query_groups=8, kv_channels=32, ffn_hidden_size=1024
)
"""The layer the correction is fitted on (the benchmark's layer)."""
# every pair, lean included: its many streamed hops must weigh in the per-synchronisation cost
CORRECTION_LAYERS = tuple(
    LayerOption(a, m) for a in ("tp_sp", "ulysses", "ring", "lean") for m in ("tp_sp", "zero3", "lean")
)
"""Options the correction is fitted on (no recompute); the benchmark's held-out MAPE excludes these at
the grid's ``correction_lengths``."""

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


def _median_time(fn: Callable[[], Any], repeats: int, device: torch.device, group=None) -> float:
    """Median seconds per call of ``fn``, every rank of ``group`` running it at once.

    Each sample times enough back-to-back calls to last ~20 ms (the same count on every rank), so the
    ranks really overlap: a single short call would slip between the others' and look p/cores times
    faster than it runs inside the job. A sample is the slowest rank's time, as in a job, where the
    ranks meet at every collective: on an oversubscribed CPU one rank's own time depends on its share
    of the cores (three calibrations read one rate from 33 to 58 ps), all ranks' wall time does not.
    """
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    once = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(once, op=dist.ReduceOp.MAX, group=group)
    calls = max(1, min(1000, int(_SAMPLE_S / max(once.item(), 1e-7))))
    times = []
    for _ in range(repeats):
        dist.barrier(group)
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        times.append((time.perf_counter() - start) / calls)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(slowest.tolist())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_linear(m: int, n: int, k: int, repeats: int, device, dtype) -> tuple[float, float]:
    """(forward, backward) seconds of ``F.linear(x [m, k], w [n, k])``."""
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(n, k, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=dtype)
    y = F.linear(x, w)
    forward = _median_time(lambda: F.linear(x, w), repeats, device)
    backward = _median_time(lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True), repeats, device)
    return forward, backward


def _gemm_samples(grid: Grid, device, dtype, progress: Progress) -> list[dict]:
    samples = []
    for m, n, k in _gemm_shapes(grid):
        fwd, bwd = _time_linear(m, n, k, grid.repeats, device, dtype)
        samples.append({"m": m, "n": n, "k": k, "forward_s": fwd, "backward_s": bwd})
        progress.step(f"gemm {m}x{n}x{k}")
    return samples


def _gemm_shapes(grid: Grid) -> list[tuple[int, int, int]]:
    return [*((m, n, k) for m in grid.gemm_m for n, k in grid.gemm_nk), *grid.gemms]


def _time_attention(kernel, heads: int, hn: int, sq: int, sk: int, causal: bool, repeats: int, device, dtype):
    """(forward, backward) seconds of one kernel call on a ``[1, heads, sq | sk, hn]`` block."""
    q = torch.randn(1, heads, sq, hn, device=device, dtype=dtype)
    k = torch.randn(1, heads, sk, hn, device=device, dtype=dtype)
    v = torch.randn_like(k)
    scale = hn**-0.5
    out, lse = kernel.forward(q, k, v, causal, scale)
    dout = torch.randn_like(out)
    forward = _median_time(lambda: kernel.forward(q, k, v, causal, scale), repeats, device)
    backward = _median_time(lambda: kernel.backward(dout, q, k, v, out, lse, causal, scale), repeats, device)
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


def _attention_samples(grid: Grid, device, dtype, progress: Progress) -> list[dict]:
    kernel = get_kernel("auto", device, dtype)
    samples = []
    for heads, hn, sq, sk, causal in _attention_blocks(grid):
        fwd, bwd = _time_attention(kernel, heads, hn, sq, sk, causal, grid.repeats, device, dtype)
        samples.append(
            {"heads": heads, "hn": hn, "sq": sq, "sk": sk, "causal": causal} | {"forward_s": fwd, "backward_s": bwd}
        )
        progress.step(f"attention {sq}x{sk} {'causal' if causal else 'full'} hn={hn}")
    return samples


def _time_add(nbytes: int, repeats: int, device, dtype) -> float:
    a = torch.randn(nbytes // 4, device=device).to(dtype)
    b = torch.randn_like(a)
    return _median_time(lambda: torch.add(a, b), repeats, device)


def _elementwise_samples(grid: Grid, device, dtype, progress: Progress) -> list[dict]:
    samples = []
    element_size = torch.empty((), dtype=dtype).element_size()
    for nbytes in grid.elementwise_bytes:
        seconds = _time_add(nbytes, grid.repeats, device, dtype)
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


def _collective_samples(grid: Grid, p_values: Sequence[int], device, progress: Progress) -> dict[str, dict]:
    rank = dist.get_rank()
    out: dict[str, dict] = {}
    for p in p_values:
        group = dist.new_group(list(range(p)))
        if rank >= p:
            for _ in range(len(COLLECTIVE_KINDS) * len(grid.comm_bytes)):
                progress.step("")
            continue
        per_kind: dict[str, list] = {kind: [] for kind in COLLECTIVE_KINDS}
        for nbytes in grid.comm_bytes:
            numel = max(nbytes // 4 // p * p, p)
            for kind, fn in _collective_ops(group, numel, device).items():
                per_kind[kind].append((numel * 4, _median_time(fn, grid.repeats, device, group)))
                progress.step(f"{kind} p={p} {nbytes >> 10} KiB")
        out[str(p)] = per_kind
    return out


def _overlap_sample(grid: Grid, p: int, device, dtype, progress: Progress) -> float:
    """Fraction of the shorter of (a ring hop, a kernel call) hidden when both run together."""
    if p == 1:
        progress.step("ring overlap")
        return 0.0
    group = dist.new_group(list(range(p)))
    if dist.get_rank() >= p:
        progress.step("ring overlap")
        return 0.0
    kernel = get_kernel("auto", device, dtype)
    ring = RingComm(group)
    length, heads, hn = 1024, 4, grid.attention_hn[0]
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


def _host_link_sample(grid: Grid, device, dtype, progress: Progress) -> dict[str, Any]:
    """Offload's copies (:class:`~megatron_paradyse.core.offload.ActivationOffload`), to the host and
    back, at the collectives' sizes: ``(bytes, seconds)`` of the slower direction; and the fraction of
    the shorter of a copy and a GEMM that running both at once hides (on CPU the copy runs in line: 0)."""
    points = []
    for nbytes in grid.comm_bytes:
        x = torch.randn(nbytes // 4, device=device).to(dtype)
        to_host = _median_time(lambda x=x: ActivationOffload().store(x), grid.repeats, device)
        both = _median_time(lambda x=x: _round_trip(x), grid.repeats, device)
        points.append((x.nbytes, max(to_host, both - to_host)))
        progress.step(f"host copies {x.nbytes} B")
    overlap = 0.0
    if device.type == "cuda":
        x = torch.randn(grid.comm_bytes[-1] // 4, device=device).to(dtype)
        a = torch.randn(2048, 2048, device=device, dtype=dtype)
        c = _median_time(lambda: a @ a, grid.repeats, device)
        m = _median_time(lambda: ActivationOffload().store(x), grid.repeats, device)
        o = _median_time(lambda: (ActivationOffload().store(x), a @ a), grid.repeats, device)
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


def _measure_on_rank(rank: int, world: int, grid: Grid, p_values, device_type: str, dtype_name: str, show: bool):
    device = _rank_device(rank, device_type)
    dtype = getattr(torch, dtype_name)
    steps = (
        len(_gemm_shapes(grid))
        + len(_attention_blocks(grid))
        + len(grid.elementwise_bytes)
        + len(p_values) * len(COLLECTIVE_KINDS) * len(grid.comm_bytes)
        + 1
        + len(grid.comm_bytes)
        + 1
    )
    progress = Progress(steps, enabled=show and rank == 0)
    samples = {
        "gemm": _gemm_samples(grid, device, dtype, progress),
        "attention": _attention_samples(grid, device, dtype, progress),
        "elementwise": _elementwise_samples(grid, device, dtype, progress),
        "collectives": _collective_samples(grid, p_values, device, progress),
        "ring_overlap": _overlap_sample(grid, max(p_values, default=1), device, dtype, progress),
        "host_link": _host_link_sample(grid, device, dtype, progress),
    }
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
            d: {"coef": fit_nonnegative(gemm_features, [g[f"{d}_s"] for g in gemm]).tolist()}
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
    """Measure and fit on ``max(p_values)`` ranks; returns the profile (see :mod:`cost.profile`). With
    ``shape`` and ``longest``, the grid has that model's own work at ``max(p_values)`` ranks too
    (:func:`model_grid`)."""
    if grid not in GRIDS:
        raise ValueError(f"unknown calibration grid {grid!r}; known: {', '.join(GRIDS)}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    p_values = sorted({int(p) for p in p_values})
    if not p_values or p_values[0] < 1:
        raise ValueError(f"group sizes must be >= 1, got {p_values}")
    if (shape is None) != (longest is None):
        raise ValueError("a model's own work is measured with both its shape and its longest micro-batch, or neither")
    world = max(p_values)
    measured = GRIDS[grid] if shape is None else model_grid(GRIDS[grid], shape, world, longest, device)
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
    element_size = torch.empty((), dtype=dtype).element_size()
    profile = {
        "grid": grid,
        "fingerprint": fingerprint(device),
        "dtype": dtype_name,
        "concurrency": world,
        "attention": {"kernel": get_kernel("auto", torch.device(device), dtype).name},
        # the CUDA caching allocator rounds and fragments; the CPU tracker counts tensor bytes exactly,
        # but gloo's worker thread frees finished collectives' buffers when it gets the GIL, and the
        # model's small tensors outside the terms (RoPE's temporaries, norms' gradients) add up
        "allocator_slack": 0.05,
        "correction": None,
        "model": None if shape is None else {"shape": dataclasses.asdict(shape), "p": world, "longest": longest},
        "samples": samples,
    }
    fitted = fit_profile(samples, element_size)
    profile["attention"].update(fitted.pop("attention"))
    profile.update(fitted)
    if fit_correction:
        layers = REFERENCE_SHAPE if shape is None else shape
        profile["correction"] = fit_correction_from_layers(profile, world, measured, device, dtype, timeout_s, layers)
    return profile


def _measure_correction_layers(rank: int, world: int, shape: ModelShape, lengths, device_type: str, dtype_name: str):
    from megatron_paradyse.cost.measure import measure_layer

    device = _rank_device(rank, device_type)
    out = []
    for s in lengths:
        layout = SequenceLayout.build(s, world, causal=True)
        for option in CORRECTION_LAYERS:
            m = measure_layer(
                option,
                layout,
                shape,
                dist.group.WORLD,
                dtype=getattr(torch, dtype_name),
                device=device,
                memory_runs=0,
            )
            out.append((str(option), s, m.time_s))
    return out


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
    else calibrated now (a minute or two on a CPU) and saved there. Run it on one rank; the caller shares
    the result with the ranks that plan with it."""
    from megatron_paradyse.cost.profile import ProfileError, load_profile, save_profile

    name = str(dtype).removeprefix("torch.")
    model = "" if shape is None else f"-model{model_key(shape)}"
    path = Path(cache_dir) / f"cost-profile-quick-corrected-{device}-p{p}-{name}{model}.json"
    try:
        profile = load_profile(path, p=p, host_link=True)  # one calibrated before offload is made again
        if shape is None or profile.get("model") and profile["model"]["longest"] >= longest:
            print(f"paradyse: no cost.profile: using the quick profile calibrated before, {path}", flush=True)
            return profile
    except ProfileError:
        pass
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


def fit_correction_from_layers(
    profile, world: int, grid: Grid, device: str, dtype, timeout_s: float, shape: ModelShape = REFERENCE_SHAPE
) -> dict:
    """Fit ``time = k_compute * compute + k_comm * comm + per_sync_s * syncs + per_layer_s`` on measured
    layers of ``shape`` at the grid's ``correction_lengths`` (``syncs``: collectives and ring hops, each
    a point where ranks wait for each other: on an oversubscribed CPU a rank that arrives early waits
    for the scheduler to run the rest)."""
    from megatron_paradyse.cost.analytic import AnalyticCostModel

    measured = run_on_ranks(
        _measure_correction_layers,
        world,
        args=(shape, grid.correction_lengths, device, str(dtype).removeprefix("torch.")),
        timeout_s=timeout_s,
        backend="nccl" if device == "cuda" else "gloo",
    )[0]
    model = AnalyticCostModel(profile, shape, world, dtype=dtype, use_correction=False)
    features, target = [], []
    for option, s, seconds in measured:
        b = model.time_breakdown(LayerOption.parse(option), SequenceLayout.build(s, world, causal=True), 1)
        features.append([b.compute_s, b.comm_s, b.syncs, 1.0])
        target.append(seconds)
    # The scales may stretch the calibrated terms, not delete them: a noisy fit on few layers must not
    # leave a model in which longer sequences cost nothing more.
    k_compute, k_comm, per_sync, per_layer = fit_nonnegative(
        np.array(features), np.array(target), floor=[MIN_SCALE, MIN_SCALE, 0.0, 0.0]
    )
    return {
        "compute": float(k_compute),
        "comm": float(k_comm),
        "per_sync_s": float(per_sync),
        "per_layer_s": float(per_layer),
        "fitted_on": [f"{option}@{s}" for option, s, _ in measured],
    }
