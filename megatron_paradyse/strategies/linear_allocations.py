"""Memory-script building blocks of the linear layers: Megatron's column- and row-parallel linears,
ZeRO-3's gathered weights, a bias added (:mod:`~megatron_paradyse.strategies.allocations`).
"""

from __future__ import annotations

from megatron_paradyse.strategies.allocations import Allocations
from megatron_paradyse.strategies.dims import Dims

__all__ = [
    "add_bias_memory",
    "bias_grad",
    "column_backward",
    "column_forward",
    "gather_ahead",
    "gather_mlp_weight_ahead",
    "gather_weight",
    "gathered_gradient",
    "linear_backward",
    "mlp_weight_handed_on",
    "row_backward",
    "row_forward",
    "zero3_backward",
    "zero3_forward",
]


def linear_backward(
    m: Allocations,
    dx: str,
    dx_bytes: float,
    w: float,
    bias: float,
    *,
    release: tuple[str, ...],
    uses_output_gradient: bool = False,
) -> None:
    """``F.linear``'s own backward (a matmul; with a bias, an addmm): the input gradient ``dx`` and the
    weight's (and bias's) gradient, which autograd then accumulates into ``.grad``; then ``release``
    dies. Without a bias autograd makes the weight's gradient first, with one the input's.
    ``uses_output_gradient``: the backward's first node (:meth:`Allocations.output_gradient_used`)."""
    grads = {"linear_dw": w, **({"linear_db": bias} if bias else {})}
    if bias:
        m.alloc(**{dx: dx_bytes}, **grads)
    else:
        m.alloc(**grads, **{dx: dx_bytes})
    m.free(*release)
    if uses_output_gradient:
        m.output_gradient_used()
    m.to_autograd(*grads)


def bias_grad(m: Allocations, d: Dims, bias: bool) -> None:
    """``y + b`` for a replicated ``[h]`` bias: its gradient, the incoming one summed over tokens."""
    if bias:
        m.alloc(bias_grad=d.h * d.e)
        m.to_autograd("bias_grad")


def gather_weight(m: Allocations, name: str, nbytes: float, *, row: bool, gathered: bool = False) -> str:
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


def gather_ahead(m: Allocations, d: Dims, name: str, nbytes: float) -> None:
    """:meth:`~megatron_paradyse.core.comm.Zero3Gathers.start`: linear ``name``'s weight, gathered ahead
    of its GEMM, alive from now on (nothing at ``p = 1``)."""
    if d.p > 1:
        m.alloc(**{f"{name}_w": nbytes})


def gather_mlp_weight_ahead(m: Allocations, d: Dims) -> None:
    """:meth:`~megatron_paradyse.strategies.AttentionContext.start_mlp_gather`: the MLP's fc1 weight,
    where the layer gathers it during the attention."""
    if d.mlp_weight_ahead:
        gather_ahead(m, d, "fc1", d.f1 * d.h * d.e)


def mlp_weight_handed_on(m: Allocations, d: Dims) -> float:
    """The attention's forward is done: the MLP's weight gathered ahead lives on into the MLP (bytes)."""
    if not d.mlp_weight_ahead:
        return 0.0
    nbytes = m.sizes["fc1_w"]
    m.free("fc1_w")
    return nbytes


def zero3_forward(
    m: Allocations,
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
    weight = gather_weight(m, f"{name}_w", w, row=row, gathered=gathered)
    if ahead is not None:
        gather_ahead(m, d, *ahead)
    m.alloc(**{out: out_bytes})
    m.free(weight, *((f"{name}_b",) if bias else ()))


def zero3_backward(
    m: Allocations,
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
    uses_output_gradient: bool = False,
) -> None:
    """``zero3_linear``'s backward: the weight gathered again (``gathered``: its gather was started
    ahead, :func:`gather_ahead`; otherwise now) while the full weight gradient's GEMM runs; that
    gradient, in the accumulation dtype (a cast of the GEMM's result for half precision; row: laid out
    as ``[p, out, in/p]``, a copy), reduce-scattered to the shard while ``dx = dy W`` runs, alive until
    then, and the shard rounded back to its dtype; the bias's gradient likewise (summed straight into
    the accumulation dtype, waited for); then ``release`` (the incoming gradient, the saved input) and
    the shard gradients (accumulated into ``.grad``) die. ``uses_output_gradient``: the backward's first
    node (:meth:`Allocations.output_gradient_used`)."""
    if d.p == 1:
        linear_backward(m, dx, dx_bytes, w, bias, release=release, uses_output_gradient=uses_output_gradient)
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
    weight = gather_weight(m, f"{name}_w", w, row=row, gathered=True)
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
    if uses_output_gradient:
        m.output_gradient_used()
    m.to_autograd(*grads)


def column_forward(m: Allocations, d: Dims, out: str, out_bytes: float, bias: bool) -> None:
    """``out`` from Megatron's column-parallel ``linear_qkv``/``linear_fc1`` (``tp_sp``) and its bias:
    the input all-gathered into Megatron's global buffer (held outside the layer), the GEMM's output,
    and with a bias their sum (a new tensor: Megatron's ``output + bias``, or the caller's for a bias
    the module returns). Autograd keeps ``x_local``."""
    m.alloc(**{out: out_bytes})
    if bias:
        m.alloc(column_biased=out_bytes)
        m.free(out)
        m.rename(column_biased=out)


def column_backward(m: Allocations, d: Dims, dy: str, w: float, bias: float) -> None:
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


def row_forward(m: Allocations, d: Dims, bias: bool) -> None:
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


def gathered_gradient(d: Dims) -> float:
    """The all-gathered ``[s, b, h]`` output gradient with which ``tp_sp``'s backward starts (its
    reduce-scatter's backward, before the row-parallel linear reads its saved input)."""
    return d.s * d.b * d.h * d.e if d.p > 1 else 0.0


def row_backward(m: Allocations, d: Dims, dx: str, dx_bytes: float, w: float, *, release: tuple[str, ...]) -> None:
    """The backward of Megatron's row-parallel linear (``tp_sp``), the sublayer's first node
    (:meth:`Allocations.output_gradient_used`): its reduce-scatter's backward all-gathers the output
    gradient to ``[s, b, h]`` (p > 1), then the input gradient ``dx`` and the weight's; then the gathered
    gradient, ``release`` (the saved input) and the weight gradient (accumulated into ``.grad``) die."""
    gathered = ("dy_full",) if d.p > 1 else ()
    if gathered:
        m.alloc(dy_full=gathered_gradient(d))
        m.output_gradient_used()
    m.alloc(**{dx: dx_bytes}, row_dw=w)
    m.free(*gathered, *release)
    if not gathered:
        m.output_gradient_used()
    m.to_autograd("row_dw")


def add_bias_memory(m: Allocations, d: Dims, out: str) -> None:
    """``add_bias_memory(out, b)``: a new ``y_local`` with a bias, ``out`` itself without one."""
    if d.bias:
        m.alloc(y_local=d.x)
    else:
        m.rename(**{out: "y_local"})
