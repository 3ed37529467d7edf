"""Memory-script cells: a sublayer, a layer or Megatron's layer under one strategy, shape, documents and
dtype, measured on every rank with the storage tracker (:mod:`megatron_paradyse.core.memory`: every
storage an operator creates, until it is freed) and compared with the scripts of
:mod:`megatron_paradyse.cost.layer_memory` for that rank, to the byte.

A finished collective's buffers are released by gloo's worker thread, which needs the GIL: the
measurements switch threads every microsecond and keep the smallest of a few runs once it recurs (as
:func:`~megatron_paradyse.calibration.measure.measure_layer` does). No run warms a cell up first: what a
first run made lazily would put it above the next ones, whose least is the cell's.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_paradyse.attention import get_kernel
from megatron_paradyse.calibration.measure import measure_layer
from megatron_paradyse.core.comm import Zero3Gathers
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.memory import _StorageTracker, collective_buffers_freed_promptly, recurring_least
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.layer_memory import sublayer_memory
from megatron_paradyse.cost.terms import layer_terms
from megatron_paradyse.mcore.bare_layer import make_layer_params
from megatron_paradyse.mcore.linears import gather_buffer_scope, reserve_gather_buffer
from megatron_paradyse.strategies import (
    AttentionContext,
    MLPContext,
    ModelShape,
    get_strategy,
    run_attention,
    run_mlp,
)
from megatron_paradyse.strategies.dims import Dims

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
RUNS = 6
RETRIES = 3
OPTIONS = [
    f"{a}/{m}{rc}"
    for a in ("tp_sp", "ulysses", "ring", "lean")
    for m in ("tp_sp", "zero3", "lean")
    for rc in ("", "+rc")
]
KEPT_CORE_OPTIONS = [
    f"{a}/{m}+rc+keepcore" for a in ("tp_sp", "ulysses", "ring", "lean") for m in ("tp_sp", "zero3", "lean")
]
"""Every pair recomputed around its kept attention core: each attention strategy in fp32, bf16 and fp16."""


def model_shape(kind: str, p: int, qk_norm: bool = False) -> ModelShape:
    """Heads, groups and MLP units divisible by p: MHA with GELU, or GQA (2 query heads a group) with SwiGLU;
    ``wide``: GQA's with twice the hidden size, where an MLP's weights outweigh its 32 tokens a rank (a
    weight gathered ahead then sets the forward's peak: ``zero3``'s fc2 during fc1)."""
    if kind == "wide":
        return dataclasses.replace(model_shape("gqa", p, qk_norm), hidden_size=96, kv_channels=16)
    if kind == "mha":
        return ModelShape(
            hidden_size=64,
            num_attention_heads=2 * p,
            num_query_groups=2 * p,
            kv_channels=16,
            ffn_hidden_size=64 * p,
            qk_norm=qk_norm,
        )
    return ModelShape(
        hidden_size=48,
        num_attention_heads=4 * p,
        num_query_groups=2 * p,
        kv_channels=8,
        ffn_hidden_size=24 * p,
        gated_mlp=True,
        qk_norm=qk_norm,
    )


def layout_of(docs: str, p: int, causal: bool) -> SequenceLayout:
    """``one``: 32 tokens a rank, no padding; ``padded``: one document with padding; ``packed``: three
    documents and padding."""
    lengths = {"one": (32 * p,), "padded": (32 * p - 3,), "packed": (41, 17 * p, 6)}[docs]
    return SequenceLayout.build(lengths, p, causal=causal)


@dataclasses.dataclass(frozen=True)
class Cell:
    kind: str
    """``attention``, ``mlp``, ``layer`` (``mcore.bare_layer.run_layer``) or ``megatron`` (the spec's layer)."""
    name: str
    """The strategy, or the layer option."""
    shape: str
    docs: str
    causal: bool
    dtype: str
    bias: bool
    norm: str = "LayerNorm"
    batch: int = 1
    qk_norm: bool = False
    mlp_ahead: bool = False
    """The layer gathers the MLP's first weight during the attention (``Dims.mlp_weight_ahead``): the
    attention starts that gather and hands the weight on, the MLP starts with it."""
    dropout: bool = False
    """Megatron's hidden dropout on (``megatron`` cells): each sublayer's output dropped out, its mask kept."""


def strategy_cells(p: int) -> list[Cell]:
    """The strategies' sublayers and whole layers. fp16 has bf16's sizes: it runs on a few cells of each
    kind, fp32 and bf16 on all."""
    out = []
    combos = itertools.product(("mha", "gqa"), ("one", "padded", "packed"), (True, False), ("fp32", "bf16"))
    for i, (shape, docs, causal, dtype) in enumerate(combos):
        for name in ("tp_sp", "ulysses", "ring", "lean"):
            out.append(Cell("attention", name, shape, docs, causal, dtype, bias=i % 2 == 0))
    for name in ("tp_sp", "ulysses", "ring", "lean"):
        out.append(Cell("attention", name, "gqa", "packed", True, "fp16", bias=False))
        out.append(Cell("attention", name, "mha", "packed", False, "bf16", bias=True, batch=2))
    for shape, dtype, bias in itertools.product(("mha", "gqa"), DTYPES, (True, False)):
        for name in ("tp_sp", "zero3", "lean"):
            out.append(Cell("mlp", name, shape, "one", True, dtype, bias))
    out += [Cell("mlp", "zero3", "wide", "one", True, dtype, bias=dtype == "fp32") for dtype in DTYPES]
    # fc2's input recomputed in backward: GELU and SwiGLU in every dtype, with and without biases
    for i, (shape, dtype) in enumerate(itertools.product(("mha", "gqa"), DTYPES)):
        out.append(Cell("mlp", "zero3_actrc", shape, "one", True, dtype, bias=i % 2 == 0))
    for i, (name, dtype) in enumerate(itertools.product(("ulysses", "ring"), DTYPES) if p > 1 else ()):
        shape, docs = ("wide", "mha")[i % 2], ("one", "packed")[i // 3]
        out.append(Cell("attention", name, shape, docs, i % 2 == 0, dtype, bias=i % 3 == 0, mlp_ahead=True))
    if p > 1:  # one rank gathers nothing
        out += [Cell("mlp", "zero3", "wide", "one", True, dt, bias=dt != "fp32", mlp_ahead=True) for dt in DTYPES]
        out.append(Cell("mlp", "zero3_actrc", "wide", "one", True, "bf16", bias=False, mlp_ahead=True))
    for options in (OPTIONS, KEPT_CORE_OPTIONS):
        for i, option in enumerate(options):
            dtype = ("fp32", "bf16", "fp16")[i % 3]
            out.append(Cell("layer", option, "gqa", "packed", True, dtype, bias=option.startswith(("tp_sp", "ring"))))
    for option, dtype in (
        ("ulysses/zero3_actrc", "bf16"),
        ("ring/zero3_actrc+rc", "fp16"),
        ("tp_sp/zero3_actrc", "fp32"),
    ):
        out.append(Cell("layer", option, "gqa", "packed", True, dtype, bias=option.startswith("tp_sp")))
    return out


def megatron_cells(p: int) -> list[Cell]:
    """Megatron's layer (the spec's) under options with every attention and MLP strategy."""
    out = []
    for norm, option in itertools.product(
        ("LayerNorm", "RMSNorm"), ("tp_sp/tp_sp", "ulysses/zero3+rc", "ring/lean", "lean/tp_sp+rc", "lean/lean")
    ):
        shape = "gqa" if norm == "RMSNorm" else "mha"
        out.append(Cell("megatron", option, shape, "packed", True, "bf16", bias=False, norm=norm))
    for i, (norm, option) in enumerate(
        itertools.product(("LayerNorm", "RMSNorm"), ("tp_sp/tp_sp", "ulysses/zero3+rc", "ring/lean", "lean/lean"))
    ):
        shape = "gqa" if norm == "RMSNorm" else "mha"
        dtype, docs = ("fp32", "bf16", "fp16")[i % 3], ("one", "packed")[(i + i // 4) % 2]
        out.append(Cell("megatron", option, shape, docs, True, dtype, bias=False, norm=norm, qk_norm=True))
    # recomputed around a kept attention core (the ring's per rank, lean's per head group)
    for option, norm in (("ring/zero3+rc+keepcore", "RMSNorm"), ("lean/tp_sp+rc+keepcore", "LayerNorm")):
        out.append(Cell("megatron", option, "gqa", "packed", True, "bf16", bias=False, norm=norm, qk_norm=True))
    # where the MLP's first weight, gathered during the attention, sets the layer's peak (and the rebuilt one)
    for option, shape, docs in (
        ("ulysses/zero3", "gqa", "packed"),
        ("ulysses/zero3+rc", "wide", "one"),
        ("ulysses/zero3_actrc", "wide", "one"),
    ):
        out.append(Cell("megatron", option, shape, docs, True, "fp32", bias=False, norm="RMSNorm"))
    # hidden dropout: every strategy's backward from a gradient only autograd holds, recomputed or not
    for i, option in enumerate(
        ("tp_sp/tp_sp", "ulysses/zero3+rc", "ring/lean", "lean/tp_sp+rc", "ring/zero3+rc+keepcore", "tp_sp/zero3")
    ):
        norm, shape = ("LayerNorm", "mha") if i % 2 else ("RMSNorm", "gqa")
        dtype, docs = ("fp32", "bf16", "fp16")[i % 3], ("one", "packed")[i // 3]
        out.append(Cell("megatron", option, shape, docs, True, dtype, bias=i == 5, norm=norm, dropout=True))
    return out


def _least_recurring(measure) -> tuple[int, ...]:
    """Each figure at the least it takes once it recurs (at most :data:`RUNS` measurements), switching
    threads every microsecond so that gloo's worker thread drops a finished collective's buffers when the
    code does."""
    with collective_buffers_freed_promptly():
        return recurring_least(measure, most_runs=RUNS)


@gather_buffer_scope()  # the linears' gather buffer gone before a Megatron cell sets up its parallel state
def _measure_sublayer(cell: Cell, rank: int, p: int) -> tuple[int, int, int, int]:
    """(saved, forward peak, backward peak above its start, handed on) of one sublayer, as the scripts
    count them: the input allocated in the window and dropped by the caller after the call, the
    output's gradient counted at the backward's start. ``cell.mlp_ahead``: the MLP's weight gathers
    handed to both sublayers; the attention's forward leaves the weight it gathered ahead (taken and
    dropped before the backward: what it hands on), the MLP's starts with its first weight gathered."""
    shape, dtype = model_shape(cell.shape, p), DTYPES[cell.dtype]
    layout = layout_of(cell.docs, p, cell.causal)
    params = make_layer_params(shape, p, rank, bias=cell.bias, dtype=dtype)
    group = dist.group.WORLD

    def gathers() -> Zero3Gathers | None:
        return get_strategy("mlp", "zero3").weight_gathers(params.mlp, group) if cell.mlp_ahead else None

    if cell.kind == "attention":
        ctx = AttentionContext(
            group=group, layout=layout, shape=shape, kernel=get_kernel("torch", "cpu", dtype), softmax_scale=0.125
        )

        def run(x, mlp_gathers):
            return run_attention(cell.name, x, params.attention, dataclasses.replace(ctx, mlp_gathers=mlp_gathers))
    else:
        ctx = MLPContext(group=group, shape=shape, activation=F.silu if shape.gated_mlp else F.gelu)

        def run(x, mlp_gathers):
            return run_mlp(cell.name, x, params.mlp, dataclasses.replace(ctx, gathers=mlp_gathers))

    def started(mlp_gathers: Zero3Gathers | None) -> Zero3Gathers | None:
        if mlp_gathers is not None and cell.kind == "mlp":
            mlp_gathers.start(0)  # as the attention before it does
        return mlp_gathers

    x0 = torch.randn(layout.local_len, cell.batch, shape.hidden_size).to(dtype).requires_grad_()
    layout.indices("cpu")  # before the layers run, as the entry point makes them
    if p > 1:  # Megatron's gather buffer, held outside the layer as a step's other layers leave it
        reserve_gather_buffer(layout.padded_len * cell.batch, shape.hidden_size, dtype, "cpu")

    def measure() -> tuple[int, int, int, int]:
        with _StorageTracker() as tracker:
            x = x0.clone()
            mlp_gathers = started(gathers())
            _settle(tracker)
            tracker.peak = tracker.live
            y = run(x, mlp_gathers)
            del x
            _settle(tracker)
            y_bytes = y.numel() * y.element_size()
            live = tracker.live
            if mlp_gathers is not None and cell.kind == "attention":
                mlp_gathers.take(0)  # the weight handed on, waited for and dropped
            del mlp_gathers
            _settle(tracker)
            handed_on = live - tracker.live
            saved, fwd_peak = tracker.live - y_bytes, tracker.peak
            dy = torch.ones_like(y)
            tracker.peak = tracker.live
            y.backward(dy)
            bwd_peak = tracker.peak - 2 * y_bytes  # above the output and its gradient, as saved below
            del y, dy
            x0.grad = None
        return saved, fwd_peak, bwd_peak, handed_on

    saved, fwd_peak, bwd_peak, handed_on = _least_recurring(measure)
    # above what was saved (the smallest count: a buffer gloo's thread had not dropped yet does not shift it)
    return saved, fwd_peak, bwd_peak - saved, handed_on


def _settle(tracker: _StorageTracker) -> None:
    """Give gloo's worker thread the GIL until it has dropped the buffers of finished collectives."""
    live = None
    for _ in range(20):
        if tracker.live == live:
            return
        live = tracker.live
        time.sleep(0.001)


def _measure_megatron(cell: Cell, rank: int, p: int) -> tuple[int, int]:
    from megatron_paradyse.mcore.trace import LayerModel, RankTracer

    model = LayerModel(
        shape=model_shape(cell.shape, p, cell.qk_norm),
        normalization=cell.norm,
        bias=cell.bias,
        hidden_dropout=0.1 if cell.dropout else 0.0,
    )
    layout = layout_of(cell.docs, p, cell.causal)
    option = LayerOption.parse(cell.name)
    with RankTracer(model, layer="megatron", dtype=DTYPES[cell.dtype], fake=False, kernel="torch") as tracer:

        def measure() -> tuple[int, int]:
            trace = tracer.trace(option, layout)
            return trace.saved_bytes, trace.peak_bytes

        return _least_recurring(measure)


def _measure_cell(cell: Cell, rank: int, p: int) -> tuple[int, ...]:
    if cell.kind in ("attention", "mlp"):
        return _measure_sublayer(cell, rank, p)
    if cell.kind == "megatron":
        return _measure_megatron(cell, rank, p)
    m = measure_layer(
        LayerOption.parse(cell.name),
        layout_of(cell.docs, p, cell.causal),
        model_shape(cell.shape, p),
        dist.group.WORLD,
        dtype=DTYPES[cell.dtype],
        kernel="torch",
        bias=cell.bias,
        warmup=0,
        repeats=0,
        memory_runs=RUNS,
    )
    return m.saved_bytes, m.peak_bytes


def predicted(cell: Cell, rank: int, p: int) -> tuple[float, ...]:
    shape, layout = model_shape(cell.shape, p, cell.qk_norm), layout_of(cell.docs, p, cell.causal)
    e = DTYPES[cell.dtype].itemsize
    if cell.kind == "megatron":
        d = Dims(
            shape,
            p,
            layout.padded_len,
            1,
            e,
            shape.kv_channels,
            bias=cell.bias,
            normalization=cell.norm,
            hidden_dropout=cell.dropout,
        )
    else:
        d = Dims(shape, p, layout.padded_len, cell.batch, e, bias=cell.bias, mlp_weight_ahead=cell.mlp_ahead)
    if cell.kind in ("attention", "mlp"):
        memory = sublayer_memory(cell.kind, cell.name, d, layout, rank)
        return memory.saved_bytes, memory.fwd_peak, memory.bwd_peak, memory.handed_on
    terms = layer_terms(LayerOption.parse(cell.name), d, layout, rank)
    return terms.saved_bytes, terms.peak_bytes


def measure_all(rank: int, p: int, cells_of: Callable[[int], list[Cell]]) -> dict[Cell, tuple[int, ...]]:
    """Every cell of ``cells_of(p)`` measured on this rank (launched on ``p`` ranks by ``run_on_ranks``)."""
    from helpers import megatron_harness as H  # megatron-core for the Megatron cells, after the CPU patches

    H.freeze_what_lives_now()
    torch.manual_seed(rank)
    out = {}
    for cell in cells_of(p):
        out[cell] = _measure_cell(cell, rank, p)
        out[cell] = _remeasured_while_any_rank_differs(cell, rank, p, out[cell])
    return out


def _remeasured_while_any_rank_differs(cell: Cell, rank: int, p: int, got: tuple[int, ...]) -> tuple[int, ...]:
    """A loaded machine can keep gloo's worker thread from dropping a buffer in time in every one of
    the :data:`RUNS` runs: where any rank differs from its script, every rank (the collectives need
    them all) measures again, a few times, keeping the smallest figures. A real divergence stays."""
    for _ in range(RETRIES):
        differs = torch.tensor([float(got != tuple(predicted(cell, rank, p)))])
        dist.all_reduce(differs, op=dist.ReduceOp.MAX)
        if not differs.item():
            break
        got = tuple(map(min, got, _measure_cell(cell, rank, p)))
    return got


def _describe(cell: Cell) -> str:
    norms = f"{cell.norm}{', q/k norms' if cell.qk_norm else ''}"
    what = {"attention": "attention", "mlp": "MLP", "layer": "layer", "megatron": f"Megatron layer ({norms})"}
    mask = "causal" if cell.causal else "bidirectional"
    ahead = ", MLP weight gathered ahead" if cell.mlp_ahead else ""
    ahead += ", hidden dropout" if cell.dropout else ""
    where = f"{cell.shape}, {cell.docs} {mask}, {cell.dtype}, bias={cell.bias}, b={cell.batch}{ahead}"
    return f"{what[cell.kind]} {cell.name}, {where}"


def assert_every_rank_allocates_what_the_scripts_say(p: int, per_rank: list[dict[Cell, tuple[int, ...]]]) -> None:
    """Every rank's figures of every cell equal its scripts', to the byte."""
    figures = {"attention": ("saved", "forward peak", "backward peak", "handed on")}
    figures["mlp"] = figures["attention"]
    figures["layer"] = figures["megatron"] = ("saved", "peak")
    wrong = []
    for rank, results in enumerate(per_rank):
        for cell, got in results.items():
            want = predicted(cell, rank, p)
            for figure, g, w in zip(figures[cell.kind], got, want):
                if g != w:
                    wrong.append(f"rank {rank}, {_describe(cell)}: {figure} {g} measured, {w:.0f} scripted")
    cells_run = sum(len(r) for r in per_rank)
    assert not wrong, f"{len(wrong)} of {cells_run} rank-cells differ (p={p}):\n" + "\n".join(wrong[:40])
