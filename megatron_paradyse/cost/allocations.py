"""What one rank's tensors cost in memory, for one sublayer or layer under one option: allocation scripts.

Each strategy's forward and backward are written here as the tensors its code allocates and frees, in
its order (``strategies/`` and ``attention/blocks.py``), in the sizes of :class:`Dims`: activations and
weights in their element size ``e``, accumulators (ring attention's running output, log-sum-exp,
weight gradients summed over ranks) in the accumulation element size ``acc`` (fp32 for half
precision). A script gives what stays for backward (``saved``) and the high-water marks, which
:func:`layer_memory` composes with the layer's own tensors (norms, residuals) and recompute.

The scripts are checked, not trusted: ``tests/ranks/test_memory_scripts.py`` runs every strategy's real code
on gloo ranks over the matrix of dtypes, group sizes, masks, packings, head layouts and MLPs, and
compares every rank's allocations with these scripts (saved bytes exactly, peaks exactly); a script
that drifts from its strategy's code fails there.

The planner prices every option on every rank: loops that ranks repeat (ring steps, ``lean``'s head
groups) are scripted per iteration and memoised by what an iteration depends on (the tensors alive
at its start, the block it sees), so each distinct iteration is scripted once per micro-batch shape.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal

from megatron_paradyse.attention.kernels import EFFICIENT_LSE_ROWS
from megatron_paradyse.core.layout import Segment, SequenceLayout
from megatron_paradyse.core.plan import mlp_tile_rows
from megatron_paradyse.strategies import ModelShape

__all__ = [
    "RANK_DEPENDENT",
    "Dims",
    "LayerMemory",
    "SublayerMemory",
    "layer_memory",
    "norm_peak",
    "ring_steps",
    "sublayer_memory",
]

_MEMO_SIZE = 1024
"""Entries kept by each memoised script: one planner decision makes a few dozen; earlier micro-batch
shapes' fall out."""


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
    bias: bool = True
    """The linear layers have biases (GPT-2 style; LLaMA has none)."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """The layer's norms (Megatron's ``config.normalization``)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the layer runs: norms keep other tensors on each (see :func:`_norm_forward`)."""
    grads_held: bool = False
    """Autograd holds the weight gradients the backward hands it (:meth:`_Memory.to_autograd`): the
    weights have other uses whose gradients are still to come, as the tiles of a tiled MLP have."""
    grads_before: tuple[float, ...] = ()
    """Weight gradients autograd holds from the weights' earlier uses when the backward starts, in the
    order the backward hands its own over (each is added to its weight's)."""
    mlp_weight_ahead: bool = False
    """The layer gathers its MLP's first weight during the attention
    (:func:`~megatron_paradyse.strategies.gathers_mlp_weight_ahead`): the attention starts that gather
    after its projection's and hands the weight on, the MLP's forward starts with it."""

    def __post_init__(self) -> None:
        if self.mlp_weight_ahead and self.p == 1:
            raise ValueError(
                "Dims(mlp_weight_ahead=True) needs p > 1: one rank gathers no weight, ahead or not "
                "(strategies.gathers_mlp_weight_ahead says where a layer gathers it)"
            )

    @property
    def acc(self) -> int:
        """Bytes per element of the accumulation dtype (log-sum-exp, ring accumulators, weight
        gradients summed over ranks): fp32 for half precision, the activations' own otherwise."""
        return max(self.e, 4)

    @property
    def half(self) -> bool:
        """Half-precision activations: accumulators are cast from and back to them."""
        return self.e < self.acc

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

    @property
    def norm_stats(self) -> int:
        """Bytes of the statistics one norm of ``[t, b]`` tokens keeps for its backward."""
        return self.norm_stats_of(self.t * self.b)

    def norm_stats_of(self, vectors: int) -> int:
        """Bytes of the statistics a norm of ``vectors`` vectors keeps for its backward: LayerNorm's mean
        and rstd (fp32 on CUDA, the input's dtype on the CPU), RMSNorm's rstd (fp32)."""
        if self.normalization == "LayerNorm":
            return 2 * vectors * (self.acc if self.device == "cuda" else self.e)
        return vectors * self.acc

    @property
    def qk_transformed(self) -> bool:
        """Queries and keys are transformed (RoPE, q/k norms) into tensors of their own."""
        return bool(self.rotary_dim) or self.shape.qk_norm

    def q_copied(self, groups: int) -> bool:
        """Whether ``split_qkv`` copies q out of a QKV tensor holding ``groups`` key/value groups: the
        query heads of a group are contiguous, so q is a view with one query head per group (MHA) or
        a single group, a copy otherwise."""
        return groups > 1 and self.shape.heads_per_group > 1


def ring_steps(layout: SequenceLayout, rank: int) -> tuple[tuple[Segment, ...], ...]:
    """The visible segments of each ring step of ``rank``: its queries against the keys of ``rank - step``."""
    return tuple(layout.ring_segments(rank, (rank - step) % layout.p) for step in range(layout.p))


# -- the bookkeeping ------------------------------------------------------------------------------
_State = tuple[tuple[str, float], ...]
"""Tensors alive (name, bytes), sorted by name: hashable, so that loop iterations can be memoised."""


class _Memory:
    """Tensors alive, by name, as code allocates and frees them: the bytes alive and their
    high-water mark. Names are unique while alive; freeing a name that is not alive is a bug in a
    script and raises ``KeyError``."""

    __slots__ = ("sizes", "live", "peak", "grads_held", "handed")

    def __init__(self, grads: Dims | None = None, /, **alive: float):
        """``grads``: the weight-gradient setting of :meth:`to_autograd` (:attr:`Dims.grads_held` and
        :attr:`Dims.grads_before`, whose gradients are alive from the start); none held without it."""
        before = {f"held:{i}": nbytes for i, nbytes in enumerate(grads.grads_before)} if grads else {}
        self.sizes: dict[str, float] = {**before, **alive}
        self.live = float(sum(self.sizes.values()))
        self.peak = self.live
        self.grads_held = grads is not None and grads.grads_held
        self.handed: list[float] = []

    def alloc(self, **tensors: float) -> None:
        sizes, live = self.sizes, self.live  # locals: the planner runs thousands of these per decision
        for name, nbytes in tensors.items():
            if name in sizes:
                raise ValueError(f"memory script: {name!r} is allocated twice")
            sizes[name] = float(nbytes)
            live += nbytes
            if live > self.peak:
                self.peak = live
        self.live = live

    def free(self, *names: str) -> None:
        sizes, live = self.sizes, self.live
        for name in names:
            live -= sizes.pop(name)
        self.live = live

    def to_autograd(self, *names: str) -> None:
        """Weight (and bias) gradients handed to autograd (their sizes recorded in :attr:`handed`).
        Autograd adds a weight's gradients from all its uses, out of place (a new tensor, then the two
        die), and the sum into ``.grad`` once the last has come: without :attr:`grads_held` the
        gradient (or sum) dies; with it, it waits in autograd's input buffer, alive to the end (as
        ``held:<i>``, the ``i``-th gradient handed over)."""
        for name in names:
            held = f"held:{len(self.handed)}"
            self.handed.append(self.sizes[name])
            if held in self.sizes:
                self.alloc(**{f"{held}+": self.sizes[name]})
                self.free(held, name)
                name = f"{held}+"
            if self.grads_held:
                self.rename(**{name: held})
            else:
                self.free(name)

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
class SublayerMemory:
    """One sublayer's memory on one rank, from its input ``x_local`` (alive at the start) to its
    output ``y_local``."""

    saved: _State
    """Kept from forward to backward, by tensor (the input too where the strategy keeps it; not the
    output)."""
    fwd_peak: float
    """Bytes alive at the forward's high-water mark, its input included."""
    bwd_peak: float
    """Bytes above the backward's start (what was saved, the output's gradient) at its high-water mark."""
    bwd_prelude: float = 0.0
    """Bytes the backward allocates, and still holds, before it first reads what the forward saved:
    with recompute, the layer is rebuilt on top of them."""
    grads_handed: tuple[float, ...] = ()
    """The weight (and bias) gradients the backward hands to autograd, in order (bytes)."""
    handed_on: float = 0.0
    """Bytes the forward leaves alive for the next sublayer beside its output: the MLP's first weight,
    gathered ahead (:attr:`Dims.mlp_weight_ahead`); the next sublayer's forward peak counts them."""

    @property
    def saved_bytes(self) -> float:
        return float(sum(nbytes for _, nbytes in self.saved))


def _sublayer(
    fwd_peak: float, bwd: _Memory, saved: dict[str, float], prelude: float = 0.0, handed_on: float = 0.0
) -> SublayerMemory:
    """A sublayer's memory from its forward's high-water mark and its backward, which must release
    everything saved and leave the input's gradient."""
    if {name for name in bwd.sizes if not name.startswith("held:")} != {"dy_local", "dx_local"}:
        raise AssertionError(f"memory script: backward ends with {sorted(bwd.sizes)} alive")
    backward_peak = bwd.peak - sum(saved.values())
    return SublayerMemory(tuple(saved.items()), fwd_peak, backward_peak, prelude, tuple(bwd.handed), handed_on)


# -- building blocks: one per function of the strategies' code ---------------------------------------
def _linear_backward(m: _Memory, dx: str, dx_bytes: float, w: float, bias: float, *, release: tuple[str, ...]) -> None:
    """``F.linear``'s own backward (a matmul; with a bias, an addmm): the input gradient ``dx`` and the
    weight's (and bias's) gradient, which autograd then accumulates into ``.grad``; then ``release``
    dies. Without a bias autograd makes the weight's gradient first, with one the input's."""
    grads = {"linear_dw": w, **({"linear_db": bias} if bias else {})}
    if bias:
        m.alloc(**{dx: dx_bytes}, **grads)
    else:
        m.alloc(**grads, **{dx: dx_bytes})
    m.free(*release)
    m.to_autograd(*grads)


def _bias_grad(m: _Memory, d: Dims, bias: bool) -> None:
    """``y + b`` for a replicated ``[h]`` bias: its gradient, the incoming one summed over tokens."""
    if bias:
        m.alloc(bias_grad=d.h * d.e)
        m.to_autograd("bias_grad")


def _gather_weight(m: _Memory, name: str, nbytes: float, *, row: bool, gathered: bool = False) -> str:
    """``zero3_linear``'s all-gathered weight (``gathered``: its gather started ahead, :class:`Zero3Gathers`,
    the buffer already alive); row-parallel shards arrive as ``[p, out, in/p]`` and are laid out as
    ``[out, in]`` (a copy). Returns the name of the full weight."""
    if not gathered:
        m.alloc(**{name: nbytes})
    if row:
        m.alloc(**{f"{name}_t": nbytes})
        m.free(name)
        return f"{name}_t"
    return name


def _gather_ahead(m: _Memory, d: Dims, name: str, nbytes: float) -> None:
    """:meth:`~megatron_paradyse.core.comm.Zero3Gathers.start`: linear ``name``'s weight, gathered ahead
    of its GEMM, alive from now on (nothing at ``p = 1``)."""
    if d.p > 1:
        m.alloc(**{f"{name}_w": nbytes})


def _gather_mlp_weight_ahead(m: _Memory, d: Dims) -> None:
    """:meth:`~megatron_paradyse.strategies.AttentionContext.start_mlp_gather`: the MLP's fc1 weight,
    where the layer gathers it during the attention."""
    if d.mlp_weight_ahead:
        _gather_ahead(m, d, "fc1", d.f1 * d.h * d.e)


def _mlp_weight_handed_on(m: _Memory, d: Dims) -> float:
    """The attention's forward is done: the MLP's weight gathered ahead lives on into the MLP (bytes)."""
    if not d.mlp_weight_ahead:
        return 0.0
    nbytes = m.sizes["fc1_w"]
    m.free("fc1_w")
    return nbytes


def _zero3_forward(
    m: _Memory,
    d: Dims,
    name: str,
    out: str,
    out_bytes: float,
    w: float,
    *,
    bias: float = 0.0,
    row: bool = False,
    gathered: bool = False,
    ahead: tuple[str, float] | None = None,
) -> None:
    """``out = zero3_linear(x, W, b)``: the weight (and a column bias) exist for the GEMM only; ``gathered``:
    the weight's gather was started ahead; ``ahead``: the next linear's weight (name, bytes), whose gather
    this one starts before its GEMM (:class:`~megatron_paradyse.core.comm.Zero3Gathers`)."""
    if d.p == 1:
        m.alloc(**{out: out_bytes})
        return
    if bias:
        m.alloc(**{f"{name}_b": bias})
    weight = _gather_weight(m, f"{name}_w", w, row=row, gathered=gathered)
    if ahead is not None:
        _gather_ahead(m, d, *ahead)
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
    gathered: bool = False,
) -> None:
    """``zero3_linear``'s backward: the weight gathered again (``gathered``: its gather was started
    ahead, :func:`_gather_ahead`; otherwise now) while the full weight gradient's GEMM runs; that
    gradient, in the accumulation dtype (a cast of the GEMM's result for half precision; row: laid out
    as ``[p, out, in/p]``, a copy), reduce-scattered to the shard while ``dx = dy W`` runs, alive until
    then, and the shard rounded back to its dtype; the bias's gradient likewise (summed straight into
    the accumulation dtype, waited for); then ``release`` (the incoming gradient, the saved input) and
    the shard gradients (accumulated into ``.grad``) die."""
    if d.p == 1:
        _linear_backward(m, dx, dx_bytes, w, bias, release=release)
        return
    if not gathered:
        m.alloc(**{f"{name}_w": w})
    w_acc = w / d.e * d.acc
    m.alloc(dw_full=w)
    if d.half:
        m.alloc(dw_acc=w_acc)
        m.free("dw_full")
        m.rename(dw_acc="dw_full")
    if row:
        m.alloc(dw_t=w_acc)
        m.free("dw_full")
        m.rename(dw_t="dw_full")
    m.alloc(dw_shard=w_acc / d.p)
    weight = _gather_weight(m, f"{name}_w", w, row=row, gathered=True)
    m.alloc(**{dx: dx_bytes})
    m.free(weight, "dw_full")
    if d.half:
        m.alloc(dw=w / d.p)
        m.free("dw_shard")
    else:
        m.rename(dw_shard="dw")
    grads = ("dw",)
    if bias:
        bias_acc = bias / d.e * d.acc
        m.alloc(db_full=bias_acc, db_shard=bias_acc / d.p)
        m.free("db_full")
        if d.half:
            m.alloc(db=bias / d.p)
            m.free("db_shard")
        else:
            m.rename(db_shard="db")
        grads = ("dw", "db")
    m.free(*release)
    m.to_autograd(*grads)


