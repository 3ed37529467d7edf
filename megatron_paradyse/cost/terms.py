"""What one rank computes, sends and keeps for one sublayer under one strategy: the cost models' atoms.

Every strategy's terms live in one function here, written from its code in ``strategies/``, as
formulas in the micro-batch's padded length ``s``, local tokens ``t = s/p``, batch ``b``, hidden ``h``,
heads ``nq`` and key/value groups ``ng`` of head dim ``hn``, MLP width ``f`` (``g = 2`` gated) and the
element size ``e``. Nothing here is measured: :mod:`cost.analytic` turns the terms into seconds with a
calibrated profile, and the unit tests check them against hand counts and the memory tracker.

- :class:`Gemm` ``(m, n, k)``: ``y[m, n] = x[m, k] @ w[n, k]^T``; ``2mnk`` FLOPs forward, ``4mnk``
  backward (dgrad + wgrad). ``recompute_gemms`` run again, forward only, inside the backward.
- :class:`AttentionCall`: one kernel call on a dense (query block, key block); ``pairs`` visible
  query-key pairs per head (``sq*sk`` full, ``sq(sq+1)/2`` causal); ``4*pairs*hn`` FLOPs per head
  forward, ``10*pairs*hn`` backward (flash recomputes the scores).
- :class:`Collective`: a collective (``all_gather``: output bytes; ``reduce_scatter``: input bytes;
  ``all_to_all``: bytes each rank sends and receives; ``broadcast``/``reduce``: the message) or one
  ring hop (``send_recv``: bytes sent to the next rank while receiving as many). ``fwd_comm`` and
  ``bwd_comm`` are waited for where they are issued; ``*_streamed`` run asynchronously while the
  same pass computes (``lean``'s weight shards, issued one step ahead).
- :class:`RingStage`: ``p`` steps of kernel calls, each overlapped with the next block's hop.
- Memory: each strategy's forward and backward are written as the tensors its code allocates and
  frees, by name and in its order (a small script per strategy, read against its code); they give
  what stays for backward (``saved``) and the high-water marks, which :func:`layer_terms` composes
  with the layer's own tensors (norms, residuals). Checked against allocation traces of
  :class:`~megatron_paradyse.memory.PeakMemory`: exact for one document per sequence, biases, no
  ``qk_transform``; tensors smaller than a ``[t, b]`` fp32 row are left out, a packed sequence's
  per-document merges too. The planner prices every option on every rank: loops that ranks repeat
  (ring steps, ``lean``'s head groups) are scripted per iteration and memoised by what an iteration
  depends on (the tensors alive at its start, the block it sees), and the scripts around the ring by
  the ring's memory, so each distinct iteration is scripted once per micro-batch shape.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Literal

from megatron_paradyse.layout import Segment, SequenceLayout
from megatron_paradyse.plan import LayerOption
from megatron_paradyse.strategies import ModelShape

__all__ = [
    "AttentionCall",
    "COLLECTIVE_KINDS",
    "Collective",
    "CollectiveKind",
    "Dims",
    "Gemm",
    "LayerMemory",
    "LayerTerms",
    "RANK_DEPENDENT",
    "RingStage",
    "SublayerTerms",
    "attention_calls",
    "attention_terms",
    "compose_layer",
    "layer_memory",
    "layer_terms",
    "sublayer_terms",
    "supported_options",
]

_MEMO_SIZE = 1024
"""Entries kept by each memoised script: one planner decision makes a few dozen; earlier micro-batch
shapes' fall out."""

CollectiveKind = Literal["all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast", "reduce"]
COLLECTIVE_KINDS: tuple[CollectiveKind, ...] = (
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "send_recv",
    "broadcast",
    "reduce",
)


@dataclasses.dataclass(frozen=True, slots=True)
class Gemm:
    m: int
    n: int
    k: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionCall:
    b: int
    heads: int
    sq: int
    sk: int
    hn: int
    causal: bool

    @property
    def pairs(self) -> int:
        """Visible (query, key) pairs of one head."""
        return self.sq * (self.sq + 1) // 2 if self.causal else self.sq * self.sk

    @property
    def flops(self) -> int:
        """Forward FLOPs: ``QK^T`` and ``PV`` over the visible pairs."""
        return 4 * self.b * self.heads * self.pairs * self.hn

    @property
    def length(self) -> float:
        """The block's length for rate look-ups: ``sq`` of a causal square, ``sqrt(sq sk)`` otherwise."""
        return float(self.sq) if self.causal else math.sqrt(self.sq * self.sk)


@dataclasses.dataclass(frozen=True, slots=True)
class Collective:
    kind: CollectiveKind
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class RingStage:
    """``len(steps)`` ring steps; step ``i`` runs its kernel calls while the hop of ``hop`` is in flight
    (none after the last forward step; backward also passes the gradient accumulator, ``bwd_hop``)."""

    steps: tuple[tuple[AttentionCall, ...], ...]
    hop: Collective
    bwd_hop: Collective

    @property
    def fwd_hops(self) -> int:
        return len(self.steps) - 1


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SublayerTerms:
    """One sublayer (attention or MLP) under one strategy, on one rank, for one micro-batch."""

    gemms: tuple[Gemm, ...]
    recompute_gemms: tuple[Gemm, ...] = ()
    """GEMMs the backward runs again, forward only (``lean`` recomputes its projections)."""
    attention: tuple[AttentionCall, ...] = ()
    """Kernel calls run back to back (not overlapped with communication)."""
    rings: tuple[RingStage, ...] = ()
    fwd_comm: tuple[Collective, ...] = ()
    bwd_comm: tuple[Collective, ...] = ()
    fwd_streamed: tuple[Collective, ...] = ()
    """Asynchronous collectives in flight while the forward computes."""
    bwd_streamed: tuple[Collective, ...] = ()
    elementwise_bytes: float = 0.0
    """Bytes read + written by memory-bound ops (norms, copies, merges, activations), forward;
    backward counts twice as many."""
    saved: dict[str, float]
    """Bytes kept from forward to backward, by tensor (the input too where it is kept)."""
    fwd_peak: float
    """Bytes alive at the forward's high-water mark, its input included."""
    bwd_peak: float
    """Bytes above the backward's start (what was saved, the output's gradient) at its high-water mark."""

    @property
    def saved_bytes(self) -> float:
        return float(sum(self.saved.values()))

    def syncs(self, *, backward: bool) -> int:
        """Collectives and ring hops of the forward or the backward: where the ranks wait for each other."""
        comms = len(self.bwd_comm) + len(self.bwd_streamed) if backward else len(self.fwd_comm) + len(self.fwd_streamed)
        return comms + sum(ring.fwd_hops + (len(ring.steps) if backward else 0) for ring in self.rings)


@dataclasses.dataclass(frozen=True, slots=True)
class Dims:
    """The sizes a strategy's terms are written in, for one micro-batch on one rank."""

    shape: ModelShape
    p: int
    s: int
    """Padded sequence length (a multiple of 2p)."""
    b: int
    e: int
    """Bytes per activation/weight element."""
    rotary_dim: int = 0
    """Channels of each head that RoPE rotates (0: no RoPE)."""

    @property
    def acc(self) -> int:
        """Bytes per element of the accumulation dtype (log-sum-exp, ring accumulators, norm
        statistics): fp32 for half precision, the activations' own otherwise."""
        return max(self.e, 4)

    @property
    def t(self) -> int:
        return self.s // self.p

    @property
    def h(self) -> int:
        return self.shape.hidden_size

    @property
    def hn(self) -> int:
        return self.shape.kv_channels

    @property
    def nq(self) -> int:
        return self.shape.num_attention_heads

    @property
    def ng(self) -> int:
        return self.shape.num_query_groups

    @property
    def qkv(self) -> int:
        """Columns of the full QKV projection: ``(nq + 2 ng) hn``."""
        return (self.nq + 2 * self.ng) * self.hn

    @property
    def a(self) -> int:
        """Columns of the full attention output: ``nq hn``."""
        return self.nq * self.hn

    @property
    def f(self) -> int:
        return self.shape.ffn_hidden_size

    @property
    def f1(self) -> int:
        """Rows of the full ``linear_fc1``: ``g f``."""
        return (2 if self.shape.gated_mlp else 1) * self.f

    @property
    def x(self) -> int:
        """Bytes of one ``[t, b, h]`` activation."""
        return self.t * self.b * self.h * self.e

    def q_copied(self, groups: int) -> bool:
        """Whether ``split_qkv`` copies q out of a QKV tensor holding ``groups`` key/value groups: the
        query heads of a group are contiguous, so q is a view with one query head per group (MHA) or
        a single group, a copy otherwise."""
        return groups > 1 and self.shape.heads_per_group > 1


