"""What a calibration measures: the generic grids (``quick``, ``full``), a model's own work added to one
(:func:`model_grid`), and the layers its correction is fitted on (:func:`correction_layers`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.terms import sublayer_terms
from megatron_paradyse.strategies import ModelShape, strategy_names
from megatron_paradyse.strategies.dims import Dims
from megatron_paradyse.strategies.terms import AttentionCall

__all__ = [
    "GRIDS",
    "Grid",
    "REFERENCE_SHAPE",
    "SAMPLE_BYTES",
    "SAMPLE_FLOPS",
    "correction_layers",
    "model_grid",
    "model_key",
    "named_grid",
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


def named_grid(name: str, shape: ModelShape | None, p: int, longest: int | None, device: str) -> Grid:
    if name not in GRIDS:
        raise ValueError(f"unknown calibration grid {name!r}; known: {', '.join(GRIDS)}")
    if (shape is None) != (longest is None):
        raise ValueError("a model's own work is measured with both its shape and its longest micro-batch, or neither")
    return GRIDS[name] if shape is None else model_grid(GRIDS[name], shape, p, longest, device)


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