def _column_forward(m: _Memory, d: Dims, out: str, out_bytes: float, bias: bool) -> None:
    """``out`` from Megatron's column-parallel ``linear_qkv``/``linear_fc1`` (``tp_sp``) and its bias:
    the input all-gathered into Megatron's global buffer (held outside the layer), the GEMM's output,
    and with a bias their sum (a new tensor: Megatron's ``output + bias``, or the caller's for a bias
    the module returns). Autograd keeps ``x_local``."""
    m.alloc(**{out: out_bytes})
    if bias:
        m.alloc(column_biased=out_bytes)
        m.free(out)
        m.rename(column_biased=out)


def _column_backward(m: _Memory, d: Dims, dy: str, w: float, bias: float) -> None:
    """The column-parallel linear's backward from ``dy`` (Megatron's
    ``LinearWithGradAccumulationAndAsyncCommunication``): the input gathered again into the global
    buffer, the ``[s, b, h]`` input gradient, reduce-scattered to ``dx_local``, the weight's (and
    bias's) gradient; then the ``[s, b, h]`` gradient, ``dy``, the saved ``x_local`` and the weight
    gradients (accumulated into ``.grad``) die. At p=1 the input gradient is ``dx_local`` itself."""
    grads = {"column_dw": w, **({"column_db": bias} if bias else {})}
    if d.p == 1:
        m.alloc(dx_local=d.x, **grads)
        m.free(dy, "x_local")
    else:
        m.alloc(dx_full=d.s * d.b * d.h * d.e, dx_local=d.x, **grads)
        m.free("dx_full", dy, "x_local")
    m.to_autograd(*grads)


def _row_forward(m: _Memory, d: Dims, bias: bool) -> None:
    """Megatron's row-parallel ``linear_proj``/``linear_fc2`` (``tp_sp``): the GEMM's partial sums
    ``[s, b, h]`` and (p > 1) their reduce-scatter to ``[t, b, h]``, after which the partial sums die;
    then the bias the module returns, added (a new tensor). Leaves ``y_local``."""
    m.alloc(y_partial=d.s * d.b * d.h * d.e)
    out = "y_partial"
    if d.p > 1:
        m.alloc(y_reduced=d.x)
        m.free("y_partial")
        out = "y_reduced"
    if bias:
        m.alloc(y_local=d.x)
        m.free(out)
    else:
        m.rename(**{out: "y_local"})


def _gathered_gradient(d: Dims) -> float:
    """The all-gathered ``[s, b, h]`` output gradient with which ``tp_sp``'s backward starts (its
    reduce-scatter's backward, before the row-parallel linear reads its saved input)."""
    return d.s * d.b * d.h * d.e if d.p > 1 else 0.0


def _row_backward(m: _Memory, d: Dims, dx: str, dx_bytes: float, w: float, *, release: tuple[str, ...]) -> None:
    """The backward of Megatron's row-parallel linear (``tp_sp``): its reduce-scatter's backward
    all-gathers the output gradient to ``[s, b, h]`` (p > 1), then the input gradient ``dx`` and the
    weight's; then the gathered gradient, ``release`` (the saved input) and the weight gradient
    (accumulated into ``.grad``) die."""
    gathered = ("dy_full",) if d.p > 1 else ()
    if gathered:
        m.alloc(dy_full=_gathered_gradient(d))
    m.alloc(**{dx: dx_bytes}, row_dw=w)
    m.free(*gathered, *release)
    m.to_autograd("row_dw")


def _flash(d: Dims) -> bool:
    """Attention runs a fused half-precision kernel (``kernels.TorchCudaKernel``'s FlashAttention-2 or,
    on Hopper, cuDNN's, or flash-attn's, which allocate alike: the output, the log-sum-exp, the three
    gradients; measured against the CUDA allocator on an H200 with cuDNN's): native GQA, one
    variable-length call over packed documents. Elsewhere: repeated key heads; on CUDA in fp32,
    memory-efficient attention."""
    return d.device == "cuda" and d.half