def attention_calls(layout: SequenceLayout, b: int, heads: int, hn: int) -> tuple[AttentionCall, ...]:
    """Kernel calls of full-sequence attention on ``heads`` heads (tp_sp, ulysses: one per document)."""
    return _segment_calls(layout.full_segments(), b, heads, hn)


@functools.lru_cache(maxsize=_MEMO_SIZE)
def _segment_calls(segments: tuple[Segment, ...], b: int, heads: int, hn: int) -> tuple[AttentionCall, ...]:
    """One kernel call per visible segment; memoised: ring steps of every rank repeat a few blocks."""
    return tuple(
        AttentionCall(b, heads, seg.q_end - seg.q_start, seg.k_end - seg.k_start, hn, seg.causal) for seg in segments
    )


def _ring_steps(layout: SequenceLayout, rank: int) -> tuple[tuple[Segment, ...], ...]:
    """The visible segments of each ring step of ``rank``: its queries against the keys of ``rank - step``."""
    return tuple(layout.ring_segments(rank, (rank - step) % layout.p) for step in range(layout.p))


def _ring_stage(segments: tuple[tuple[Segment, ...], ...], d: Dims, heads: int, kv_heads: int) -> RingStage:
    """Ring attention on ``heads`` query heads, step ``i`` on ``segments[i]`` (:func:`_ring_steps`:
    against the K/V block, ``kv_heads`` heads, of ``rank - i``); the block hops forward, its fp32
    gradient backward."""
    kv_block = 2 * d.t * d.b * kv_heads * d.hn
    steps = tuple(_segment_calls(step, d.b, heads, d.hn) for step in segments)
    return RingStage(steps, Collective("send_recv", kv_block * d.e), Collective("send_recv", kv_block * d.acc))


# -- memory: what the code allocates and frees --------------------------------------------------
_State = tuple[tuple[str, float], ...]
"""Tensors alive (name, bytes), sorted by name: hashable, so that loop iterations can be memoised."""


class _Memory:
    """Tensors alive, by name, as code allocates and frees them: the bytes alive and their
    high-water mark. Names are unique while alive; freeing a name that is not alive is a bug in a
    script and raises ``KeyError``."""

    __slots__ = ("sizes", "live", "peak")

    def __init__(self, **alive: float):
        self.sizes: dict[str, float] = dict(alive)
        self.live = float(sum(alive.values()))
        self.peak = self.live

    def alloc(self, **tensors: float) -> None:
        sizes, live = self.sizes, self.live  # locals: the planner runs thousands of these per decision
        for name, nbytes in tensors.items():
            if name in sizes:
                raise ValueError(f"memory script: {name!r} is allocated twice")
            sizes[name] = float(nbytes)
            live += nbytes
        self.live = live
        if live > self.peak:
            self.peak = live

    def free(self, *names: str) -> None:
        sizes, live = self.sizes, self.live
        for name in names:
            live -= sizes.pop(name)
        self.live = live

    def temporary(self, **tensors: float) -> None:
        """Tensors that live for one operation."""
        self.alloc(**tensors)
        self.free(*tensors)

    def call(self, callee: _Call, prefix: str = "") -> None:
        """A function whose own tensors die inside it, leaving ``callee.leaves`` (named ``prefix+name``)."""
        self.peak = max(self.peak, self.live + callee.peak)
        self.alloc(**{prefix + name: nbytes for name, nbytes in callee.leaves})

    def returns(self, output: str, *keep: str) -> dict[str, float]:
        """A function returns ``output``: its other locals die, but what autograd saved (``keep``)."""
        self.free(*(name for name in list(self.sizes) if name != output and name not in keep))
        return {name: self.sizes[name] for name in keep}

    def rename(self, **names: str) -> None:
        """Tensors that live on under another name (a loop's next-iteration names)."""
        for old, new in names.items():
            self.sizes[new] = self.sizes.pop(old)

    def state(self) -> _State:
        """The tensors alive, in a canonical order: what a :class:`_Step` starts from and leaves."""
        return tuple(sorted(self.sizes.items()))


@dataclasses.dataclass(frozen=True, slots=True)
class _Call:
    """A function's memory as its caller sees it: the high-water mark above the caller's bytes, and
    the tensors it leaves behind (its results)."""

    peak: float
    leaves: _State


@dataclasses.dataclass(frozen=True, slots=True)
class _Step:
    """One iteration of a loop (a ring step, a head group): its high-water mark, absolute (it starts
    from the tensors the loop has alive), and the tensors it leaves for the next iteration."""

    peak: float
    state: _State


class _Loop:
    """A loop run as memoised iterations (functions of the state they start from, returning a
    :class:`_Step`): ranks and ring steps repeat the same few, so each is scripted once."""

    def __init__(self, start: _Memory):
        self.peak, self.state = start.peak, start.state()

    def step(self, result: _Step) -> None:
        self.peak, self.state = max(self.peak, result.peak), result.state

    def end(self) -> _Memory:
        """The memory after the loop, to go on with."""
        m = _Memory(**dict(self.state))
        m.peak = self.peak
        return m


@dataclasses.dataclass(frozen=True, slots=True)
class _SublayerMemory:
    """The memory fields of :class:`SublayerTerms`, hashable (memoised scripts return it)."""

    saved: _State
    fwd_peak: float
    bwd_peak: float

    def fields(self) -> dict:
        return {"saved": dict(self.saved), "fwd_peak": self.fwd_peak, "bwd_peak": self.bwd_peak}


def _memory(fwd_peak: float, bwd: _Memory, saved: dict[str, float]) -> _SublayerMemory:
    """A sublayer's memory from its forward's high-water mark and its backward, which must release
    everything saved."""
    if set(bwd.sizes) != {"dy_local", "dx_local"}:
        raise AssertionError(f"memory script: backward ends with {sorted(bwd.sizes)} alive")
    return _SublayerMemory(tuple(saved.items()), fwd_peak, bwd.peak - sum(saved.values()))


def _gather_weight(m: _Memory, d: Dims, name: str, nbytes: float, *, row: bool) -> str:
    """``zero3_linear``'s all-gathered weight; row-parallel shards arrive as ``[p, out, in/p]`` and are
    laid out as ``[out, in]`` (a copy). Returns the name of the full weight."""
    m.alloc(**{name: nbytes})
    if row:
        m.alloc(**{f"{name}_t": nbytes})
        m.free(name)
        return f"{name}_t"
    return name


def _zero3_forward(
    m: _Memory, d: Dims, name: str, out: str, out_bytes: float, w: float, *, bias: float = 0.0, row: bool = False
) -> None:
    """``out = zero3_linear(x, W, b)``: the weight (and a column bias) exist for the GEMM only."""
    if d.p == 1:
        m.alloc(**{out: out_bytes})
        return
    if bias:
        m.alloc(**{f"{name}_b": bias})
    weight = _gather_weight(m, d, f"{name}_w", w, row=row)
    m.alloc(**{out: out_bytes})
    m.free(weight, *((f"{name}_b",) if bias else ()))


