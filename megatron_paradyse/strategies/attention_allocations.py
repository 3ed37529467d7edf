"""Memory-script building blocks of attention: the kernels' calls, the ring's hops, the q/k transform
(norms, RoPE) and full-sequence attention; the norms too, which the layer composes
(:mod:`~megatron_paradyse.strategies.allocations`).
"""

from __future__ import annotations

import dataclasses
import functools

from megatron_paradyse.attention.kernels import EFFICIENT_LSE_ROWS
from megatron_paradyse.core.layout import Segment, SequenceLayout
from megatron_paradyse.strategies.allocations import MEMO_SIZE, Allocations, Call, Iteration, Loop, State
from megatron_paradyse.strategies.dims import Dims

__all__ = [
    "Block",
    "Normed",
    "QK",
    "block_of",
    "full_attention_backward",
    "full_attention_forward",
    "norm_backward",
    "norm_forward",
    "qk_backward",
    "qk_forward",
    "ring_backward_memory",
    "ring_forward_memory",
]


def _fused_kernel(d: Dims) -> bool:
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


def _kernel_forward(m: Allocations, d: Dims, out: str, lse: str, heads: int, kv_heads: int, sq: int, sk: int) -> None:
    """One kernel call: ``out [b, heads, sq, hn]`` and its log-sum-exp; with GQA (but FlashAttention) the
    key/value heads are first repeated for their query heads (``_expand_kv``, for the call only)."""
    expand = heads != kv_heads and not _fused_kernel(d)
    expanded = {f"{out}_k": d.b * heads * sk * d.hn * d.e, f"{out}_v": d.b * heads * sk * d.hn * d.e}
    if expand:
        m.alloc(**expanded)
    m.alloc(**{out: d.b * heads * sq * d.hn * d.e, lse: d.b * heads * _lse_rows(d, sq) * d.acc})
    if expand:
        m.free(*expanded)


