"""A layer's memory on one rank, composed from its sublayers' (each strategy's own ``memory``,
:mod:`megatron_paradyse.strategies.allocations`) with the layer's norms and residuals, an MLP over tiles,
and recompute.
"""

from __future__ import annotations

import dataclasses

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import mlp_tile_rows
from megatron_paradyse.strategies import Sublayer, get_strategy
from megatron_paradyse.strategies.allocations import Allocations, Call, SublayerMemory
from megatron_paradyse.strategies.attention_allocations import norm_backward, norm_forward
from megatron_paradyse.strategies.dims import Dims
from megatron_paradyse.strategies.recorded import recorded_memory

__all__ = ["LayerMemory", "layer_memory", "norm_peak", "sublayer_memory", "tiled_mlp_memory"]


def sublayer_memory(sublayer: Sublayer, name: str, d: Dims, layout: SequenceLayout, rank: int = 0) -> SublayerMemory:
    """The memory of strategy ``name`` running ``sublayer`` on ``rank`` for a micro-batch laid out as
    ``layout``."""
    strategy = get_strategy(sublayer, name)
    if d.weight_ranks != d.p and strategy.memory is not None:
        raise ValueError(
            f"the memory of {sublayer} strategy {name!r} on a sub-group of the shards' ranks is not modelled: "
            "only a strategy recorded from its code (every MLP strategy) is priced there"
        )
    if strategy.memory is None:
        return recorded_memory(d, rank if strategy.depends_on_rank else 0, sublayer=sublayer, name=name)
    return strategy.memory(d, layout, rank)


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
    full, last = divmod(t, rows)
    tiles = full + bool(last)

    def tile_memory(n: int, **grads) -> SublayerMemory:
        return sublayer_memory("mlp", name, dataclasses.replace(d, s=n * d.p, **grads), layout)

    # A run of alike tiles adds the same to what the tiles before left, which only grows: its high-water
    # mark is its last tile's. So each run is priced once, whatever the length (a tile each would take
    # minutes at billions of tokens).
    forward = 0.0
    done = 0.0  # the outputs of the tiles so far
    for n, count in ((rows, full), (last, int(bool(last)))):
        if count:
            done += (count - 1) * x * n / t
            forward = max(forward, done + tile_memory(n).fwd_peak - x * n / t)
            done += x * n / t
    # the weights serve every tile: autograd holds their gradients from the first tile's backward and
    # adds each later tile's to them, until the last tile's have come
    handed = tile_memory(rows).grads_handed  # the same weights' gradients, whatever the tile
    backward = 0.0
    done = 0.0  # the input gradients of the tiles so far
    # from the last tile: itself (the shorter one, if any), the tiles between, the first
    for i, count in ((0, 1), (1, tiles - 2), (tiles - 1, int(tiles > 1))):
        if count < 1:
            continue
        before = handed if i > 0 else ()
        n = last if i == 0 and last else rows
        tile, tile_x = tile_memory(n, grads_held=i < tiles - 1, grads_before=before), x * n / t
        kept = tile.saved_bytes - (tile_x if "x_local" in dict(tile.saved) else 0.0)
        rebuilt = sum(before) + tile.bwd_prelude + tile.fwd_peak - tile_x  # on what the backward made first
        done += (count - 1) * tile_x
        backward = max(backward, done + max(rebuilt, kept + tile.bwd_peak))
        done += tile_x
    return SublayerMemory((("x_local", x),), max(x + forward, 3 * x), max(backward, 2 * x))


def norm_peak(d: Dims) -> float:
    """High-water mark of one norm of ``[t, b, h]`` run on its own (a stage's final norm, between its
    last layer and its output layer), above its input: its forward, and its backward from its output's
    gradient (the output gone, the statistics kept)."""
    m = Allocations()
    norm_forward(m, d, "norm")
    forward = m.peak
    m.free("norm_out")
    m.alloc(output_grad=d.x)
    norm_backward(m, d, "norm", "output_grad")
    return max(forward, m.peak)


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
    kept_core_bytes: float = 0.0
    """The attention core's results that a recompute keeping them (``+rc+keepcore``) holds from the
    forward to the backward (0: not priced)."""
    kept_core_rebuilt_peak_bytes: float = 0.0
    """High-water mark of the rebuilt forward of a recompute that keeps the attention core."""

    def saved_and_peak(
        self, *, recompute: bool, offload: bool = False, keep_core: bool = False, backward_held: float = 0.0
    ) -> tuple[float, float]:
        """(saved bytes, high-water mark) with or without recompute; ``backward_held``: bytes that exist
        beside the layer in backward only (a tied output layer's weight gradient).

        ``keep_core`` (with recompute) keeps the attention core's results on the device too, and reruns
        the layer without its attention kernel; its first forward is counted at the forward's high-water
        mark without recompute (an upper bound: the checkpoint drops what only autograd holds), which
        that rerun may no longer reach.

        ``offload`` (with recompute) keeps the layer's input in host memory: the device holds one
        activation less from the forward to the backward, counted here as the layer's own saved
        activation (:func:`~megatron_paradyse.cost.base.stage_layer_bytes`). In the backward its input is
        back, in place of the layer's output that the count of the layers before stands for (it is gone,
        its gradient in its place), and beside it the next offloaded layer's input, prefetched: one
        activation more."""
        rebuilt = self.rebuilt_peak_bytes if recompute else 0.0
        kept = 0.0
        if keep_core:
            rebuilt, kept = max(self.kept_core_rebuilt_peak_bytes, self.forward_peak_bytes), self.kept_core_bytes
        backward = max(self.backward_peak_bytes, rebuilt) + backward_held
        if offload:
            return kept, backward + self.activation_bytes
        if recompute:  # the forward keeps nothing else, and works no more than the rebuilt forward
            return self.activation_bytes + kept, backward
        return self.saved_bytes, max(self.forward_peak_bytes, backward)