def _zero3_backward(
    m: _Memory,
    d: Dims,
    name: str,
    dx: str,
    dx_bytes: float,
    w: float,
    *,
    release: tuple[str, ...],
    bias: float = 0.0,
    row: bool = False,
) -> None:
    """``zero3_linear``'s backward: the weight gathered again for ``dx = dy W``, then the full weight
    gradient (row: and its transposed copy) reduce-scattered to the shard, the bias's too; then
    ``release`` (the incoming gradient, the saved input) and the shard gradients (accumulated into
    ``.grad``) die."""
    dw, db = f"{name}_dw", f"{name}_db"
    if d.p == 1:
        m.alloc(**{dx: dx_bytes, dw: w, **({db: bias} if bias else {})})
        m.free(*release, dw, *((db,) if bias else ()))
        return
    weight = _gather_weight(m, d, f"{name}_w", w, row=row)
    m.alloc(**{dx: dx_bytes})
    m.free(weight)
    full = f"{dw}_full"
    m.alloc(**{full: w})
    if row:
        m.alloc(**{f"{dw}_t": w})
        m.free(full)
        full = f"{dw}_t"
    m.alloc(**{dw: w / d.p})
    m.free(full)
    if bias:
        m.alloc(**{f"{db}_full": bias, db: bias / d.p})
        m.free(f"{db}_full")
    m.free(*release, dw, *((db,) if bias else ()))


def _row_parallel_backward(
    m: _Memory, d: Dims, dx: str, dx_bytes: float, w: float, *, release: tuple[str, ...]
) -> None:
    """The backward of Megatron's row-parallel linear followed by the sequence reduce-scatter: the
    output gradient all-gathered to ``[s, b, h]``, the weight gradient and ``dx``; then the gathered
    gradient, ``release`` (the saved input) and the weight gradient (accumulated) die."""
    if d.p > 1:
        m.alloc(dy_full=d.s * d.b * d.h * d.e)
    m.alloc(row_dw=w, **{dx: dx_bytes})
    m.free(*(("dy_full",) if d.p > 1 else ()), *release, "row_dw")


def _sequence_parallel_forward(m: _Memory, d: Dims, out: str, out_bytes: float) -> None:
    """``out = sequence_parallel_linear(x_local, W, b)``: the gathered ``[s, b, h]`` input exists for
    the GEMM only; autograd keeps ``x_local``."""
    if d.p > 1:
        m.alloc(x_full=d.s * d.b * d.h * d.e)
    m.alloc(**{out: out_bytes})
    if d.p > 1:
        m.free("x_full")


def _sequence_parallel_backward(m: _Memory, d: Dims, dy: str, w: float, bias: float) -> None:
    """``sequence_parallel_linear``'s backward from ``dy``: the ``[s, b, h]`` input gradient,
    reduce-scattered to ``dx_local``; the input gathered again for the weight and bias gradients; then
    ``dy``, the saved ``x_local`` and the weight gradients (accumulated) die."""
    if d.p == 1:
        m.alloc(dx_local=d.x, column_dw=w, column_db=bias)
        m.free(dy, "x_local", "column_dw", "column_db")
        return
    full = d.s * d.b * d.h * d.e
    m.alloc(dx_full=full, dx_local=d.x)
    m.free("dx_full")
    m.alloc(x_full=full, column_dw=w, column_db=bias)
    m.free("x_full", dy, "x_local", "column_dw", "column_db")


def _kernel_forward(m: _Memory, d: Dims, out: str, lse: str, heads: int, kv_heads: int, sq: int, sk: int) -> None:
    """One kernel call: ``out [b, heads, sq, hn]`` and its log-sum-exp; with GQA the key/value heads
    are first repeated for their query heads (``_expand_kv``, for the call only)."""
    expanded = {f"{out}_k": d.b * heads * sk * d.hn * d.e, f"{out}_v": d.b * heads * sk * d.hn * d.e}
    if heads != kv_heads:
        m.alloc(**expanded)
    m.alloc(**{out: d.b * heads * sq * d.hn * d.e, lse: d.b * heads * sq * d.acc})
    if heads != kv_heads:
        m.free(*expanded)


def _kernel_backward(
    m: _Memory, d: Dims, grads: tuple[str, str, str], heads: int, kv_heads: int, sq: int, sk: int
) -> None:
    """One kernel call's backward: the output gradient made contiguous (a copy), ``dq``, ``dk``,
    ``dv``; with GQA, ``dk``/``dv`` of the repeated heads, summed back to the key/value heads."""
    dq, dk, dv = grads
    q_bytes, k_bytes = d.b * heads * sq * d.hn * d.e, d.b * kv_heads * sk * d.hn * d.e
    expanded_bytes = d.b * heads * sk * d.hn * d.e
    m.alloc(**{f"{dq}_dout": q_bytes})
    if heads == kv_heads:
        m.alloc(**{dq: q_bytes, dk: k_bytes, dv: k_bytes})
        m.free(f"{dq}_dout")
        return
    m.alloc(**{f"{dq}_k": expanded_bytes, f"{dq}_v": expanded_bytes})
    m.alloc(**{dq: q_bytes, f"{dk}_expanded": expanded_bytes, f"{dv}_expanded": expanded_bytes})
    m.free(f"{dq}_dout", f"{dq}_k", f"{dq}_v")
    m.alloc(**{dk: k_bytes, dv: k_bytes})
    m.free(f"{dk}_expanded", f"{dv}_expanded")


_Block = tuple[tuple[int, int], ...]
"""What a ring step's memory depends on: the (rows, columns) of each visible segment of the block.
A single ``(t, t)`` segment covers the whole block: one kernel call, no partial results to merge."""


@functools.lru_cache(maxsize=_MEMO_SIZE)
def _block(segments: tuple[Segment, ...]) -> _Block:
    """The :data:`_Block` of a ring step's segments (memoised like :func:`_segment_calls`)."""
    return tuple((seg.q_end - seg.q_start, seg.k_end - seg.k_start) for seg in segments)


def _full_attention_forward(
    m: _Memory, d: Dims, layout: SequenceLayout, qkv: str, heads: int, kv_heads: int
) -> tuple[tuple[str, ...], str]:
    """``attend_full_sequence`` of ``qkv`` ``[s, b, (heads + 2 kv_heads) hn]`` (alive): q (a copy when
    several groups' query heads are gathered), q/k/v put in natural order (causal: copies), the
    kernel's output and log-sum-exp, the output as ``[s, b, heads hn]`` in canonical order (causal: a
    copy; otherwise a view, the kernel lays its output out sequence-major). Returns what the kernel
    keeps for backward and the name of that output."""
    core = d.s * d.b * heads * d.hn * d.e
    q_copy = d.q_copied(kv_heads)
    if q_copy:
        m.alloc(q_copy=core)
    if layout.is_identity:
        kept = (qkv, "q_copy") if q_copy else (qkv,)
    else:
        m.alloc(qkv_natural=d.s * d.b * (heads + 2 * kv_heads) * d.hn * d.e)
        if q_copy:
            m.free("q_copy")
        kept = ("qkv_natural",)
    _kernel_forward(m, d, "attn_out", "lse", heads, kv_heads, d.s, d.s)
    if layout.is_identity:
        return (*kept, "attn_out", "lse"), "attn_out"
    m.alloc(core=core)
    return (*kept, "attn_out", "lse"), "core"