def _kernel_backward(
    m: Allocations, d: Dims, grads: tuple[str, str, str], heads: int, kv_heads: int, sq: int, sk: int
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
    if _fused_kernel(d):
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
    m: Allocations,
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


Block = tuple[tuple[int, int], ...]
"""What a ring hop's memory depends on: the (rows, columns) of each visible segment of the block."""


@functools.lru_cache(maxsize=MEMO_SIZE)
def block_of(segments: tuple[Segment, ...]) -> Block:
    """The :data:`Block` of a ring hop's segments (memoised: ranks and hops repeat a few blocks)."""
    return tuple((seg.q_end - seg.q_start, seg.k_end - seg.k_start) for seg in segments)


def _merge(m: Allocations, d: Dims, heads: int, rows: int) -> None:
    """``merge_into`` of ``rows`` query rows: the new log-sum-exp, its shift and the two weights, each
    a ``[b, heads, rows]`` accumulator, for the in-place update only."""
    row = d.b * heads * rows * d.acc
    m.temporary(merge_lse=row, merge_shift=row, merge_w_old=row, merge_w_new=row)


def _accumulate_block(m: Allocations, d: Dims, block: Block, heads: int, kv_heads: int) -> None:
    """``accumulate_block``: per visible segment a kernel call, merged into the running accumulators
    in place; each call's results die before the next call."""
    for rows, cols in block:
        _kernel_forward(m, d, "seg_out", "seg_lse", heads, kv_heads, rows, cols)
        _merge(m, d, heads, rows)
        m.free("seg_out", "seg_lse")


def _accumulate_block_grads(m: Allocations, d: Dims, block: Block, heads: int, kv_heads: int, sq: int) -> None:
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
class Normed:
    """What one norm normalises: ``vectors`` vectors of ``width`` features."""

    vectors: int
    width: int

    @classmethod
    def hidden(cls, d: Dims) -> Normed:
        """A ``[t, b, h]`` activation: the layer's norms."""
        return cls(d.t * d.b, d.h)

    @classmethod
    def heads(cls, d: Dims, rows: int, heads: int) -> Normed:
        """``[rows, b, heads, hn]`` queries or keys, normalised per head: the q/k norms."""
        return cls(rows * d.b * heads, d.hn)


@dataclasses.dataclass(frozen=True, slots=True)
class QK:
    """Queries and keys after :func:`qk_forward`, by name (``qkv``'s own where they are its
    untransformed views), and what the transform's backward needs: ``kept`` (the norms' statistics,
    q's copy that the q norm keeps, RoPE's ``cos``/``sin``), freed by :func:`qk_backward`;
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


def qk_forward(m: Allocations, d: Dims, rows: int, heads: int, kv_heads: int, qkv: str, *, grad: bool = True) -> QK:
    """``split_qkv`` and Megatron's query/key transform (``modules._QKTransform``) of the projection
    ``qkv`` ``[rows, b, ...]`` (alive) into q ``[rows, b, heads, hn]`` and k ``[rows, b, kv_heads,
    hn]``: q is copied out where several groups' query heads are gathered (k, v are views); the q
    then the k norm (``shape.qk_norm``: each a new tensor, keeping its input and statistics); RoPE
    (:func:`_rotate`). ``grad``: autograd records the transform (without, as in ``lean``'s
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
            norm_forward(m, d, f"{name}_norm", Normed.heads(d, rows, n))
            made.append(f"{name}_norm_out")
            if grad:
                kept.append(f"{name}_norm_stats")
            else:
                m.free(f"{name}_norm_stats")
        if grad and q != qkv:
            kept.append(q)
        q, k = "q_norm_out", "k_norm_out"
    if d.rotary_dim:  # RoPE (mcore.rotary), which keeps nothing
        q, k = _rotate(m, d, rows, heads, "rope_q"), _rotate(m, d, rows, kv_heads, "rope_k")
    m.free(*(name for name in made if name not in (q, k, *kept)))
    return QK(qkv, q, k, tuple(kept), norms_keep_qkv=grad and d.shape.qk_norm)


def qk_backward(
    m: Allocations,
    d: Dims,
    rows: int,
    heads: int,
    kv_heads: int,
    qk: QK,
    dq: str | None,
    dk: str | None,
    *,
    caller_holds_qkv: bool = False,
) -> tuple[str | None, str | None]:
    """The backward of :func:`qk_forward` from the gradients of the transformed q and k (None: the
    caller holds it), k's nodes before q's (autograd runs the later-made first): through the
    rotations, then the norms; frees ``qk.kept`` and, once no norm keeps it and unless
    ``caller_holds_qkv``, the projection. Returns the gradients of the split's q and k (new tensors,
    or the given ones where nothing transformed them)."""
    grads = {"q": dq, "k": dk}
    if d.rotary_dim:
        for name, n in (("k", kv_heads), ("q", heads)):
            grads[name] = _rotate(m, d, rows, n, f"d_{name}", release=(grads[name],) if grads[name] else ())
    if d.shape.qk_norm:
        q_input = "q_copy" if "q_copy" in qk.kept else qk.qkv
        for name, n, norm_input in (("k", kv_heads, qk.qkv), ("q", heads, q_input)):
            norm_backward(m, d, f"{name}_norm", grads[name], Normed.heads(d, rows, n))
            grads[name] = f"{name}_norm_dx"
            still_kept = name == "k" and q_input == norm_input  # by the q norm, still to run
            if not still_kept and not (norm_input == qk.qkv and caller_holds_qkv):
                m.free(norm_input)
    return grads["q"], grads["k"]


def _rotate(m: Allocations, d: Dims, rows: int, heads: int, out: str, release: tuple[str, ...] = ()) -> str:
    """RoPE's rotation (``mcore.rotary``) of a ``[rows, b, heads, hn]`` tensor, forward or backward: its
    rows' ``cos`` and ``sin`` (:func:`_rope_cos_sin`), the result ``out`` and the cross terms ``[rows, b,
    heads, rot]``, which die with ``cos`` and ``sin``; then ``release``. Returns ``out``."""
    _rope_cos_sin(m, d, rows)
    m.alloc(**{out: rows * d.b * heads * d.hn * d.e, "rope_crossed": rows * d.b * heads * d.rotary_dim * d.e})
    m.free("rope_crossed", "rope_cos", "rope_sin", *release)
    return out


def _rope_cos_sin(m: Allocations, d: Dims, rows: int) -> None:
    """The table's rows (fp32 ``[rows, 1, 1, rot]``), then ``cos`` and ``sin`` of them, each computed in
    fp32, scaled by ``mscale`` (a new tensor even at 1) and cast to the activations' dtype (``rope_cos``,
    ``rope_sin``); the rows die."""
    angles = rows * d.rotary_dim * 4
    m.alloc(rope_freqs=angles)
    for fn in ("cos", "sin"):
        m.alloc(rope_angles=angles, rope_scaled=angles)
        m.free("rope_angles")
        if d.half:
            m.alloc(**{f"rope_{fn}": rows * d.rotary_dim * d.e})
            m.free("rope_scaled")
        else:
            m.rename(rope_scaled=f"rope_{fn}")
    m.free("rope_freqs")


def full_attention_forward(
    m: Allocations, d: Dims, layout: SequenceLayout, qkv: str, heads: int, kv_heads: int
) -> tuple[tuple[str, ...], QK, str]:
    """``attend_full_sequence`` of ``qkv`` ``[s, b, (heads + 2 kv_heads) hn]`` (alive): q, k and their
    transform (:func:`qk_forward`), q/k/v put in natural order (causal: copies; otherwise those still views
    of the projection copied dense, v always, so the projection dies unless q/k norms keep it), the attention (one
    causal document and its padding: one call over the whole sequence, then the padding's rows redone;
    several documents: FlashAttention's one variable-length call, :func:`_varlen_call`; elsewhere one
    kernel call per document, written into a zeroed output; none with :attr:`Dims.core_kept`), the output
    as ``[s, b, heads hn]`` in canonical order (causal: a copy; otherwise a view, the kernel lays its
    output out sequence-major, but for the variable-length call's sample-major output of several
    samples: a copy). Returns what the attention keeps for backward (the transform's own kept apart, in
    the :class:`QK`) and the name of that output."""
    core = d.s * d.b * heads * d.hn * d.e
    kv = d.s * d.b * kv_heads * d.hn * d.e
    qk = qk_forward(m, d, d.s, heads, kv_heads, qkv)
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
    varlen = len(segments) > 1 and not tail and _fused_kernel(d)
    whole = len(segments) == 1 or tail
    if d.core_kept:  # the forward's output and log-sum-exp, taken back: no kernel runs
        m.kept(attn_out=core, lse=d.b * heads * (_lse_rows(d, d.s) if whole else d.s) * d.acc)
    elif whole:
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


def _varlen_call(m: Allocations, d: Dims, docs: int, inputs: dict[str, float], **results: float) -> None:
    """A variable-length call (``blocks._SegmentAttention``) over ``docs`` documents of each of ``b``
    samples: with several samples, its ``inputs`` made token-major (copies; one sample's are views) and
    the bounds repeated per sample (int32); then its ``results``; the copies die with the call."""
    copies = {f"{name}_tokens": nbytes for name, nbytes in inputs.items()} if d.b > 1 else {}
    if d.b > 1:
        copies["cu_seqlens"] = (d.b * docs + 1) * 4
    m.alloc(**copies)
    m.alloc(**results)
    m.free(*copies)


def full_attention_backward(
    m: Allocations,
    d: Dims,
    layout: SequenceLayout,
    dcore: str,
    kept: tuple[str, ...],
    qk: QK,
    heads: int,
    kv_heads: int,
) -> str:
    """The backward of :func:`full_attention_forward` from ``dcore``: releases it and what was kept,
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
    elif _fused_kernel(d):
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
    grads["q"], grads["k"] = qk_backward(m, d, d.s, heads, kv_heads, qk, grads["q"], grads["k"])
    m.alloc(d_qkv=core + 2 * kv)  # split's backward: one tensor
    m.free(*grads.values())
    return "d_qkv"


def ring_forward_memory(d: Dims, blocks: tuple[Block, ...], heads: int, kv_heads: int) -> Call:
    """``ring_attention_forward`` on this rank's ``t`` queries of ``heads`` heads, its hops seeing
    ``blocks`` (:func:`block_of` of each of :func:`ring_hops`): the stacked K/V block and the one in
    flight, the running output and log-sum-exp (accumulation dtype) merged into in place
    (:func:`_ring_forward_hop`). Leaves ``out`` (in the activations' dtype: a copy for half
    precision) and ``lse``."""
    t, b, hn, acc = d.t, d.b, d.hn, d.acc
    loop = Loop(Allocations(kv=2 * b * kv_heads * t * hn * d.e, out=b * heads * t * hn * acc, lse=b * heads * t * acc))
    for hop, block in enumerate(blocks):
        loop.add(_ring_forward_hop(d, heads, kv_heads, block, loop.state, last=hop + 1 == d.p))
    m = loop.end()
    if d.half:
        m.alloc(out_cast=b * heads * t * hn * d.e)
        m.free("out")
        m.rename(out_cast="out")
    m.free("kv")
    return Call(m.peak, (("out", m.sizes["out"]), ("lse", m.sizes["lse"])))


@functools.lru_cache(maxsize=MEMO_SIZE)
def _ring_forward_hop(d: Dims, heads: int, kv_heads: int, block: Block, state: State, *, last: bool) -> Iteration:
    """One hop of :func:`ring_forward_memory` from ``state``: the next block arrives while the kernels
    run on ``block`` and merge into the accumulators. Memoised: ranks and hops repeat the same few
    blocks."""
    m = Allocations(**dict(state))
    if not last:
        m.alloc(kv_next=2 * d.b * kv_heads * d.t * d.hn * d.e)
    _accumulate_block(m, d, block, heads, kv_heads)
    if not last:
        m.free("kv")
        m.rename(kv_next="kv")
    return Iteration(m.peak, m.state())


def ring_backward_memory(d: Dims, blocks: tuple[Block, ...], heads: int, kv_heads: int) -> Call:
    """``ring_attention_backward``: the stacked K/V block and the one in flight, ``dq`` and each hop's
    ``dk``/``dv`` accumulator (accumulation dtype), the accumulator leaving and the one arriving
    (:func:`_ring_backward_hop`). Leaves the input gradients: for half precision copies in the
    activations' dtype (``dq``, ``dk``, ``dv``), otherwise ``dq`` and the arrived accumulator
    ``dkv`` (``dk``/``dv`` are views of it)."""
    t, b, hn = d.t, d.b, d.hn
    loop = Loop(Allocations(kv=2 * b * kv_heads * t * hn * d.e, dq=b * heads * t * hn * d.acc))
    for hop, block in enumerate(blocks):
        loop.add(_ring_backward_hop(d, heads, kv_heads, block, loop.state, last=hop + 1 == d.p))
    m = loop.end()
    if not d.half:
        return Call(m.peak, (("dq", m.sizes["dq"]), ("dkv", m.sizes["arrived"])))
    kv_grad = b * kv_heads * t * hn * d.e
    m.alloc(dq_cast=b * heads * t * hn * d.e, dk=kv_grad, dv=kv_grad)
    return Call(m.peak, (("dq", m.sizes["dq_cast"]), ("dk", kv_grad), ("dv", kv_grad)))


@functools.lru_cache(maxsize=MEMO_SIZE)
def _ring_backward_hop(d: Dims, heads: int, kv_heads: int, block: Block, state: State, *, last: bool) -> Iteration:
    """One hop of :func:`ring_backward_memory` from ``state`` (the K/V block ``kv``, ``dq``, the
    accumulator ``sent`` last hop and the one that ``arrived``): the next block arrives, the hop's
    accumulator is made and filled from the kernels' gradients on ``block``; the one sent last hop
    is released once its send completed, the arrived one is added and this one goes on while the
    next one arrives. Memoised like the forward's."""
    kv_bytes = 2 * d.b * kv_heads * d.t * d.hn * d.e
    kv_acc = kv_bytes // d.e * d.acc
    m = Allocations(**dict(state))
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
    return Iteration(m.peak, m.state())


def norm_forward(m: Allocations, d: Dims, name: str, normed: Normed | None = None) -> None:
    """One norm (``megatron_paradyse.mcore.norm``) of ``normed`` (default: a ``[t, b, h]`` activation):
    its output ``{name}_out`` and the statistics it keeps, ``{name}_stats`` (it keeps its input too:
    the caller's). LayerNorm keeps mean and rstd (the input's dtype on the CPU, fp32 on CUDA), RMSNorm
    an fp32 rstd; torch's fused RMSNorm kernel is one kernel on CUDA, a chain of operators on the CPU
    (in the accumulation dtype: the input's square, ``x rstd``, times the weight)."""
    n = normed or Normed.hidden(d)
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


def norm_backward(m: Allocations, d: Dims, name: str, dy: str | None, normed: Normed | None = None) -> None:
    """The backward of :func:`norm_forward` from ``dy`` (None: the caller holds it): leaves
    ``{name}_dx``; the weight's (and bias's) gradient is accumulated; ``dy`` and the statistics die.
    RMSNorm on the CPU runs ``norm._RMSNorm``'s own backward: ``x_hat``, ``g = dy w`` and two products
    in the accumulation dtype."""
    n = normed or Normed.hidden(d)
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