def _dropout_add(m: Allocations, d: Dims, prefix: str, out: str) -> None:
    """Megatron's bias-dropout-add of sublayer ``prefix``'s output into the residual stream, as ``out``.
    With hidden dropout, torch's dropout first: on the CPU a noise tensor, then the product; on CUDA one
    kernel, its output and a bool mask (:attr:`Dims.dropout_mask`), which autograd keeps. The sublayer's
    output and the dropped-out copy die after the sum."""
    dropped = (f"{prefix}dropped",) if d.hidden_dropout else ()
    if d.hidden_dropout:
        m.alloc(**{f"{prefix}dropout_mask": d.dropout_mask, f"{prefix}dropped": d.x})
    m.alloc(**{out: d.x})
    m.free(f"{prefix}y_local", *dropped)


def _layer_forward(attn: SublayerMemory, mlp: SublayerMemory, d: Dims) -> Allocations:
    """The layer's forward, above its input: norm 1 (output and statistics; it keeps the layer's input),
    the attention, the residual ``x1`` (:func:`_dropout_add`), norm 2 (keeping ``x1``), the MLP, the
    output. An attention core kept for a recompute (:attr:`SublayerMemory.kept_core`) is alive from the
    start."""

    def forward(m: Allocations, sub: SublayerMemory, prefix: str) -> None:
        """On ``{prefix}x_local`` (and what the sublayer before handed on): the high-water mark (the input
        in it), then what it keeps, its output and what it hands on."""
        m.free(f"{prefix}x_local", *(name for name in m.sizes if name.endswith("handed_on")))
        handed_on = (("handed_on", sub.handed_on),) if sub.handed_on else ()
        m.call(Call(sub.fwd_peak, (("saved", sub.saved_bytes), ("y_local", d.x), *handed_on)), prefix)

    m = Allocations()
    norm_forward(m, d, "ln1")
    m.peak += attn.kept_core  # beside norm 1's working set (the attention's counts it from its start)
    m.rename(ln1_out="attn.x_local")
    forward(m, attn, "attn.")
    _dropout_add(m, d, "attn.", "x1")
    norm_forward(m, d, "ln2")
    m.rename(ln2_out="mlp.x_local")
    forward(m, mlp, "mlp.")
    _dropout_add(m, d, "mlp.", "output")
    return m


def layer_memory(
    attn: SublayerMemory, mlp: SublayerMemory, d: Dims, kept_core: SublayerMemory | None = None
) -> LayerMemory:
    """A layer's memory from its sublayers' between the layer's own tensors, with and without recompute;
    ``kept_core``: the attention's memory with its core's results kept (:attr:`Dims.core_kept`), where
    a recompute that keeps them is priced.

    Forward: :func:`_layer_forward`. Backward from the output's gradient (the
    next layer's or the loss's), which takes the output's place (by then the output's consumer has freed
    it) and dies into the residual's summed gradient: the MLP, norm 2's backward, that sum, the attention,
    norm 1's. With hidden dropout each sublayer's backward starts from the dropout's (the gradient times
    the mask, which dies), a gradient only autograd holds: it dies once the sublayer's first node has
    used it (:attr:`SublayerMemory.bwd_peaks_around_use`). Recompute keeps only the output (and a kept
    core's results); its forward keeps nothing else, and the backward first reruns the whole layer, then
    runs as without recompute.
    """
    x = d.x

    def backward(m: Allocations, sub: SublayerMemory, prefix: str) -> None:
        if not d.hidden_dropout:
            m.peak = max(m.peak, m.live + sub.bwd_peak)
            m.free(f"{prefix}saved")
        else:
            m.alloc(**{f"{prefix}dy": x})
            m.free(f"{prefix}dropout_mask")
            until, after = sub.bwd_peaks_around_use or (sub.bwd_peak, 0.0)
            m.peak = max(m.peak, m.live + until, m.live - x + after)
            m.free(f"{prefix}saved", f"{prefix}dy")
        m.alloc(**{f"{prefix}dx_local": x})

    m = _layer_forward(attn, mlp, d)
    saved, forward_peak = m.live, m.peak
    # recompute reruns this forward to the layer's end (no early stop) once the backward first reads a
    # saved tensor: beside the output's gradient and what the MLP's backward made before (with dropout,
    # its mask is the first read)
    prelude = x + (0.0 if d.hidden_dropout else mlp.bwd_prelude)
    rebuilt_peak = prelude + forward_peak
    core_bytes = core_rebuilt_peak = 0.0
    if kept_core is not None:  # the same rerun, without the attention kernel, beside the kept results
        core_bytes = kept_core.kept_core
        core_rebuilt_peak = prelude + _layer_forward(kept_core, mlp, d).peak
    m.peak = m.live  # the backward's high-water mark from here
    backward(m, mlp, "mlp.")
    norm_backward(m, d, "ln2", "mlp.dx_local")
    m.free("x1")
    m.alloc(attn_dy=x)  # the output's gradient plus norm 2's
    m.free("ln2_dx", "output")  # "output" stands for the output's gradient, which dies here
    backward(m, attn, "attn.")
    norm_backward(m, d, "ln1", "attn.dx_local")
    m.alloc(dx=x)
    return LayerMemory(x, saved, forward_peak, m.peak, rebuilt_peak, core_bytes, core_rebuilt_peak)