def _full_attention_backward(
    m: _Memory, d: Dims, layout: SequenceLayout, dcore: str, kept: tuple[str, ...], heads: int, kv_heads: int
) -> str:
    """The backward of :func:`_full_attention_forward` from ``dcore``: releases it and what was kept,
    leaves ``d_qkv`` ``[s, b, (heads + 2 kv_heads) hn]``."""
    core, kv = d.s * d.b * heads * d.hn * d.e, d.s * d.b * kv_heads * d.hn * d.e
    if not layout.is_identity:  # index_select's backward: zeros, then index_add
        m.alloc(dcore_zeros=core, dout_natural=core)
        m.free("dcore_zeros", dcore)
        dcore = "dout_natural"
    _kernel_backward(m, d, ("dq", "dk", "dv"), heads, kv_heads, d.s, d.s)
    m.free(dcore, *kept)
    grads = ("dq", "dk", "dv")
    if not layout.is_identity:  # back to canonical order, v, k then q
        for grad, nbytes in (("dv", kv), ("dk", kv), ("dq", core)):
            m.alloc(**{f"{grad}_zeros": nbytes, f"{grad}_canonical": nbytes})
            m.free(f"{grad}_zeros", grad)
        grads = ("dq_canonical", "dk_canonical", "dv_canonical")
    m.alloc(d_qkv=core + 2 * kv)  # split's backward: one tensor
    m.free(*grads)
    return "d_qkv"


def _ring_forward(d: Dims, blocks: tuple[_Block, ...], heads: int, kv_heads: int) -> _Call:
    """``ring_attention_forward`` on this rank's ``t`` queries of ``heads`` heads, its steps seeing
    ``blocks`` (:func:`_block` of each of :func:`_ring_steps`): the stacked K/V block and the one in
    flight, the running output and log-sum-exp (accumulation dtype), each step's partial result and
    its merge (:func:`_ring_forward_step`). Leaves ``out`` and ``lse``."""
    t, b, hn, acc = d.t, d.b, d.hn, d.acc
    loop = _Loop(_Memory(kv=2 * b * kv_heads * t * hn * d.e, out=b * heads * t * hn * acc, lse=b * heads * t * acc))
    for step, block in enumerate(blocks):
        loop.step(_ring_forward_step(d, heads, kv_heads, block, loop.state, last=step + 1 == d.p))
    m = loop.end()
    m.free("kv", *(("part", "part_lse") if "part" in m.sizes else ()))
    if d.e < acc:  # returned in the activations' dtype
        m.alloc(out_cast=b * heads * t * hn * d.e)
        m.free("out")
        m.rename(out_cast="out")
    return _Call(m.peak, (("out", m.sizes["out"]), ("lse", m.sizes["lse"])))


@functools.lru_cache(maxsize=_MEMO_SIZE)
def _ring_forward_step(d: Dims, heads: int, kv_heads: int, block: _Block, state: _State, *, last: bool) -> _Step:
    """One step of :func:`_ring_forward` from ``state`` (the K/V block ``kv``, the running ``out`` and
    ``lse``, the previous step's partial result ``part``/``part_lse``): the next block arrives while
    the kernels run on ``block`` (:data:`_Block`; zeros and per-segment merges unless one
    segment covers it), then the partial result is merged. Memoised: ranks and steps repeat the
    same few blocks."""
    t, b, hn, acc = d.t, d.b, d.hn, d.acc
    out_acc, lse_bytes = b * heads * t * hn * acc, b * heads * t * acc
    m = _Memory(**dict(state))
    if not last:
        m.alloc(kv_next=2 * b * kv_heads * t * hn * d.e)
    if block:
        if block == ((t, t),):
            _kernel_forward(m, d, "new_part", "new_part_lse", heads, kv_heads, t, t)
        else:
            m.alloc(new_part=out_acc, new_part_lse=lse_bytes)
            for rows, cols in block:
                _kernel_forward(m, d, "seg_out", "seg_lse", heads, kv_heads, rows, cols)
                # merged into the rows: every temporary of merge_partial dies, the result is copied in
                row_lse = b * heads * rows * acc
                m.temporary(merge_lse=row_lse, merge_weights=3 * row_lse, merge_scaled=3 * row_lse * hn)
                m.free("seg_out", "seg_lse")
        if "part" in m.sizes:
            m.free("part", "part_lse")
        # merge_partial: the new log-sum-exp, shift and both weights, the two scaled outputs, the sum
        m.alloc(new_lse=lse_bytes, weights=3 * lse_bytes)
        m.alloc(scaled=2 * out_acc, new_out=out_acc)
        m.free("scaled", "weights", "out", "lse")
        m.rename(new_part="part", new_part_lse="part_lse", new_out="out", new_lse="lse")
    if not last:
        m.free("kv")
        m.rename(kv_next="kv")
    return _Step(m.peak, m.state())


def _ring_backward(d: Dims, blocks: tuple[_Block, ...], heads: int, kv_heads: int) -> _Call:
    """``ring_attention_backward``: the stacked K/V block and the one in flight, ``dq`` and each step's
    ``dk``/``dv`` accumulator (accumulation dtype), the block gradients of the step (kept until the
    next step's replace them), the accumulator leaving and the one arriving
    (:func:`_ring_backward_step`). Leaves ``dq`` and ``dkv`` (the arrived accumulator; ``dk``/``dv``
    are views of it)."""
    t, b, hn = d.t, d.b, d.hn
    loop = _Loop(_Memory(kv=2 * b * kv_heads * t * hn * d.e, dq=b * heads * t * hn * d.acc))
    for step, block in enumerate(blocks):
        loop.step(_ring_backward_step(d, heads, kv_heads, block, loop.state, last=step + 1 == d.p))
    m = loop.end()
    block_grads = ("block_dq", "block_dk", "block_dv") if "block_dq" in m.sizes else ()
    m.free("kv", *block_grads, *(("sent",) if "sent" in m.sizes else ()))
    return _Call(m.peak, (("dq", m.sizes["dq"]), ("dkv", m.sizes["arrived"])))


@functools.lru_cache(maxsize=_MEMO_SIZE)
def _ring_backward_step(d: Dims, heads: int, kv_heads: int, block: _Block, state: _State, *, last: bool) -> _Step:
    """One step of :func:`_ring_backward` from ``state`` (the K/V block ``kv``, ``dq``, the previous
    step's block gradients ``block_d{q,k,v}``, the accumulator ``sent`` last step and the one that
    ``arrived``): the next block arrives, the step's accumulator is made, the kernels' gradients on
    ``block``, then the accumulator goes on while the next one arrives. Memoised like the forward's."""
    t, b, hn, acc = d.t, d.b, d.hn, d.acc
    kv_bytes = 2 * b * kv_heads * t * hn * d.e
    kv_acc = kv_bytes // d.e * acc
    m = _Memory(**dict(state))
    if not last:
        m.alloc(kv_next=kv_bytes)
    m.alloc(dkv=kv_acc)
    if block:
        new_block = ("new_dq", "new_dk", "new_dv")
        if block == ((t, t),):
            _kernel_backward(m, d, new_block, heads, kv_heads, t, t)
        else:
            m.alloc(**dict(zip(new_block, (b * heads * t * hn * acc, kv_acc / 2, kv_acc / 2))))
            for rows, cols in block:
                m.alloc(seg_lse=b * heads * rows * acc)  # a contiguous slice
                _kernel_backward(m, d, ("seg_dq", "seg_dk", "seg_dv"), heads, kv_heads, rows, cols)
                m.free("seg_lse", "seg_dq", "seg_dk", "seg_dv")
        if "block_dq" in m.sizes:
            m.free("block_dq", "block_dk", "block_dv")
        m.rename(new_dq="block_dq", new_dk="block_dk", new_dv="block_dv")
    if "sent" in m.sizes:  # the accumulator sent last step: released once its send completed
        m.free("sent")
    if d.p == 1:
        m.rename(dkv="arrived")
    else:
        m.alloc(dkv_in=kv_acc)
        if "arrived" in m.sizes:
            m.free("arrived")
        m.rename(dkv="sent", dkv_in="arrived")
    if not last:
        m.free("kv")
        m.rename(kv_next="kv")
    return _Step(m.peak, m.state())