def _lse_rows(d: Dims, rows: int) -> int:
    """Rows of a kernel's log-sum-exp: memory-efficient attention (CUDA, fp32) pads them to a multiple of
    :data:`~megatron_paradyse.attention.kernels.EFFICIENT_LSE_ROWS`; the caller's slice keeps the padded
    storage."""
    return -(-rows // EFFICIENT_LSE_ROWS) * EFFICIENT_LSE_ROWS if d.device == "cuda" and not d.half else rows


def _kernel_forward(m: _Memory, d: Dims, out: str, lse: str, heads: int, kv_heads: int, sq: int, sk: int) -> None:
    """One kernel call: ``out [b, heads, sq, hn]`` and its log-sum-exp; with GQA (but FlashAttention) the
    key/value heads are first repeated for their query heads (``_expand_kv``, for the call only)."""
    expand = heads != kv_heads and not _flash(d)
    expanded = {f"{out}_k": d.b * heads * sk * d.hn * d.e, f"{out}_v": d.b * heads * sk * d.hn * d.e}
    if expand:
        m.alloc(**expanded)
    m.alloc(**{out: d.b * heads * sq * d.hn * d.e, lse: d.b * heads * _lse_rows(d, sq) * d.acc})
    if expand:
        m.free(*expanded)


def _kernel_backward(
    m: _Memory, d: Dims, grads: tuple[str, str, str], heads: int, kv_heads: int, sq: int, sk: int
) -> None:
    """One kernel call's backward. FlashAttention: ``dq``, ``dk``, ``dv`` (the output gradient's copy
    and the repeated heads' gradients are the kernel's own). CPU: the output gradient made contiguous
    (a copy: it arrives as a permuted ``[s, b, heads, hn]``, contiguous only for one head of one sample,
    or one row), ``dq``, ``dk``, ``dv``; with GQA, ``dk``/``dv`` of the repeated heads, summed back to
    the key/value heads. CUDA in fp32: the log-sum-exp padded again (a copy), kept to the end, then
    as on the CPU without the output gradient's copy."""
    dq, dk, dv = grads
    q_bytes, k_bytes = d.b * heads * sq * d.hn * d.e, d.b * kv_heads * sk * d.hn * d.e
    expanded_bytes = d.b * heads * sk * d.hn * d.e
    if _flash(d):
        m.alloc(**{dq: q_bytes, dk: k_bytes, dv: k_bytes})
        return
    if d.device == "cuda":
        m.alloc(**{f"{dq}_lse": d.b * heads * _lse_rows(d, sq) * d.acc})
        _kernel_backward_expanded(m, grads, heads != kv_heads, q_bytes, k_bytes, expanded_bytes, ())
        m.free(f"{dq}_lse")
        return
    dout_copied = d.b * heads > 1 and sq > 1
    copies = (f"{dq}_dout",) if dout_copied else ()
    if dout_copied:
        m.alloc(**{f"{dq}_dout": q_bytes})
    _kernel_backward_expanded(m, grads, heads != kv_heads, q_bytes, k_bytes, expanded_bytes, copies)


def _kernel_backward_expanded(
    m: _Memory,
    grads: tuple[str, str, str],
    gqa: bool,
    q_bytes: float,
    k_bytes: float,
    expanded_bytes: float,
    copies: tuple[str, ...],
) -> None:
    """A backward on repeated key/value heads (with ``gqa``): the repeats, ``dq`` and their gradients,
    then the repeats and ``copies`` die and the gradients are summed back to the key/value heads."""
    dq, dk, dv = grads
    if not gqa:
        m.alloc(**{dq: q_bytes, dk: k_bytes, dv: k_bytes})
        m.free(*copies)
        return
    m.alloc(**{f"{dq}_k": expanded_bytes, f"{dq}_v": expanded_bytes})
    m.alloc(**{dq: q_bytes, f"{dk}_expanded": expanded_bytes, f"{dv}_expanded": expanded_bytes})
    m.free(*copies, f"{dq}_k", f"{dq}_v")
    m.alloc(**{dk: k_bytes, dv: k_bytes})
    m.free(f"{dk}_expanded", f"{dv}_expanded")


_Block = tuple[tuple[int, int], ...]
"""What a ring step's memory depends on: the (rows, columns) of each visible segment of the block."""


@functools.lru_cache(maxsize=_MEMO_SIZE)
def _block(segments: tuple[Segment, ...]) -> _Block:
    """The :data:`_Block` of a ring step's segments (memoised: ranks and steps repeat a few blocks)."""
    return tuple((seg.q_end - seg.q_start, seg.k_end - seg.k_start) for seg in segments)


def _merge(m: _Memory, d: Dims, heads: int, rows: int) -> None:
    """``merge_into`` of ``rows`` query rows: the new log-sum-exp, its shift and the two weights, each
    a ``[b, heads, rows]`` accumulator, for the in-place update only."""
    row = d.b * heads * rows * d.acc
    m.temporary(merge_lse=row, merge_shift=row, merge_w_old=row, merge_w_new=row)


def _accumulate_block(m: _Memory, d: Dims, block: _Block, heads: int, kv_heads: int) -> None:
    """``accumulate_block``: per visible segment a kernel call, merged into the running accumulators
    in place; each call's results die before the next call."""
    for rows, cols in block:
        _kernel_forward(m, d, "seg_out", "seg_lse", heads, kv_heads, rows, cols)
        _merge(m, d, heads, rows)
        m.free("seg_out", "seg_lse")


def _accumulate_block_grads(m: _Memory, d: Dims, block: _Block, heads: int, kv_heads: int, sq: int) -> None:
    """``accumulate_block_grads`` on ``sq`` query rows: per visible segment a kernel backward on the
    rows' log-sum-exp (a copy where the rows are a strided slice) and output gradient, added into the
    accumulators in place."""
    for rows, cols in block:
        copied = rows != sq and d.b * heads > 1
        if copied:
            m.alloc(seg_lse=d.b * heads * rows * d.acc)
        _kernel_backward(m, d, ("seg_dq", "seg_dk", "seg_dv"), heads, kv_heads, rows, cols)
        m.free(*(("seg_lse",) if copied else ()), "seg_dq", "seg_dk", "seg_dv")


@dataclasses.dataclass(frozen=True, slots=True)
class _Normed:
    """What one norm normalises: ``vectors`` vectors of ``width`` features."""

    vectors: int
    width: int

    @classmethod
    def hidden(cls, d: Dims) -> _Normed:
        """A ``[t, b, h]`` activation: the layer's norms."""
        return cls(d.t * d.b, d.h)

    @classmethod
    def heads(cls, d: Dims, rows: int, heads: int) -> _Normed:
        """``[rows, b, heads, hn]`` queries or keys, normalised per head: the q/k norms."""
        return cls(rows * d.b * heads, d.hn)


@dataclasses.dataclass(frozen=True, slots=True)
class _QK:
    """Queries and keys after :func:`_qk_forward`, by name (``qkv``'s own where they are its
    untransformed views), and what the transform's backward needs: ``kept`` (the norms' statistics,
    q's copy that the q norm keeps, RoPE's ``cos``/``sin``), freed by :func:`_qk_backward`;
    ``norms_keep_qkv``: the norms keep views of the projection, which then outlives the attention's
    backward until theirs."""

    qkv: str
    q: str
    k: str
    kept: tuple[str, ...] = ()
    norms_keep_qkv: bool = False

    @property
    def transformed(self) -> tuple[str, ...]:
        """The names of q and k that are tensors of their own (not views of the projection)."""
        return tuple(name for name in dict.fromkeys((self.q, self.k)) if name != self.qkv)

    @property
    def saved(self) -> tuple[str, ...]:
        """What the transform keeps alive for its backward."""
        return (*self.kept, *((self.qkv,) if self.norms_keep_qkv else ()))


def _qk_forward(m: _Memory, d: Dims, rows: int, heads: int, kv_heads: int, qkv: str, *, grad: bool = True) -> _QK:
    """``split_qkv`` and Megatron's query/key transform (``modules._QKTransform``) of the projection
    ``qkv`` ``[rows, b, ...]`` (alive) into q ``[rows, b, heads, hn]`` and k ``[rows, b, kv_heads,
    hn]``: q is copied out where several groups' query heads are gathered (k, v are views); the q
    then the k norm (``shape.qk_norm``: each a new tensor, keeping its input and statistics); RoPE
    (:func:`_rope_forward`). ``grad``: autograd records the transform (without, as in ``lean``'s
    forward, nothing is kept). What the transform made and no longer needs dies when it returns: the
    caller holds q's copy until then, and the norms' outputs live until both rotations are done."""
    q = k = qkv
    made = []
    if d.q_copied(kv_heads):
        m.alloc(q_copy=rows * d.b * heads * d.hn * d.e)
        q = "q_copy"
        made.append(q)
    kept: list[str] = []
    if d.shape.qk_norm:
        for name, n in (("q", heads), ("k", kv_heads)):
            _norm_forward(m, d, f"{name}_norm", _Normed.heads(d, rows, n))
            made.append(f"{name}_norm_out")
            if grad:
                kept.append(f"{name}_norm_stats")
            else:
                m.free(f"{name}_norm_stats")
        if grad and q != qkv:
            kept.append(q)
        q, k = "q_norm_out", "k_norm_out"
    if d.rotary_dim:
        q, k = _rope_forward(m, d, rows, heads, kv_heads, grad=grad)
        if grad:
            kept += ["rope_q_cos", "rope_q_sin", "rope_k_cos", "rope_k_sin"]
    m.free(*(name for name in made if name not in (q, k, *kept)))
    return _QK(qkv, q, k, tuple(kept), norms_keep_qkv=grad and d.shape.qk_norm)


def _qk_backward(
    m: _Memory,
    d: Dims,
    rows: int,
    heads: int,
    kv_heads: int,
    qk: _QK,
    dq: str | None,
    dk: str | None,
    *,
    caller_holds_qkv: bool = False,
) -> tuple[str | None, str | None]:
    """The backward of :func:`_qk_forward` from the gradients of the transformed q and k (None: the
    caller holds it), k's nodes before q's (autograd runs the later-made first): through the
    rotations, then the norms; frees ``qk.kept`` and, once no norm keeps it and unless
    ``caller_holds_qkv``, the projection. Returns the gradients of the split's q and k (new tensors,
    or the given ones where nothing transformed them)."""
    grads = {"q": dq, "k": dk}
    if d.rotary_dim:
        for name, n in (("k", kv_heads), ("q", heads)):
            grads[name] = _rope_backward(m, d, rows, n, name, grads[name])
    if d.shape.qk_norm:
        q_input = "q_copy" if "q_copy" in qk.kept else qk.qkv
        for name, n, norm_input in (("k", kv_heads, qk.qkv), ("q", heads, q_input)):
            _norm_backward(m, d, f"{name}_norm", grads[name], _Normed.heads(d, rows, n))
            grads[name] = f"{name}_norm_dx"
            still_kept = name == "k" and q_input == norm_input  # by the q norm, still to run
            if not still_kept and not (norm_input == qk.qkv and caller_holds_qkv):
                m.free(norm_input)
    return grads["q"], grads["k"]


def _rope_forward(m: _Memory, d: Dims, rows: int, heads: int, kv_heads: int, *, grad: bool = True) -> tuple[str, str]:
    """RoPE in the query/key transform of Megatron's layer, on q ``[rows, b, heads, hn]`` and k
    ``[rows, b, kv_heads, hn]`` (alive): both tables' rows selected (fp32 ``[rows, 1, 1, rot]``), then
    per tensor Megatron's unfused ``apply_rotary_pos_emb`` (:func:`_rotate`). With ``grad``, autograd
    keeps each tensor's ``cos`` and ``sin`` in the activations' dtype for backward (``rope_q_cos``...);
    without, they die with the rotation. The tables die when it returns. Returns the names of the
    rotated q and k (new tensors)."""
    table = rows * d.rotary_dim * 4
    m.alloc(rope_q_table=table, rope_k_table=table)
    rotated = tuple(_rotate(m, d, rows, n, name) for n, name in ((heads, "q"), (kv_heads, "k")))
    m.free("rope_q_table", "rope_k_table")
    if not grad:
        m.free("rope_q_cos", "rope_q_sin", "rope_k_cos", "rope_k_sin")
    return rotated


def _rotate(m: _Memory, d: Dims, rows: int, heads: int, name: str) -> str:
    """``_apply_rotary_pos_emb_bshd`` of one ``[rows, b, heads, hn]`` tensor: ``cos`` and ``sin`` of the
    angles (fp32), scaled by ``mscale`` (a new tensor even at 1) and cast to the activations' dtype
    (kept: ``rope_{name}_cos/_sin``); ``t cos + rotate_half(t) sin`` over the rotated channels
    (``rotate_half``: a negated half and a concatenation), and the result concatenated with the
    channels it leaves (a copy: ``rope_{name}``)."""
    angles = rows * d.rotary_dim * 4
    for fn in ("cos", "sin"):
        kept = f"rope_{name}_{fn}"
        m.alloc(rope_angles=angles, rope_scaled=angles)
        m.free("rope_angles")
        if d.half:
            m.alloc(**{kept: rows * d.rotary_dim * d.e})
            m.free("rope_scaled")
        else:
            m.rename(rope_scaled=kept)
    rot = rows * d.b * heads * d.rotary_dim * d.e
    m.alloc(rope_t_cos=rot, rope_neg=rot // 2, rope_half_rotated=rot)
    m.free("rope_neg")
    m.alloc(rope_rotated_sin=rot)
    m.free("rope_half_rotated")
    m.alloc(rope_sum=rot)
    m.free("rope_t_cos", "rope_rotated_sin")
    m.alloc(**{f"rope_{name}": rows * d.b * heads * d.hn * d.e})
    m.free("rope_sum")
    return f"rope_{name}"


def _rope_backward(m: _Memory, d: Dims, rows: int, heads: int, name: str, grad: str | None) -> str:
    """The backward of :func:`_rotate` for tensor ``name`` from ``grad`` (the rotated tensor's, which
    dies; None: the caller holds it): the gradient through ``rotate_half`` (a product, a negated
    half, the halves concatenated) and through ``t cos`` (a product), summed, put back beside the
    unrotated channels (a ``slice_backward`` and a sum); ``cos`` and ``sin`` die as their products'
    backwards end. Returns the input's gradient ``d_{name}``."""
    rot = rows * d.b * heads * d.rotary_dim * d.e
    full = rows * d.b * heads * d.hn * d.e
    m.alloc(rope_grad_sin=rot)
    m.free(f"rope_{name}_sin")
    m.alloc(rope_grad_neg=rot // 2, rope_grad_halves=rot)
    m.free("rope_grad_sin", "rope_grad_neg")
    m.alloc(rope_grad_cos=rot)
    m.free(f"rope_{name}_cos")
    m.alloc(rope_grad_rot=rot)
    m.free("rope_grad_halves", "rope_grad_cos")
    m.alloc(rope_grad_slice=full)
    m.free(*((grad,) if grad else ()))
    m.alloc(**{f"d_{name}": full})
    m.free("rope_grad_slice", "rope_grad_rot")
    return f"d_{name}"


def _full_attention_forward(
    m: _Memory, d: Dims, layout: SequenceLayout, qkv: str, heads: int, kv_heads: int
) -> tuple[tuple[str, ...], _QK, str]:
    """``attend_full_sequence`` of ``qkv`` ``[s, b, (heads + 2 kv_heads) hn]`` (alive): q, k and their
    transform (:func:`_qk_forward`), q/k/v put in natural order (causal: copies; otherwise those still views
    of the projection copied dense, v always, so the projection dies unless q/k norms keep it), the attention (one
    causal document and its padding: one call over the whole sequence, then the padding's rows redone;
    several documents: FlashAttention's one variable-length call, :func:`_varlen_call`; elsewhere one
    kernel call per document, written into a zeroed output), the output as ``[s, b, heads hn]`` in canonical
    order (causal: a copy; otherwise a view, the kernel lays its output out sequence-major, but for the
    variable-length call's sample-major output of several samples: a copy). Returns what the attention
    keeps for backward (the transform's own kept apart, in the :class:`_QK`) and the name of that
    output."""
    core = d.s * d.b * heads * d.hn * d.e
    kv = d.s * d.b * kv_heads * d.hn * d.e
    qk = _qk_forward(m, d, d.s, heads, kv_heads, qkv)
    q, k = qk.q, qk.k
    if layout.is_identity:  # dense copies of what is still a view of the projection: v, q and k untransformed
        kept = []
        for name, source, nbytes in (("q", q, core), ("k", k, kv), ("v", qkv, kv)):
            if source == qkv:
                m.alloc(**{f"{name}_dense": nbytes})
                source = f"{name}_dense"
            kept.append(source)
        kept = tuple(kept)
    else:
        m.alloc(q_natural=core, k_natural=kv, v_natural=kv)
        m.free(*(name for name in dict.fromkeys((q, k)) if name != qkv))
        kept = ("q_natural", "k_natural", "v_natural")
    segments, tail = layout.full_segments(), layout.causal_tail_padding
    varlen = len(segments) > 1 and not tail and _flash(d)
    if len(segments) == 1 or tail:
        _kernel_forward(m, d, "attn_out", "lse", heads, kv_heads, d.s, d.s)
        if tail:  # the padding's rows redone, written into the whole call's
            _kernel_forward(m, d, "seg_out", "seg_lse", heads, kv_heads, tail, tail)
            m.free("seg_out", "seg_lse")
    elif varlen:
        _varlen_call(m, d, len(segments), {"q": core, "k": kv, "v": kv}, attn_out=core, lse=d.b * heads * d.s * d.acc)
    else:
        m.alloc(attn_out=core, lse=d.b * heads * d.s * d.acc)
        for seg in segments:
            rows = seg.q_end - seg.q_start
            _kernel_forward(m, d, "seg_out", "seg_lse", heads, kv_heads, rows, rows)
            m.free("seg_out", "seg_lse")
    if layout.is_identity and not (varlen and d.b > 1):
        return (*kept, "attn_out", "lse"), qk, "attn_out"
    m.alloc(core=core)
    return (*kept, "attn_out", "lse"), qk, "core"


def _varlen_call(m: _Memory, d: Dims, docs: int, inputs: dict[str, float], **results: float) -> None:
    """A variable-length call (``blocks._SegmentAttention``) over ``docs`` documents of each of ``b``
    samples: with several samples, its ``inputs`` made token-major (copies; one sample's are views) and
    the bounds repeated per sample (int32); then its ``results``; the copies die with the call."""
    copies = {f"{name}_tokens": nbytes for name, nbytes in inputs.items()} if d.b > 1 else {}
    if d.b > 1:
        copies["cu_seqlens"] = (d.b * docs + 1) * 4
    m.alloc(**copies)
    m.alloc(**results)
    m.free(*copies)


def _full_attention_backward(
    m: _Memory, d: Dims, layout: SequenceLayout, dcore: str, kept: tuple[str, ...], qk: _QK, heads: int, kv_heads: int
) -> str:
    """The backward of :func:`_full_attention_forward` from ``dcore``: releases it and what was kept,
    leaves ``d_qkv`` ``[s, b, (heads + 2 kv_heads) hn]``."""
    core, kv = d.s * d.b * heads * d.hn * d.e, d.s * d.b * kv_heads * d.hn * d.e
    if not layout.is_identity:  # index_select's backward: zeros, then index_add
        m.alloc(dcore_zeros=core, dout_natural=core)
        m.free("dcore_zeros", dcore)
        dcore = "dout_natural"
    segments, tail = layout.full_segments(), layout.causal_tail_padding
    if len(segments) == 1 or tail:
        if tail:  # the log-sum-exp with the padding's rows left out of the whole call
            m.alloc(whole_lse=d.b * heads * d.s * d.acc)
        _kernel_backward(m, d, ("dq", "dk", "dv"), heads, kv_heads, d.s, d.s)
        if tail:
            m.free("whole_lse")
            _accumulate_block_grads(m, d, ((tail, tail),), heads, kv_heads, d.s)
    elif _flash(d):
        _varlen_call(m, d, len(segments), {"dout": core, "q": core, "k": kv, "v": kv}, dq=core, dk=kv, dv=kv)
    else:
        m.alloc(dq=core, dk=kv, dv=kv)
        for seg in segments:
            rows = seg.q_end - seg.q_start
            _accumulate_block_grads(m, d, ((rows, rows),), heads, kv_heads, d.s)
    m.free(dcore, *(name for name in kept if name not in qk.saved))
    grads = {"q": "dq", "k": "dk", "v": "dv"}
    if not layout.is_identity:  # back to canonical order, v, k then q
        for name, nbytes in (("v", kv), ("k", kv), ("q", core)):
            grad = grads[name]
            m.alloc(**{f"{grad}_zeros": nbytes, f"{grad}_canonical": nbytes})
            m.free(f"{grad}_zeros", grad)
            grads[name] = f"{grad}_canonical"
    grads["q"], grads["k"] = _qk_backward(m, d, d.s, heads, kv_heads, qk, grads["q"], grads["k"])
    m.alloc(d_qkv=core + 2 * kv)  # split's backward: one tensor
    m.free(*grads.values())
    return "d_qkv"


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
    gradients, stacked into one ``[rows, b, 2 units]`` tensor once both exist (``unbind``'s backward)."""
    nbytes = rows * d.b * units * d.e
    release_d_act, release_fc1 = ((d_act,) if d_act else ()), ((fc1_out,) if fc1_out else ())
    if not d.shape.gated_mlp:
        m.alloc(d_fc1_out=nbytes)
        m.free(*release_d_act, *release_fc1)
        return "d_fc1_out"
    m.alloc(d_up=nbytes, d_gate_act=nbytes)  # mul's backward
    m.free(*release_d_act, act_gate)
    m.alloc(d_gate=nbytes)  # the activation's backward
    m.free("d_gate_act", *release_fc1)
    m.alloc(d_fc1_out=2 * nbytes)
    m.free("d_up", "d_gate")
    return "d_fc1_out"


def _add_bias(m: _Memory, d: Dims, out: str) -> None:
    """``add_bias(out, b)``: a new ``y_local`` with a bias, ``out`` itself without one."""
    if d.bias:
        m.alloc(y_local=d.x)
    else:
        m.rename(**{out: "y_local"})


# -- attention ------------------------------------------------------------------------------------
def _tp_sp_attention(d: Dims, layout: SequenceLayout, rank: int) -> SublayerMemory:
    s, b, e, p = d.s, d.b, d.e, d.p
    heads, kv_heads = d.nq // p, d.ng // p
    core = s * b * heads * d.hn * e

    fwd = _Memory(x_local=d.x)
    _column_forward(fwd, d, "qkv_out", s * b * d.qkv // p * e, d.bias)
    kept, qk, core_name = _full_attention_forward(fwd, d, layout, "qkv_out", heads, kv_heads)
    _row_forward(fwd, d, d.bias)
    proj_input = () if core_name in kept else (core_name,)  # kept by linear_proj
    saved = fwd.returns("y_local", "x_local", *dict.fromkeys((*kept, *qk.saved)), *proj_input)

    bwd = _Memory(dy_local=0.0, **saved)
    _bias_grad(bwd, d, d.bias)
    _row_backward(bwd, d, "d_core", core, d.h * d.a // p * e, release=proj_input)
    d_qkv = _full_attention_backward(bwd, d, layout, "d_core", kept, qk, heads, kv_heads)
    _column_backward(bwd, d, d_qkv, d.qkv // p * d.h * e, d.qkv // p * e if d.bias else 0.0)
    return _sublayer(fwd.peak, bwd, saved, prelude=_gathered_gradient(d))


def _ulysses_attention(d: Dims, layout: SequenceLayout, rank: int) -> SublayerMemory:
    t, b, e, p = d.t, d.b, d.e, d.p
    heads, kv_heads = d.nq // p, d.ng // p
    w_qkv, w_proj, qkv_bias = d.qkv * d.h * e, d.h * d.a * e, d.qkv * e if d.bias else 0.0
    qkv_local = t * b * d.qkv * e  # = [s, b, qkv/p] after the all-to-all
    core_local = t * b * d.a * e  # = [s, b, a/p] before it

    fwd = _Memory(x_local=d.x)
    _zero3_forward(fwd, d, "qkv", "qkv_local", qkv_local, w_qkv, bias=qkv_bias)
    qkv_full = "qkv_local"
    if p > 1:  # sequence -> heads: a permuted send copy, the receive
        fwd.alloc(a2a_send=qkv_local, qkv_full=qkv_local)
        fwd.free("a2a_send")
        qkv_full = "qkv_full"
    _gather_ahead(fwd, d, "proj", w_proj)  # while the attention core runs
    _gather_mlp_weight_ahead(fwd, d)
    kept, qk, core = _full_attention_forward(fwd, d, layout, qkv_full, heads, kv_heads)
    if p > 1:  # heads -> sequence: the receive (the output is contiguous as laid out), then permuted
        fwd.alloc(a2a_recv=core_local, core_local=core_local)
        fwd.free("a2a_recv")
        core = "core_local"
    _zero3_forward(fwd, d, "proj", "proj_out", d.x, w_proj, row=True, gathered=True)
    _add_bias(fwd, d, "proj_out")
    handed_on = _mlp_weight_handed_on(fwd, d)
    saved = fwd.returns("y_local", "x_local", *dict.fromkeys((*kept, *qk.saved, core)))

    bwd = _Memory(dy_local=0.0, **saved)
    _bias_grad(bwd, d, d.bias)
    release = () if core in kept else (core,)
    _zero3_backward(bwd, d, "proj", "d_core", core_local, w_proj, row=True, release=release)
    if p > 1:
        bwd.alloc(a2a_send=core_local, d_core_full=core_local)
        bwd.free("a2a_send", "d_core")
        bwd.rename(d_core_full="d_core")
    _gather_ahead(bwd, d, "qkv", w_qkv)  # once the core's gradient is there
    d_qkv = _full_attention_backward(bwd, d, layout, "d_core", kept, qk, heads, kv_heads)
    if p > 1:
        bwd.alloc(a2a_recv=qkv_local, d_qkv_local=qkv_local)
        bwd.free("a2a_recv", d_qkv)
        d_qkv = "d_qkv_local"
    release = (d_qkv, "x_local")
    _zero3_backward(bwd, d, "qkv", "dx_local", d.x, w_qkv, bias=qkv_bias, release=release, gathered=True)
    return _sublayer(fwd.peak, bwd, saved, handed_on=handed_on)


def _ring_forward(d: Dims, blocks: tuple[_Block, ...], heads: int, kv_heads: int) -> _Call:
    """``ring_attention_forward`` on this rank's ``t`` queries of ``heads`` heads, its steps seeing
    ``blocks`` (:func:`_block` of each of :func:`ring_steps`): the stacked K/V block and the one in
    flight, the running output and log-sum-exp (accumulation dtype) merged into in place
    (:func:`_ring_forward_step`). Leaves ``out`` (in the activations' dtype: a copy for half
    precision) and ``lse``."""
    t, b, hn, acc = d.t, d.b, d.hn, d.acc
    loop = _Loop(_Memory(kv=2 * b * kv_heads * t * hn * d.e, out=b * heads * t * hn * acc, lse=b * heads * t * acc))
    for step, block in enumerate(blocks):
        loop.step(_ring_forward_step(d, heads, kv_heads, block, loop.state, last=step + 1 == d.p))
    m = loop.end()
    if d.half:
        m.alloc(out_cast=b * heads * t * hn * d.e)
        m.free("out")
        m.rename(out_cast="out")
    m.free("kv")
    return _Call(m.peak, (("out", m.sizes["out"]), ("lse", m.sizes["lse"])))


@functools.lru_cache(maxsize=_MEMO_SIZE)
def _ring_forward_step(d: Dims, heads: int, kv_heads: int, block: _Block, state: _State, *, last: bool) -> _Step:
    """One step of :func:`_ring_forward` from ``state``: the next block arrives while the kernels
    run on ``block`` and merge into the accumulators. Memoised: ranks and steps repeat the same few
    blocks."""
    m = _Memory(**dict(state))
    if not last:
        m.alloc(kv_next=2 * d.b * kv_heads * d.t * d.hn * d.e)
    _accumulate_block(m, d, block, heads, kv_heads)
    if not last:
        m.free("kv")
        m.rename(kv_next="kv")
    return _Step(m.peak, m.state())


def _ring_backward(d: Dims, blocks: tuple[_Block, ...], heads: int, kv_heads: int) -> _Call:
    """``ring_attention_backward``: the stacked K/V block and the one in flight, ``dq`` and each step's
    ``dk``/``dv`` accumulator (accumulation dtype), the accumulator leaving and the one arriving
    (:func:`_ring_backward_step`). Leaves the input gradients: for half precision copies in the
    activations' dtype (``dq``, ``dk``, ``dv``), otherwise ``dq`` and the arrived accumulator
    ``dkv`` (``dk``/``dv`` are views of it)."""
    t, b, hn = d.t, d.b, d.hn
    loop = _Loop(_Memory(kv=2 * b * kv_heads * t * hn * d.e, dq=b * heads * t * hn * d.acc))
    for step, block in enumerate(blocks):
        loop.step(_ring_backward_step(d, heads, kv_heads, block, loop.state, last=step + 1 == d.p))
    m = loop.end()
    if not d.half:
        return _Call(m.peak, (("dq", m.sizes["dq"]), ("dkv", m.sizes["arrived"])))
    kv_grad = b * kv_heads * t * hn * d.e
    m.alloc(dq_cast=b * heads * t * hn * d.e, dk=kv_grad, dv=kv_grad)
    return _Call(m.peak, (("dq", m.sizes["dq_cast"]), ("dk", kv_grad), ("dv", kv_grad)))


@functools.lru_cache(maxsize=_MEMO_SIZE)
def _ring_backward_step(d: Dims, heads: int, kv_heads: int, block: _Block, state: _State, *, last: bool) -> _Step:
    """One step of :func:`_ring_backward` from ``state`` (the K/V block ``kv``, ``dq``, the
    accumulator ``sent`` last step and the one that ``arrived``): the next block arrives, the step's
    accumulator is made and filled from the kernels' gradients on ``block``; the one sent last step
    is released once its send completed, the arrived one is added and this one goes on while the
    next one arrives. Memoised like the forward's."""
    kv_bytes = 2 * d.b * kv_heads * d.t * d.hn * d.e
    kv_acc = kv_bytes // d.e * d.acc
    m = _Memory(**dict(state))
    if not last:
        m.alloc(kv_next=kv_bytes)
    m.alloc(dkv=kv_acc)
    _accumulate_block_grads(m, d, block, heads, kv_heads, d.t)
    if "sent" in m.sizes:
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


def _ring_attention(d: Dims, layout: SequenceLayout, rank: int) -> SublayerMemory:
    blocks = tuple(map(_block, ring_steps(layout, rank)))
    return _ring_attention_memory(d, _ring_forward(d, blocks, d.nq, d.ng), _ring_backward(d, blocks, d.nq, d.ng))


@functools.lru_cache(maxsize=_MEMO_SIZE)
def _ring_attention_memory(d: Dims, ring_forward: _Call, ring_backward: _Call) -> SublayerMemory:
    """``ring`` attention's memory around the rank's ring forward and backward (which ranks often
    share: memoised): the projections' ZeRO-3 gathers (the output projection's while the ring runs, in
    backward the QKV projection's), q's copy, RoPE on the local tokens, the output permuted."""
    e = d.e
    w_qkv, w_proj, qkv_bias = d.qkv * d.h * e, d.h * d.a * e, d.qkv * e if d.bias else 0.0
    qkv_local, core_local = d.t * d.b * d.qkv * e, d.t * d.b * d.a * e

    fwd = _Memory(x_local=d.x)
    _zero3_forward(fwd, d, "qkv", "qkv_local", qkv_local, w_qkv, bias=qkv_bias)
    qk = _qk_forward(fwd, d, d.t, d.nq, d.ng, "qkv_local")
    _gather_ahead(fwd, d, "proj", w_proj)  # while the ring runs
    _gather_mlp_weight_ahead(fwd, d)
    fwd.call(ring_forward)
    fwd.alloc(core=core_local)  # [s/p, b, nq hn]: the output permuted
    _zero3_forward(fwd, d, "proj", "proj_out", d.x, w_proj, row=True, gathered=True)
    _add_bias(fwd, d, "proj_out")
    handed_on = _mlp_weight_handed_on(fwd, d)
    # v (and q, k untransformed) are views of the projection
    saved = fwd.returns("y_local", "x_local", "qkv_local", *qk.transformed, *qk.kept, "out", "lse", "core")

    bwd = _Memory(dy_local=0.0, **saved)
    _bias_grad(bwd, d, d.bias)
    _zero3_backward(bwd, d, "proj", "d_core", core_local, w_proj, row=True, release=("core",))
    _gather_ahead(bwd, d, "qkv", w_qkv)  # once the ring output's gradient (a view of d_core) is there
    bwd.call(ring_backward)
    bwd.free("d_core", *(() if qk.norms_keep_qkv else ("qkv_local",)), *qk.transformed, "out", "lse")
    grads = [name for name, _ in ring_backward.leaves]
    # for full precision dk is a view of the arrived accumulator
    dq, dk = _qk_backward(bwd, d, d.t, d.nq, d.ng, qk, "dq", "dk" if d.half else None)
    if d.qk_transformed:  # the ring's dq (and a half-precision dk) died in the transform's backward
        grads = [name for name in grads if name not in ("dq", "dk")] + [dq, dk]
    bwd.alloc(d_qkv_local=qkv_local)  # split's backward: one tensor
    bwd.free(*grads)
    release = ("d_qkv_local", "x_local")
    _zero3_backward(bwd, d, "qkv", "dx_local", d.x, w_qkv, bias=qkv_bias, release=release, gathered=True)
    return _sublayer(fwd.peak, bwd, saved, handed_on=handed_on)


def _add_matmul(m: _Memory, d: Dims, nbytes: float) -> None:
    """``lean``'s ``_add_matmul`` into a gradient accumulator: in place for full precision; for half
    precision the product, of ``nbytes`` in the activations' dtype, is made first."""
    if d.half:
        m.temporary(product=nbytes)


def _lean_attention_sizes(d: Dims) -> tuple[int, int, int]:
    """``lean`` attention's shard message (qkv rows, proj columns, qkv bias), one group's QKV
    projection and core output."""
    heads, qkv_rows = d.nq // d.p, d.qkv // d.p
    shard = (qkv_rows * d.h + d.h * d.a // d.p + (qkv_rows if d.bias else 0)) * d.e
    return shard, d.t * d.b * qkv_rows * d.e, d.t * d.b * heads * d.hn * d.e


def _lean_attention(d: Dims, layout: SequenceLayout, rank: int) -> SublayerMemory:
    """Head group ``j`` (``nq/p`` heads, ``ng/p`` groups): its shard broadcast by rank ``j`` (the next
    one in flight), its q/k/v projected, ring attention, ``y += core_j proj_j^T``; backward
    broadcasts again, recomputes q/k/v, runs the ring backward and reduces the shard's gradient (in
    the accumulation dtype) to its owner while the next group runs."""
    heads, kv_heads = d.nq // d.p, d.ng // d.p
    shard = _lean_attention_sizes(d)[0]
    blocks = tuple(map(_block, ring_steps(layout, rank)))
    fwd_peak, kept = _lean_attention_forward(d, _ring_forward(d, blocks, heads, kv_heads))
    saved = dict(kept)
    ring_backward = _ring_backward(d, blocks, heads, kv_heads)
    start = _Memory(dy_local=0.0, saved=sum(saved.values()))
    _bias_grad(start, d, d.bias)
    start.alloc(dx_local=d.x, shard=shard)  # dx accumulates group by group
    loop = _Loop(start)
    for j in range(d.p):
        loop.step(_lean_attention_backward_group(d, ring_backward, loop.state, last=j + 1 == d.p, own=j == rank))
    bwd = loop.end()
    bwd.free("shard_prev", *(("reducing",) if "reducing" in bwd.sizes else ()))
    if d.half:  # the complete gradient rounded to the shard's dtype
        bwd.alloc(own_cast=shard)
        bwd.free("own")
        bwd.rename(own_cast="own")
    # the function's backward returns; the shard gradient is accumulated
    bwd.free("saved", "own")
    return _sublayer(fwd_peak, bwd, saved)


@functools.lru_cache(maxsize=_MEMO_SIZE)
def _lean_attention_forward(d: Dims, ring_forward: _Call) -> tuple[float, _State]:
    """``lean`` attention's forward: its high-water mark and what it saves (each group's ring
    output and log-sum-exp). It depends on the rank only through ``ring_forward`` (the same for
    every group), which ranks often share: memoised."""
    shard, qkv_group, core_group = _lean_attention_sizes(d)
    p = d.p
    fwd = _Memory(x_local=d.x)
    fwd.alloc(y_sum=d.x, shard0=shard)
    for j in range(p):
        if j:
            fwd.free(f"shard{j - 1}")
        if j + 1 < p:
            fwd.alloc(**{f"shard{j + 1}": shard})
        fwd.alloc(qkv=qkv_group)
        qk = _qk_forward(fwd, d, d.t, d.nq // p, d.ng // p, "qkv", grad=False)  # no autograd inside
        fwd.call(ring_forward, prefix=f"g{j}_")
        fwd.temporary(core_rows=core_group)  # the output as [t b, heads hn] for y.addmm_
        fwd.free("qkv", *qk.transformed)
    fwd.free(f"shard{p - 1}")
    _add_bias(fwd, d, "y_sum")
    saved = fwd.returns("y_local", "x_local", *(f"g{j}_{name}" for j in range(p) for name, _ in ring_forward.leaves))
    return fwd.peak, tuple(saved.items())


@functools.lru_cache(maxsize=_MEMO_SIZE)
def _lean_attention_backward_group(d: Dims, ring_backward: _Call, state: _State, *, last: bool, own: bool) -> _Step:
    """Head group ``j`` of ``lean`` attention's backward from ``state`` (what the forward saved, as
    one, the input gradient, the previous group's shard ``shard_prev`` and this one's ``shard``, the
    gradient still being reduced and the rank's ``own``): the next shard arrives, the group's
    gradient accumulator is made, the proj gradient added, q/k/v recomputed, the ring backward, the
    qkv gradients added; the previous gradient's reduce completes (not the rank's own, kept until
    the end) and this one's begins. ``own``: the group is the rank's."""
    shard, qkv_group, core_group = _lean_attention_sizes(d)
    p = d.p
    qkv_rows = d.qkv // p
    m = _Memory(**dict(state))
    if "shard_prev" in m.sizes:
        m.free("shard_prev")
    if not last:
        m.alloc(shard_next=shard)
    m.alloc(grad=shard // d.e * d.acc)
    m.alloc(core_rows=core_group)  # for the proj gradient
    _add_matmul(m, d, d.h * d.a // p * d.e)
    m.free("core_rows")
    m.alloc(dout=core_group, qkv=qkv_group)  # dy proj_j, the recomputed projection
    heads, kv_heads = d.nq // p, d.ng // p
    qk = _qk_forward(m, d, d.t, heads, kv_heads, "qkv")  # recomputed with autograd
    m.call(ring_backward)
    # autograd.backward through the transform (the ring's gradients stay the step's)
    through = _qk_backward(m, d, d.t, heads, kv_heads, qk, None, None, caller_holds_qkv=True)
    m.alloc(d_qkv=qkv_group)  # qkv.grad, through split
    m.free(*(name for name in through if name))
    _add_matmul(m, d, qkv_rows * d.h * d.e)
    if d.bias:
        m.temporary(bias_sum=qkv_rows * d.acc)
    m.free("dout", "qkv", *qk.transformed, *(n for n, _ in ring_backward.leaves), "d_qkv")
    if "reducing" in m.sizes:
        m.free("reducing")  # its reduce is complete
    m.rename(grad="own" if own else "reducing", shard="shard_prev")
    if not last:
        m.rename(shard_next="shard")
    return _Step(m.peak, m.state())


# -- MLP ------------------------------------------------------------------------------------------
def _tp_sp_mlp(d: Dims, layout: SequenceLayout, rank: int) -> SublayerMemory:
    s, b, e, p = d.s, d.b, d.e, d.p
    units = d.f // p

    fwd = _Memory(x_local=d.x)
    _column_forward(fwd, d, "fc1_out", s * b * d.f1 // p * e, d.bias)
    act = _activation_forward(fwd, d, s, units)
    _row_forward(fwd, d, d.bias)
    saved = fwd.returns("y_local", "x_local", "fc1_out", *act)

    bwd = _Memory(d, dy_local=0.0, **saved)
    _bias_grad(bwd, d, d.bias)
    _row_backward(bwd, d, "d_act", s * b * units * e, d.h * units * e, release=(act[-1],))
    gate = act[0] if len(act) > 1 else None
    d_fc1 = _activation_backward(bwd, d, s, units, d_act="d_act", fc1_out="fc1_out", act_gate=gate)
    if d.bias:  # linear_fc1 returns its bias (skip_bias_add): its gradient is the addition's, summed first
        bwd.alloc(fc1_bias_grad=d.f1 // p * e)
        bwd.to_autograd("fc1_bias_grad")
    _column_backward(bwd, d, d_fc1, d.f1 // p * d.h * e, 0.0)
    return _sublayer(fwd.peak, bwd, saved, prelude=_gathered_gradient(d))


def _zero3_mlp(d: Dims, layout: SequenceLayout, rank: int) -> SublayerMemory:
    t, b, e = d.t, d.b, d.e
    w1, w2, b1 = d.f1 * d.h * e, d.h * d.f * e, d.f1 * e if d.bias else 0.0

    # fc1's weight gathered during the attention (where the layer does), fc2's during fc1's GEMM (Zero3Gathers)
    fwd = _Memory(x_local=d.x, **({"fc1_w": w1} if d.mlp_weight_ahead else {}))
    ahead = d.mlp_weight_ahead
    _zero3_forward(fwd, d, "fc1", "fc1_out", t * b * d.f1 * e, w1, bias=b1, gathered=ahead, ahead=("fc2", w2))
    act = _activation_forward(fwd, d, t, d.f)
    _zero3_forward(fwd, d, "fc2", "fc2_out", d.x, w2, row=True, gathered=True)
    _add_bias(fwd, d, "fc2_out")
    saved = fwd.returns("y_local", "x_local", "fc1_out", *act)

    bwd = _Memory(d, dy_local=0.0, **saved)
    _bias_grad(bwd, d, d.bias)
    _zero3_backward(bwd, d, "fc2", "d_act", t * b * d.f * e, w2, row=True, release=(act[-1],))
    gate = act[0] if len(act) > 1 else None
    d_fc1 = _activation_backward(bwd, d, t, d.f, d_act="d_act", fc1_out="fc1_out", act_gate=gate)
    _zero3_backward(bwd, d, "fc1", "dx_local", d.x, w1, bias=b1, release=(d_fc1, "x_local"))
    return _sublayer(fwd.peak, bwd, saved)


def _lean_mlp(d: Dims, layout: SequenceLayout, rank: int) -> SublayerMemory:
    """The fc1/fc2 shards circulate (at step ``i`` rank ``r`` holds shard ``r - i``, the next one
    arriving): ``y += act(x fc1_j^T + b1_j) fc2_j^T``; backward circulates them again, recomputes the
    intermediate, and each shard's gradient accumulator (accumulation dtype) travels with it back to
    its owner."""
    t, b, e, p = d.t, d.b, d.e, d.p
    units = d.f // p
    shard = (d.f1 // p * d.h + d.h * units + (d.f1 // p if d.bias else 0)) * e  # fc1 rows, fc2 columns, fc1 bias
    grad_bytes = shard // e * d.acc
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
    _add_bias(fwd, d, "y_sum")
    saved = fwd.returns("y_local", "x_local")

    bwd = _Memory(d, dy_local=0.0, **saved)
    _bias_grad(bwd, d, d.bias)
    bwd.alloc(dx_local=d.x, shard0=shard)  # dx accumulates shard by shard
    arrived = sent = None
    for step in range(p):
        if step + 1 < p:
            bwd.alloc(**{f"shard{step + 1}": shard})
        grad = f"grad{step}"
        bwd.alloc(**{grad: grad_bytes, "fc1_out": pre})
        act = _activation_forward(bwd, d, t, units)  # recomputed
        _add_matmul(bwd, d, d.h * units * e)  # fc2's gradient
        bwd.alloc(d_act=t * b * units * e)  # dy fc2_j: autograd.grad's argument, alive until it returns
        gate = act[0] if len(act) > 1 else None
        d_fc1 = _activation_backward(bwd, d, t, units, d_act=None, fc1_out=None, act_gate=gate)
        bwd.free("d_act", act[-1])
        _add_matmul(bwd, d, d.f1 // p * d.h * e)  # fc1's gradient
        if d.bias:
            bwd.temporary(bias_sum=d.f1 // p * d.acc)
        bwd.free("fc1_out", d_fc1)  # when the step returns
        if sent is not None:  # the accumulator sent last step: released once its send completed
            bwd.free(sent)
        if p > 1:
            bwd.alloc(**{f"arrived{step}": grad_bytes})
            if arrived is not None:
                bwd.free(arrived)
            arrived, sent = f"arrived{step}", grad
            if step + 1 < p:
                bwd.free(f"shard{step}")
        else:
            arrived = grad
    bwd.free(*((sent,) if sent else ()))
    if d.half:  # the complete gradient rounded to the shard's dtype
        bwd.alloc(grad_cast=shard)
        bwd.free(arrived)
        arrived = "grad_cast"
    bwd.free(f"shard{p - 1}", "x_local")
    bwd.to_autograd(arrived)
    return _sublayer(fwd.peak, bwd, saved)


_SCRIPTS: dict[tuple[str, str], Callable[[Dims, SequenceLayout, int], SublayerMemory]] = {
    ("attention", "tp_sp"): _tp_sp_attention,
    ("attention", "ulysses"): _ulysses_attention,
    ("attention", "ring"): _ring_attention,
    ("attention", "lean"): _lean_attention,
    ("mlp", "tp_sp"): _tp_sp_mlp,
    ("mlp", "zero3"): _zero3_mlp,
    ("mlp", "lean"): _lean_mlp,
}
RANK_DEPENDENT = frozenset({"ring", "lean"})
"""Attention strategies whose per-rank memory depends on the rank (which ring blocks it sees; which
shard gradient it keeps). MLP strategies' memory is the same on every rank."""


def sublayer_memory(sublayer: str, name: str, d: Dims, layout: SequenceLayout, rank: int = 0) -> SublayerMemory:
    """The memory of strategy ``name`` running ``sublayer`` on ``rank`` for a micro-batch laid out as
    ``layout``."""
    script = _SCRIPTS.get((sublayer, name))
    if script is None:
        known = ", ".join(n for sub, n in _SCRIPTS if sub == sublayer)
        raise ValueError(f"no memory script for {sublayer} strategy {name!r}; known: {known}")
    return script(d, layout, rank)


def tiled_mlp_memory(name: str, d: Dims, layout: SequenceLayout, tile_tokens: int) -> SublayerMemory:
    """MLP strategy ``name`` over tiles of ``tile_tokens`` gathered tokens
    (:mod:`megatron_paradyse.strategies.tiling`), from its own script at each tile's size.

    Forward, beside the input (which it keeps: the tiles are views of it): each tile's working set above
    its input beside the outputs of the tiles before; the outputs joined into the output (both whole for a
    moment). Backward, from the last tile: each tile rebuilt (what its forward keeps, its input aside) on
    top of what its backward makes before it reads a saved tensor, and its backward, beside the input
    gradients of the tiles done and the weight gradients autograd holds for the tiles still to come;
    the input gradients joined into the input's."""
    x, t = d.x, d.t
    rows = mlp_tile_rows(tile_tokens, d.p, t)
    sizes = [min(rows, t - start) for start in range(0, t, rows)]

    def tile_memory(n: int, **grads) -> SublayerMemory:
        return sublayer_memory("mlp", name, dataclasses.replace(d, s=n * d.p, **grads), layout)

    forward = backward = 0.0
    done = 0.0  # the outputs of the tiles so far
    for n in sizes:
        forward = max(forward, done + tile_memory(n).fwd_peak - x * n / t)
        done += x * n / t
    # the weights serve every tile: autograd holds their gradients from the first tile's backward and
    # adds each later tile's to them, until the last tile's have come
    handed = tile_memory(sizes[0]).grads_handed  # the same weights' gradients, whatever the tile
    done = 0.0  # the input gradients of the tiles so far
    for i, n in enumerate(reversed(sizes)):
        before = handed if i > 0 else ()
        tile, tile_x = tile_memory(n, grads_held=i < len(sizes) - 1, grads_before=before), x * n / t
        kept = tile.saved_bytes - (tile_x if "x_local" in dict(tile.saved) else 0.0)
        rebuilt = sum(before) + tile.bwd_prelude + tile.fwd_peak - tile_x  # on what the backward made first
        backward = max(backward, done + max(rebuilt, kept + tile.bwd_peak))
        done += tile_x
    return SublayerMemory((("x_local", x),), max(x + forward, 3 * x), max(backward, 2 * x))


def _norm_forward(m: _Memory, d: Dims, name: str, normed: _Normed | None = None) -> None:
    """One norm (``megatron_paradyse.mcore.norm``) of ``normed`` (default: a ``[t, b, h]`` activation):
    its output ``{name}_out`` and the statistics it keeps, ``{name}_stats`` (it keeps its input too:
    the caller's). LayerNorm keeps mean and rstd (the input's dtype on the CPU, fp32 on CUDA), RMSNorm
    an fp32 rstd; torch's fused RMSNorm kernel is one kernel on CUDA, a chain of operators on the CPU
    (in the accumulation dtype: the input's square, ``x rstd``, times the weight)."""
    n = normed or _Normed.hidden(d)
    out, stats = n.vectors * n.width * d.e, d.norm_stats_of(n.vectors)
    if d.normalization == "LayerNorm" or d.device == "cuda":
        m.alloc(**{f"{name}_out": out, f"{name}_stats": stats})
        return
    x_acc = n.vectors * n.width * d.acc
    if d.half:
        m.alloc(norm_x=x_acc)
    m.alloc(norm_square=x_acc, norm_mean=n.vectors * d.acc, **{f"{name}_stats": stats})
    m.free("norm_square", "norm_mean")
    m.alloc(norm_x_hat=x_acc)
    if d.half:
        m.alloc(norm_scaled=x_acc)
        m.free("norm_x_hat", "norm_x")
        m.alloc(**{f"{name}_out": out})
        m.free("norm_scaled")
    else:
        m.alloc(**{f"{name}_out": out})
        m.free("norm_x_hat")


def norm_peak(d: Dims) -> float:
    """High-water mark of one norm of ``[t, b, h]`` run on its own (a stage's final norm, between its
    last layer and its output layer), above its input: its forward, and its backward from its output's
    gradient (the output gone, the statistics kept)."""
    m = _Memory()
    _norm_forward(m, d, "norm")
    forward = m.peak
    m.free("norm_out")
    m.alloc(output_grad=d.x)
    _norm_backward(m, d, "norm", "output_grad")
    return max(forward, m.peak)


def _norm_backward(m: _Memory, d: Dims, name: str, dy: str | None, normed: _Normed | None = None) -> None:
    """The backward of :func:`_norm_forward` from ``dy`` (None: the caller holds it): leaves
    ``{name}_dx``; the weight's (and bias's) gradient is accumulated; ``dy`` and the statistics die.
    RMSNorm on the CPU runs ``norm._RMSNorm``'s own backward: ``x_hat``, ``g = dy w`` and two products
    in the accumulation dtype."""
    n = normed or _Normed.hidden(d)
    weight, dx = n.width * d.e, n.vectors * n.width * d.e
    released = (dy,) if dy else ()
    if d.normalization == "LayerNorm" or d.device == "cuda":
        grads = {"norm_dw": weight, **({"norm_db": weight} if d.normalization == "LayerNorm" else {})}
        m.alloc(**{f"{name}_dx": dx}, **grads)
        m.free(*grads, *released, f"{name}_stats")
        return
    x_acc, stats = n.vectors * n.width * d.acc, n.vectors * d.acc
    m.alloc(norm_x_hat=x_acc)
    if d.half:
        m.alloc(norm_dy=x_acc, norm_g=x_acc)
        m.free("norm_dy")
    else:
        m.alloc(norm_g=x_acc)
    m.alloc(norm_product=x_acc, norm_dw=n.width * d.acc)
    m.free("norm_product")
    if d.half:
        m.alloc(norm_dw_cast=weight)
        m.free("norm_dw")
        m.rename(norm_dw_cast="norm_dw")
    m.alloc(norm_product=x_acc, norm_mean=stats)
    m.free("norm_product")
    if d.half:
        m.alloc(**{f"{name}_dx": dx})
        m.free("norm_g")
    else:
        m.rename(norm_g=f"{name}_dx")
    m.free("norm_x_hat", "norm_mean", "norm_dw", *released, f"{name}_stats")


@dataclasses.dataclass(frozen=True, slots=True)
class LayerMemory:
    """A layer's memory with and without recompute (:func:`layer_memory`), above its input."""

    activation_bytes: float
    """One ``[t, b, h]`` activation: all a layer keeps with recompute (its output)."""
    saved_bytes: float
    """Kept from the layer's forward to its backward, without recompute (its output included)."""
    forward_peak_bytes: float
    """High-water mark of the forward, above the layer's input, without recompute."""
    backward_peak_bytes: float
    """High-water mark of the backward, above the layer's input."""
    rebuilt_peak_bytes: float
    """High-water mark of recompute's rebuilt forward, in the backward."""

    def saved_and_peak(
        self, *, recompute: bool, offload: bool = False, backward_held: float = 0.0
    ) -> tuple[float, float]:
        """(saved bytes, high-water mark) with or without recompute; ``backward_held``: bytes that exist
        beside the layer in backward only (a tied output layer's weight gradient).

        ``offload`` (with recompute) keeps the layer's input in host memory: the device holds one
        activation less from the forward to the backward, counted here as the layer's own saved
        activation (:func:`~megatron_paradyse.cost.base.stage_layer_bytes`). In the backward its input is
        back, in place of the layer's output that the count of the layers before stands for (it is gone,
        its gradient in its place), and beside it the next offloaded layer's input, prefetched: one
        activation more."""
        backward = max(self.backward_peak_bytes, self.rebuilt_peak_bytes if recompute else 0.0) + backward_held
        if offload:
            return 0.0, backward + self.activation_bytes
        if recompute:  # the forward keeps nothing, and works no more than the rebuilt forward
            return self.activation_bytes, backward
        return self.saved_bytes, max(self.forward_peak_bytes, backward)


def layer_memory(attn: SublayerMemory, mlp: SublayerMemory, d: Dims) -> LayerMemory:
    """A layer's memory from its sublayers' between the layer's own tensors, with and without recompute.

    Forward: norm 1 (output and statistics; it keeps the layer's input), the attention, the residual
    ``x1``, norm 2 (keeping ``x1``), the MLP, the output. Backward from the output's gradient (the
    next layer's or the loss's), which takes the output's place (by then the output's consumer has freed
    it) and dies into the residual's summed gradient: the MLP, norm 2's backward, that sum, the attention,
    norm 1's. Recompute keeps only the output; its forward keeps nothing,
    and the backward first reruns the whole layer, then runs as without recompute.
    """
    x = d.x

    def forward(m: _Memory, sub: SublayerMemory, prefix: str) -> None:
        """On ``{prefix}x_local`` (and what the sublayer before handed on): the high-water mark (the input
        in it), then what it keeps, its output and what it hands on."""
        m.free(f"{prefix}x_local", *(name for name in m.sizes if name.endswith("handed_on")))
        handed_on = (("handed_on", sub.handed_on),) if sub.handed_on else ()
        m.call(_Call(sub.fwd_peak, (("saved", sub.saved_bytes), ("y_local", x), *handed_on)), prefix)

    def backward(m: _Memory, sub: SublayerMemory, prefix: str) -> None:
        m.peak = max(m.peak, m.live + sub.bwd_peak)
        m.free(f"{prefix}saved")
        m.alloc(**{f"{prefix}dx_local": x})

    m = _Memory()
    _norm_forward(m, d, "ln1")
    m.rename(ln1_out="attn.x_local")
    forward(m, attn, "attn.")
    m.alloc(x1=x)
    m.free("attn.y_local")
    _norm_forward(m, d, "ln2")
    m.rename(ln2_out="mlp.x_local")
    forward(m, mlp, "mlp.")
    m.alloc(output=x)
    m.free("mlp.y_local")
    saved, forward_peak = m.live, m.peak
    # recompute reruns this forward to the layer's end (no early stop) once the MLP's backward first
    # reads a saved tensor: beside the output's gradient and what that backward made before
    rebuilt_peak = x + mlp.bwd_prelude + forward_peak
    m.peak = m.live  # the backward's high-water mark from here
    backward(m, mlp, "mlp.")
    _norm_backward(m, d, "ln2", "mlp.dx_local")
    m.free("x1")
    m.alloc(attn_dy=x)  # the output's gradient plus norm 2's
    m.free("ln2_dx", "output")  # "output" stands for the output's gradient, which dies here
    backward(m, attn, "attn.")
    _norm_backward(m, d, "ln1", "attn.dx_local")
    m.alloc(dx=x)
    return LayerMemory(x, saved, forward_peak, m.peak, rebuilt_peak)