def _activation_forward(m: _Memory, d: Dims, rows: int, units: int) -> tuple[str, ...]:
    """``activate`` on ``[rows, b, g units]`` (``fc1_out``, alive): the activation's output, gated:
    the gate's activation and the product. Returns them, the output last."""
    nbytes = rows * d.b * units * d.e
    if not d.shape.gated_mlp:
        m.alloc(act_out=nbytes)
        return ("act_out",)
    m.alloc(act_gate=nbytes, act_out=nbytes)
    return "act_gate", "act_out"


def _activation_backward(
    m: _Memory, d: Dims, rows: int, units: int, *, d_act: str | None, fc1_out: str | None, act_gate: str | None
) -> str:
    """The activation's backward: releases ``act_gate`` (gated: kept by the product) and, unless None
    (the caller holds them), ``d_act`` and ``fc1_out``; leaves ``d_fc1_out``. Gated: both factors'
    gradients, each gate/up half scattered into a zero ``[rows, b, 2 units]`` tensor (``select``'s
    backward), then summed."""
    nbytes = rows * d.b * units * d.e
    given = {"d_act": d_act, "fc1_out": fc1_out}
    release = {name: (value,) if value else () for name, value in given.items()}
    if not d.shape.gated_mlp:
        m.alloc(d_fc1_out=nbytes)
        m.free(*release["d_act"], *release["fc1_out"])
        return "d_fc1_out"
    m.alloc(d_up=nbytes, d_gate_act=nbytes)  # mul's backward
    m.free(*release["d_act"], act_gate)
    m.alloc(d_up_full=2 * nbytes)
    m.free("d_up")
    m.alloc(d_gate=nbytes)  # the activation's backward
    m.free("d_gate_act", *release["fc1_out"])
    m.alloc(d_gate_full=2 * nbytes)
    m.free("d_gate")
    m.alloc(d_fc1_out=2 * nbytes)
    m.free("d_up_full", "d_gate_full")
    return "d_fc1_out"


# -- attention ------------------------------------------------------------------------------------
def _tp_sp_attention(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    s, b, e, p = d.s, d.b, d.e, d.p
    heads, kv_heads = d.nq // p, d.ng // p
    x_full, core = s * b * d.h * e, s * b * heads * d.hn * e

    fwd = _Memory(x_local=d.x)
    _sequence_parallel_forward(fwd, d, "qkv_out", s * b * d.qkv // p * e)
    kept, core_name = _full_attention_forward(fwd, d, layout, "qkv_out", heads, kv_heads)
    fwd.alloc(y_partial=x_full)  # linear_proj, before the sum over ranks
    if p > 1:
        fwd.alloc(y_reduced=d.x)
    fwd.alloc(y_local=d.x)  # + bias
    proj_input = () if core_name in kept else (core_name,)  # kept by linear_proj
    saved = fwd.returns("y_local", "x_local", *kept, *proj_input)

    bwd = _Memory(dy_local=0.0, **saved)
    _row_parallel_backward(bwd, d, "d_core", core, d.h * d.a // p * e, release=proj_input)
    d_qkv = _full_attention_backward(bwd, d, layout, "d_core", kept, heads, kv_heads)
    _sequence_parallel_backward(bwd, d, d_qkv, d.qkv // p * d.h * e, d.qkv // p * e)
    return SublayerTerms(
        gemms=(Gemm(s * b, d.qkv // p, d.h), Gemm(s * b, d.h, d.a // p)),
        attention=attention_calls(layout, b, heads, d.hn),
        fwd_comm=(Collective("all_gather", x_full), Collective("reduce_scatter", x_full)),
        # sequence_parallel_linear gathers its input again for the weight gradient
        bwd_comm=(
            Collective("all_gather", x_full),
            Collective("reduce_scatter", x_full),
            Collective("all_gather", x_full),
        ),
        elementwise_bytes=2 * (s * b * d.qkv // p * e) * (2 if layout.causal else 1) + 4 * core,
        **_memory(fwd.peak, bwd, saved).fields(),
    )


def _ulysses_attention(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    t, b, e, p = d.t, d.b, d.e, d.p
    heads, kv_heads = d.nq // p, d.ng // p
    w_qkv, w_proj = d.qkv * d.h * e, d.h * d.a * e
    qkv_local = t * b * d.qkv * e  # = [s, b, qkv/p] after the all-to-all
    core_local = t * b * d.a * e  # = [s, b, a/p] before it

    fwd = _Memory(x_local=d.x)
    _zero3_forward(fwd, d, "qkv", "qkv_local", qkv_local, w_qkv, bias=d.qkv * e)
    fwd.alloc(a2a_send=qkv_local, qkv_full=qkv_local)  # sequence -> heads: a permuted send copy, the receive
    fwd.free("a2a_send")
    kept, _ = _full_attention_forward(fwd, d, layout, "qkv_full", heads, kv_heads)
    fwd.alloc(a2a_recv=core_local, core_local=core_local)  # heads -> sequence: the receive, then permuted
    fwd.free("a2a_recv")
    _zero3_forward(fwd, d, "proj", "proj_out", d.x, w_proj, row=True)
    fwd.alloc(y_local=d.x)
    saved = fwd.returns("y_local", "x_local", *kept, "core_local")

    bwd = _Memory(dy_local=0.0, **saved)
    _zero3_backward(bwd, d, "proj", "d_core_local", core_local, w_proj, row=True, release=("core_local",))
    bwd.alloc(a2a_send=core_local, d_core=core_local)
    bwd.free("a2a_send", "d_core_local")
    d_qkv = _full_attention_backward(bwd, d, layout, "d_core", kept, heads, kv_heads)
    bwd.alloc(a2a_recv=qkv_local, d_qkv_local=qkv_local)
    bwd.free("a2a_recv", d_qkv)
    _zero3_backward(bwd, d, "qkv", "dx_local", d.x, w_qkv, bias=d.qkv * e, release=("d_qkv_local", "x_local"))
    return SublayerTerms(
        gemms=(Gemm(t * b, d.qkv, d.h), Gemm(t * b, d.h, d.a)),
        attention=attention_calls(layout, b, heads, d.hn),
        fwd_comm=(
            Collective("all_gather", w_qkv),
            Collective("all_to_all", qkv_local),
            Collective("all_to_all", core_local),
            Collective("all_gather", w_proj),
        ),
        # zero3_linear gathers each weight again for its backward
        bwd_comm=(
            Collective("all_gather", w_proj),
            Collective("reduce_scatter", w_proj),
            Collective("all_to_all", core_local),
            Collective("all_to_all", qkv_local),
            Collective("all_gather", w_qkv),
            Collective("reduce_scatter", w_qkv),
        ),
        elementwise_bytes=4 * qkv_local * (2 if layout.causal else 1) + 6 * core_local,
        **_memory(fwd.peak, bwd, saved).fields(),
    )


def _ring_attention(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    t, b, e, p = d.t, d.b, d.e, d.p
    w_qkv, w_proj = d.qkv * d.h * e, d.h * d.a * e
    core_local = t * b * d.a * e
    steps = _ring_steps(layout, rank)
    blocks = tuple(map(_block, steps))
    memory = _ring_attention_memory(d, _ring_forward(d, blocks, d.nq, d.ng), _ring_backward(d, blocks, d.nq, d.ng))
    ring = _ring_stage(steps, d, d.nq, d.ng)
    out_acc = t * b * d.a * d.acc
    return SublayerTerms(
        gemms=(Gemm(t * b, d.qkv, d.h), Gemm(t * b, d.h, d.a)),
        rings=(ring,),
        fwd_comm=(Collective("all_gather", w_qkv), Collective("all_gather", w_proj)),
        bwd_comm=(
            Collective("all_gather", w_proj),
            Collective("reduce_scatter", w_proj),
            Collective("all_gather", w_qkv),
            Collective("reduce_scatter", w_qkv),
        ),
        # per step: the block's partial output and lse merged into the running ones
        elementwise_bytes=p * 8 * out_acc + 4 * core_local + 2 * ring.hop.nbytes,
        **memory.fields(),
    )


@functools.lru_cache(maxsize=_MEMO_SIZE)
def _ring_attention_memory(d: Dims, ring_forward: _Call, ring_backward: _Call) -> _SublayerMemory:
    """``ring`` attention's memory around the rank's ring forward and backward (which ranks often
    share: memoised): the projections' ZeRO-3 gathers, q's copy, the output permuted."""
    e = d.e
    w_qkv, w_proj = d.qkv * d.h * e, d.h * d.a * e
    qkv_local, core_local = d.t * d.b * d.qkv * e, d.t * d.b * d.a * e
    q_copy = ("q_copy",) if d.q_copied(d.ng) else ()

    fwd = _Memory(x_local=d.x)
    _zero3_forward(fwd, d, "qkv", "qkv_local", qkv_local, w_qkv, bias=d.qkv * e)
    if q_copy:
        fwd.alloc(q_copy=core_local)
    fwd.call(ring_forward)
    fwd.alloc(core=core_local)  # [s/p, b, nq hn]: the output permuted
    _zero3_forward(fwd, d, "proj", "proj_out", d.x, w_proj, row=True)
    fwd.alloc(y_local=d.x)
    # q, k, v are views of the projection (and the q copy)
    saved = fwd.returns("y_local", "x_local", "qkv_local", *q_copy, "out", "lse", "core")

    bwd = _Memory(dy_local=0.0, **saved)
    _zero3_backward(bwd, d, "proj", "d_core", core_local, w_proj, row=True, release=("core",))
    bwd.call(ring_backward)
    bwd.free("d_core", "qkv_local", *q_copy, "out", "lse")
    bwd.alloc(d_qkv_local=qkv_local)
    bwd.free("dq", "dkv")
    _zero3_backward(bwd, d, "qkv", "dx_local", d.x, w_qkv, bias=d.qkv * e, release=("d_qkv_local", "x_local"))
    return _memory(fwd.peak, bwd, saved)


def _lean_attention(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    """Head group ``j`` (``nq/p`` heads, ``ng/p`` groups): its shard broadcast by rank ``j`` (the next
    one in flight), its q/k/v projected, ring attention, ``y += core_j proj_j^T``; backward
    broadcasts again, recomputes q/k/v, runs the ring backward and reduces the shard's gradient to
    its owner while the next group runs."""
    t, b, e, p = d.t, d.b, d.e, d.p
    heads, kv_heads = d.nq // p, d.ng // p
    qkv_rows = d.qkv // p
    shard = _lean_attention_sizes(d)[0]

    steps = _ring_steps(layout, rank)
    blocks = tuple(map(_block, steps))
    fwd_peak, kept = _lean_attention_forward(d, _ring_forward(d, blocks, heads, kv_heads))
    saved = dict(kept)
    ring_backward = _ring_backward(d, blocks, heads, kv_heads)
    start = _Memory(dy_local=0.0, saved=sum(saved.values()))
    start.alloc(dx_local=d.x, shard=shard)  # dx accumulates group by group
    loop = _Loop(start)
    for j in range(p):
        loop.step(_lean_attention_backward_group(d, ring_backward, loop.state, last=j + 1 == p, own=j == rank))
    bwd = loop.end()
    # the function's backward returns; the shard gradient is accumulated
    bwd.free("shard_prev", *(("reducing",) if "reducing" in bwd.sizes else ()), "saved", "own")
    ring = _ring_stage(steps, d, heads, kv_heads)
    # the first shard's broadcast (and the last gradient's reduce) are waited for; the others run
    # while a group computes
    broadcast, reduce = Collective("broadcast", shard), Collective("reduce", shard)
    return SublayerTerms(
        gemms=(Gemm(t * b, qkv_rows, d.h), Gemm(t * b, d.h, d.a // p)) * p,
        recompute_gemms=(Gemm(t * b, qkv_rows, d.h),) * p,
        rings=(ring,) * p,
        fwd_comm=(broadcast,) if p > 1 else (),
        fwd_streamed=(broadcast,) * (p - 1),
        bwd_comm=(broadcast, reduce) if p > 1 else (),
        bwd_streamed=(broadcast, reduce) * (p - 1),
        # per group and step a merge, the output copied to rows, the shard packed
        elementwise_bytes=p * 8 * t * b * d.a * d.acc + 2 * t * b * d.a * e + 2 * shard,
        **_memory(fwd_peak, bwd, saved).fields(),
    )


def _lean_attention_sizes(d: Dims) -> tuple[int, int, int, bool]:
    """``lean`` attention's shard message (qkv rows, proj columns, qkv bias), one group's QKV
    projection and core output, and whether q is copied out of the projection."""
    heads, kv_heads, qkv_rows = d.nq // d.p, d.ng // d.p, d.qkv // d.p
    shard = (qkv_rows * d.h + d.h * d.a // d.p + qkv_rows) * d.e
    return shard, d.t * d.b * qkv_rows * d.e, d.t * d.b * heads * d.hn * d.e, d.q_copied(kv_heads)


@functools.lru_cache(maxsize=_MEMO_SIZE)
def _lean_attention_forward(d: Dims, ring_forward: _Call) -> tuple[float, _State]:
    """``lean`` attention's forward: its high-water mark and what it saves (each group's ring
    output and log-sum-exp). It depends on the rank only through ``ring_forward`` (the same for
    every group), which ranks often share: memoised."""
    shard, qkv_group, core_group, copies_q = _lean_attention_sizes(d)
    p = d.p
    fwd = _Memory(x_local=d.x)
    fwd.alloc(y_sum=d.x, shard0=shard)
    for j in range(p):
        if j:
            fwd.free(f"shard{j - 1}")
        if j + 1 < p:
            fwd.alloc(**{f"shard{j + 1}": shard})
        fwd.alloc(qkv=qkv_group)
        if copies_q:
            fwd.alloc(q_copy=core_group)
        fwd.call(ring_forward, prefix=f"g{j}_")
        fwd.temporary(core_rows=core_group)  # the output as [t b, heads hn] for y.addmm_
        fwd.free("qkv", *(("q_copy",) if copies_q else ()))
    fwd.free(f"shard{p - 1}")
    fwd.alloc(y_local=d.x)
    saved = fwd.returns("y_local", "x_local", *(f"g{j}_{name}" for j in range(p) for name, _ in ring_forward.leaves))
    return fwd.peak, tuple(saved.items())


@functools.lru_cache(maxsize=_MEMO_SIZE)
def _lean_attention_backward_group(d: Dims, ring_backward: _Call, state: _State, *, last: bool, own: bool) -> _Step:
    """Head group ``j`` of ``lean`` attention's backward from ``state`` (what the forward saved, as
    one, the input gradient, the previous group's shard ``shard_prev`` and this one's ``shard``, the
    gradient still being reduced and the rank's ``own``): the next shard arrives, the group's
    gradient is made, q/k/v recomputed, the ring backward; the previous gradient's reduce completes
    (not the rank's own, kept until the end) and this one's begins. ``own``: the group is the rank's."""
    shard, qkv_group, core_group, copies_q = _lean_attention_sizes(d)
    m = _Memory(**dict(state))
    if "shard_prev" in m.sizes:
        m.free("shard_prev")
    if not last:
        m.alloc(shard_next=shard)
    m.alloc(grad=shard)
    m.temporary(core_rows=core_group)  # for the proj gradient
    m.alloc(dout=core_group, qkv=qkv_group)  # dy proj_j, the recomputed projection
    if copies_q:
        m.alloc(q_copy=core_group)
    m.call(ring_backward)
    m.alloc(d_qkv=qkv_group)  # qkv.grad, through split (and qk_transform)
    m.free("dout", "qkv", *(("q_copy",) if copies_q else ()), "dq", "dkv", "d_qkv")
    if "reducing" in m.sizes:
        m.free("reducing")  # its reduce is complete
    m.rename(grad="own" if own else "reducing", shard="shard_prev")
    if not last:
        m.rename(shard_next="shard")
    return _Step(m.peak, m.state())


# -- MLP ------------------------------------------------------------------------------------------
def _tp_sp_mlp(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    s, b, e, p = d.s, d.b, d.e, d.p
    x_full, units = s * b * d.h * e, d.f // p

    fwd = _Memory(x_local=d.x)
    _sequence_parallel_forward(fwd, d, "fc1_out", s * b * d.f1 // p * e)
    act = _activation_forward(fwd, d, s, units)
    fwd.alloc(y_partial=x_full)
    if p > 1:
        fwd.alloc(y_reduced=d.x)
    fwd.alloc(y_local=d.x)
    saved = fwd.returns("y_local", "x_local", "fc1_out", *act)

    bwd = _Memory(dy_local=0.0, **saved)
    _row_parallel_backward(bwd, d, "d_act", s * b * units * e, d.h * units * e, release=(act[-1],))
    gate = act[0] if len(act) > 1 else None
    d_fc1 = _activation_backward(bwd, d, s, units, d_act="d_act", fc1_out="fc1_out", act_gate=gate)
    _sequence_parallel_backward(bwd, d, d_fc1, d.f1 // p * d.h * e, d.f1 // p * e)
    return SublayerTerms(
        gemms=(Gemm(s * b, d.f1 // p, d.h), Gemm(s * b, d.h, units)),
        fwd_comm=(Collective("all_gather", x_full), Collective("reduce_scatter", x_full)),
        # sequence_parallel_linear gathers its input again for the weight gradient
        bwd_comm=(
            Collective("all_gather", x_full),
            Collective("reduce_scatter", x_full),
            Collective("all_gather", x_full),
        ),
        elementwise_bytes=3 * s * b * d.f1 // p * e,
        **_memory(fwd.peak, bwd, saved).fields(),
    )


def _zero3_mlp(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    t, b, e = d.t, d.b, d.e
    w1, w2 = d.f1 * d.h * e, d.h * d.f * e

    fwd = _Memory(x_local=d.x)
    _zero3_forward(fwd, d, "fc1", "fc1_out", t * b * d.f1 * e, w1, bias=d.f1 * e)
    act = _activation_forward(fwd, d, t, d.f)
    _zero3_forward(fwd, d, "fc2", "fc2_out", d.x, w2, row=True)
    fwd.alloc(y_local=d.x)
    saved = fwd.returns("y_local", "x_local", "fc1_out", *act)

    bwd = _Memory(dy_local=0.0, **saved)
    _zero3_backward(bwd, d, "fc2", "d_act", t * b * d.f * e, w2, row=True, release=(act[-1],))
    gate = act[0] if len(act) > 1 else None
    d_fc1 = _activation_backward(bwd, d, t, d.f, d_act="d_act", fc1_out="fc1_out", act_gate=gate)
    _zero3_backward(bwd, d, "fc1", "dx_local", d.x, w1, bias=d.f1 * e, release=(d_fc1, "x_local"))
    return SublayerTerms(
        gemms=(Gemm(t * b, d.f1, d.h), Gemm(t * b, d.h, d.f)),
        fwd_comm=(Collective("all_gather", w1), Collective("all_gather", w2)),
        # zero3_linear gathers each weight again for its backward
        bwd_comm=(
            Collective("all_gather", w2),
            Collective("reduce_scatter", w2),
            Collective("all_gather", w1),
            Collective("reduce_scatter", w1),
        ),
        elementwise_bytes=3 * t * b * d.f1 * e,
        **_memory(fwd.peak, bwd, saved).fields(),
    )


def _lean_mlp(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    """The fc1/fc2 shards circulate (at step ``i`` rank ``r`` holds shard ``r - i``, the next one
    arriving): ``y += act(x fc1_j^T + b1_j) fc2_j^T``; backward circulates them again, recomputes the
    intermediate, and each shard's gradient accumulator travels with it back to its owner."""
    t, b, e, p = d.t, d.b, d.e, d.p
    units = d.f // p
    shard = (d.f1 // p * d.h + d.h * units + d.f1 // p) * e  # fc1 rows, fc2 columns, fc1 bias: one message
    pre = t * b * d.f1 // p * e

    fwd = _Memory(x_local=d.x)
    fwd.alloc(y_sum=d.x, shard0=shard)
    for step in range(p):
        if step + 1 < p:
            fwd.alloc(**{f"shard{step + 1}": shard})
        fwd.alloc(fc1_out=pre)
        act = _activation_forward(fwd, d, t, units)
        fwd.free("fc1_out", *act)  # after y.addmm_
        fwd.free(f"shard{step}")
    fwd.alloc(y_local=d.x)
    saved = fwd.returns("y_local", "x_local")

    bwd = _Memory(dy_local=0.0, **saved)
    bwd.alloc(dx_local=d.x, shard0=shard)  # dx accumulates shard by shard
    arrived = sent = None
    for step in range(p):
        if step + 1 < p:
            bwd.alloc(**{f"shard{step + 1}": shard})
        grad = f"grad{step}"
        bwd.alloc(**{grad: shard, "fc1_out": pre})
        act = _activation_forward(bwd, d, t, units)  # recomputed
        bwd.alloc(d_act=t * b * units * e)  # dy fc2_j
        gate = act[0] if len(act) > 1 else None
        d_fc1 = _activation_backward(bwd, d, t, units, d_act=None, fc1_out=None, act_gate=gate)
        bwd.free("d_act", act[-1], "fc1_out", d_fc1)  # when autograd.grad and the step return
        if sent is not None:  # the accumulator sent last step: released once its send completed
            bwd.free(sent)
        if p > 1:
            bwd.alloc(**{f"arrived{step}": shard})
            if arrived is not None:
                bwd.free(arrived)
            arrived, sent = f"arrived{step}", grad
            if step + 1 < p:
                bwd.free(f"shard{step}")
        else:
            arrived = grad
    bwd.free(f"shard{p - 1}", *((sent,) if sent else ()), "x_local", arrived)
    hop = Collective("send_recv", shard)
    return SublayerTerms(
        gemms=(Gemm(t * b, d.f1 // p, d.h), Gemm(t * b, d.h, units)) * p,
        recompute_gemms=(Gemm(t * b, d.f1 // p, d.h),) * p,
        fwd_streamed=(hop,) * (p - 1),
        # the shards' hops and the accumulators' but the last, waited for at the end
        bwd_comm=(hop,) if p > 1 else (),
        bwd_streamed=(hop,) * (2 * p - 2),
        elementwise_bytes=3 * t * b * d.f1 * e + 2 * shard,
        **_memory(fwd.peak, bwd, saved).fields(),
    )


_ATTENTION: dict[str, Callable[[Dims, SequenceLayout, int], SublayerTerms]] = {
    "tp_sp": _tp_sp_attention,
    "ulysses": _ulysses_attention,
    "ring": _ring_attention,
    "lean": _lean_attention,
}
RANK_DEPENDENT = frozenset({"ring", "lean"})
"""Attention strategies whose per-rank work and memory depend on the rank (which ring blocks it
sees; which shard gradient it keeps). MLP strategies' terms are the same on every rank."""
_MLP: dict[str, Callable[[Dims, SequenceLayout, int], SublayerTerms]] = {
    "tp_sp": _tp_sp_mlp,
    "zero3": _zero3_mlp,
    "lean": _lean_mlp,
}


def supported_options() -> tuple[list[str], list[str]]:
    """(attention strategies, MLP strategies) that have terms."""
    return list(_ATTENTION), list(_MLP)


def sublayer_terms(
    sublayer: Literal["attention", "mlp"], name: str, d: Dims, layout: SequenceLayout, rank: int = 0
) -> SublayerTerms:
    table = _ATTENTION if sublayer == "attention" else _MLP
    if name not in table:
        raise ValueError(f"no cost terms for {sublayer} strategy {name!r}; known: {', '.join(table)}")
    return table[name](d, layout, rank)


def _with_rotary(attn: SublayerTerms, strategy: str, d: Dims, layout: SequenceLayout) -> SublayerTerms:
    """RoPE as Megatron applies it (``apply_rotary_pos_emb``, unfused): for q and for k, ``cos`` and
    ``sin`` of the rows' angles ``[rows, 1, 1, rotary_dim]``, kept by the products until backward, and
    the rotated q and k (new tensors) where the attention keeps them instead of views of the QKV
    projection: ``ring`` always, ``tp_sp``/``ulysses`` when no reordering copies them (contiguous
    layouts). Rows: the whole sequence where heads are split (``tp_sp``, ``ulysses``), the local
    tokens for ``ring``; ``lean`` rotates inside its own forward and rebuilds in backward. Backward
    through the rotation adds about three q-sized temporaries (the two products' gradients and the
    rotated half's) beside the attention's input gradients."""
    if not d.rotary_dim or strategy not in ("tp_sp", "ulysses", "ring"):
        return attn
    rows, heads = (d.t, d.nq + d.ng) if strategy == "ring" else (d.s, (d.nq + d.ng) // d.p)
    kept = {"rope_cos_sin": 4 * rows * d.rotary_dim * d.e}
    if strategy == "ring" or layout.is_identity:
        kept["rope_qk"] = rows * d.b * heads * d.hn * d.e
    rotation_grads = 3 * d.t * d.b * d.a * d.e  # t * nq == s * nq / p: the same for every strategy
    return dataclasses.replace(attn, saved={**attn.saved, **kept}, bwd_peak=attn.bwd_peak + rotation_grads)


@dataclasses.dataclass(frozen=True, slots=True)
class LayerTerms:
    """A whole layer (``x + attn(LN1(x))``, ``+ mlp(LN2(.))``) under one option."""

    attention: SublayerTerms
    mlp: SublayerTerms
    recompute: bool
    activation_bytes: float
    """One ``[t, b, h]`` activation (the layer's input, output, residual)."""
    saved_bytes: float
    """Kept from the layer's forward to its backward (with recompute: its output only)."""
    peak_bytes: float
    """High-water mark over forward (+ recompute) and backward, above the layer's input."""

    @property
    def transient_bytes(self) -> float:
        return self.peak_bytes - self.saved_bytes


def layer_terms(option: LayerOption, d: Dims, layout: SequenceLayout, rank: int = 0) -> LayerTerms:
    """Terms of one layer on ``rank``: :func:`compose_layer` of its sublayers' terms."""
    attn = attention_terms(option.attention, d, layout, rank)
    mlp = sublayer_terms("mlp", option.mlp, d, layout, rank)
    return compose_layer(attn, mlp, d, recompute=option.recompute)


def attention_terms(name: str, d: Dims, layout: SequenceLayout, rank: int = 0) -> SublayerTerms:
    """The attention sublayer as the layer runs it: the strategy's terms with RoPE's."""
    return _with_rotary(sublayer_terms("attention", name, d, layout, rank), name, d, layout)


def compose_layer(attn: SublayerTerms, mlp: SublayerTerms, d: Dims, *, recompute: bool) -> LayerTerms:
    """A layer's terms from its sublayers' (:func:`attention_terms`, :func:`sublayer_terms`)."""
    return LayerTerms(attn, mlp, recompute, d.x, *layer_memory(attn, mlp, d).saved_and_peak(recompute=recompute))


@dataclasses.dataclass(frozen=True, slots=True)
class LayerMemory:
    """A layer's memory with and without recompute (:func:`layer_memory`)."""

    activation_bytes: float
    """One ``[t, b, h]`` activation: all a layer keeps with recompute (its output)."""
    saved_bytes: float
    """Kept from the layer's forward to its backward, without recompute."""
    peak_bytes: float
    """High-water mark over forward and backward, above the layer's input, without recompute."""
    recompute_peak_bytes: float
    """The same with recompute: over the rebuilt forward and the backward."""

    def saved_and_peak(self, *, recompute: bool) -> tuple[float, float]:
        if recompute:
            return self.activation_bytes, self.recompute_peak_bytes
        return self.saved_bytes, self.peak_bytes


def layer_memory(attn: SublayerTerms, mlp: SublayerTerms, d: Dims) -> LayerMemory:
    """A layer's memory from its sublayers' between the layer's own tensors, with and without recompute.

    Forward: LN1 (output and statistics), the attention, the residual ``x1``, LN2, the MLP, the
    output. Backward from the output's gradient (the next layer's or the loss's: not counted here):
    the MLP, LN2's backward, the residual's summed gradient, the attention, LN1's. Recompute keeps
    only the output; its forward keeps nothing, and the backward first reruns the whole layer (beside
    the output), then runs as without recompute.
    """
    x, stats = d.x, 2 * d.t * d.b * d.acc  # LayerNorm keeps its mean and rstd

    def forward(m: _Memory, sub: SublayerTerms, prefix: str, peak: float) -> None:
        """On ``{prefix}x_local``: the high-water mark ``peak`` (the input in it), then what it keeps
        and its output."""
        m.free(f"{prefix}x_local")
        m.call(_Call(peak, (("saved", sub.saved_bytes), ("y_local", x))), prefix)

    def backward(m: _Memory, sub: SublayerTerms, prefix: str) -> None:
        m.peak = max(m.peak, m.live + sub.bwd_peak)
        m.free(f"{prefix}saved")
        m.alloc(**{f"{prefix}dx_local": x})

    m = _Memory(ln1_stats=stats, **{"attn.x_local": x})
    forward(m, attn, "attn.", attn.fwd_peak)
    m.alloc(x1=x)
    m.free("attn.y_local")
    m.alloc(ln2_stats=stats, **{"mlp.x_local": x})
    forward(m, mlp, "mlp.", mlp.fwd_peak)
    m.alloc(output=x)
    m.free("mlp.y_local")
    saved, forward_peak = m.live, m.peak
    # recompute reruns this forward to the layer's end (no early stop), beside the first one's output
    rebuilt_peak = x + forward_peak
    m.peak = m.live  # the backward's high-water mark from here
    backward(m, mlp, "mlp.")
    m.alloc(ln2_dx=x)
    m.free("mlp.dx_local", "x1", "ln2_stats")
    m.alloc(attn_dy=x)  # the output's gradient plus LN2's
    m.free("ln2_dx")
    backward(m, attn, "attn.")
    m.alloc(ln1_dx=x)
    m.free("attn.dx_local", "ln1_stats")
    m.alloc(dx=x)
    return LayerMemory(x, saved, max(forward_peak, m.peak), max(rebuilt_peak, m.peak))
