"""The calibrated cost model: strategy terms (:mod:`cost.terms`) priced with a machine's profile.

Time of one layer on one rank, forward + backward (+ one more forward with recompute; keeping the
attention core, the attention's rerun without the core, :meth:`SublayerTerms.without_core`)::

    compute  = sum over GEMMs  of gemm_fwd(m, n, k) + gemm_bwd(m, n, k)
             + sum over kernel calls of attn_fwd(call) + attn_bwd(call)      (ring hops' too)
             + elementwise bytes * per_byte + ops * per_op
    comm     = sum over collectives of latency(kind, p) + bytes * per_byte(kind, p)
             + what communication adds to the compute it overlaps, exposed(c, m) = max(c, m) +
               (1 - overlap) * min(c, m) - c: per ring hop (c: its kernels, m: its sends) and per
               pass for streamed collectives (c: the pass's GEMMs and kernels, m: the collectives)
    time     = k_compute * compute + k_comm * comm + per_sync_s * syncs + per_layer_s

The prices of the atoms (``gemm_*``, ``attn_*``, a collective's, ``exposed``) are
:mod:`cost.pricing`'s. ``syncs`` counts collectives and ring hops. The correction (``k = 1``, the rest 0
without one) is fitted by ``paradyse calibrate --fit-correction`` on a few measured layers.

Memory is :mod:`cost.layer_memory`'s saved and transient bytes of the layer; the stage peak adds the static
bytes (the same for every plan, given by the caller: see :mod:`megatron_paradyse.mcore.static_memory`), the
stage's own activations (:meth:`AnalyticCostModel.stage_bytes`), and the larger of
the largest layer working set and the output layer's (:meth:`AnalyticCostModel.loss_bytes`), with
the allocator's slack.

The planner prices every option of one layout in a row, and the options share their sublayers: the
model keeps, for the latest (layout, micro-batch size) only, each sublayer's terms and priced passes
by (sublayer, strategy, rank), each distinct kernel call's time, each distinct pair of sublayer
memories' layer memory, and each option's layer cost. A job's pipeline stages run the same layers:
their models (:meth:`AnalyticCostModel.for_stage`) share all of it, so every rank, planning every
stage, prices each option of a layout once. Results are those of pricing each option alone, to
floating-point rounding.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

import torch

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption, Plan, loss_chunk_rows, mlp_tile_rows
from megatron_paradyse.cost.base import WHOLE_LOSS, LayerCost, StageOptions, stage_layer_bytes
from megatron_paradyse.cost.layer_memory import LayerMemory, layer_memory, norm_peak, sublayer_memory, tiled_mlp_memory
from megatron_paradyse.cost.pricing import PassTime, TermPrices
from megatron_paradyse.cost.profile import load_profile
from megatron_paradyse.cost.terms import sublayer_terms
from megatron_paradyse.strategies import ModelShape, gathers_mlp_weight_ahead, get_strategy
from megatron_paradyse.strategies.allocations import SublayerMemory
from megatron_paradyse.strategies.dims import Dims
from megatron_paradyse.strategies.terms import Collective, Gemm

__all__ = ["AnalyticCostModel", "TimeBreakdown"]

# Memory-bound ops a layer runs whatever the strategy: two norms and two residual adds, forward.
_NORMS_AND_RESIDUALS_PASSES = 2 * 2 + 2 * 3
# Passes of the cross-entropy's forward over its fp32 logits (copy, max, exp, sum, softmax in place).
_CROSS_ENTROPY_PASSES = 5
# Its backward's passes over them (the softmax less the target's one-hot, scaled by the loss's gradient).
_CROSS_ENTROPY_BACKWARD_PASSES = 2
# Bytes per gathered token the cross-entropy's forward holds beside the logits at its high-water mark
# (megatron-core 0.19's unfused vocab-parallel one, traced): the labels made [s, b]-contiguous and the
# masked targets (int64), the out-of-range mask (bool), the logits' max (fp32), the row index (int64), and
# the target's logit, gathered and copied (fp32).
_CROSS_ENTROPY_TOKEN_BYTES = 8 + 8 + 1 + 4 + 8 + 4 + 4


@dataclasses.dataclass(frozen=True, slots=True)
class TimeBreakdown:
    compute_s: float
    """GEMMs, attention kernels (ring hops' included) and memory-bound work."""
    comm_s: float
    """Collectives, and the part of ring hops and streamed collectives that computation does not hide."""
    syncs: int
    """Collectives and ring hops: points where the ranks wait for each other."""
    total_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class _Sublayer:
    """One sublayer on one rank: its priced passes, its memory, and what of that memory a layer's
    depends on."""

    forward: PassTime
    backward: PassTime
    memory: SublayerMemory
    memory_key: tuple


def _memory_key(memory: SublayerMemory) -> tuple:
    """All that :func:`layer_memory` reads of a sublayer's memory."""
    return (
        memory.saved_bytes,
        memory.fwd_peak,
        memory.bwd_peak,
        memory.bwd_prelude,
        memory.handed_on,
        memory.kept_core,
        memory.bwd_peaks_around_use,
    )


@dataclasses.dataclass(slots=True)
class _LayoutMemo:
    """What the options of one (layout, micro-batch size) share: sublayers by (sublayer, strategy,
    rank), every attention strategy being in ``len(mlp)`` options and every MLP strategy in
    ``len(attention)``, each twice for recompute; a layer's memory (with and without recompute) by its
    sublayers' (ranks often agree)."""

    key: tuple
    dims: Dims
    sublayers: dict[tuple[str, str, int], _Sublayer] = dataclasses.field(default_factory=dict)
    layer_memory: dict[tuple, LayerMemory] = dataclasses.field(default_factory=dict)
    layer_costs: dict[tuple[LayerOption, float], LayerCost] = dataclasses.field(default_factory=dict)
    """By option and the bytes held beside every layer's backward (a stage's tied output layer's)."""


@dataclasses.dataclass(slots=True)
class _LatestLayout:
    """The latest layout's memo, shared by the models of one job's pipeline stages (as their
    :class:`TermPrices` are)."""

    memo: _LayoutMemo | None = None


class AnalyticCostModel:
    """:class:`~megatron_paradyse.cost.base.CostModel` from a calibrated profile.

    ``AnalyticCostModel(profile, shape, p, dtype=torch.bfloat16, static_bytes=..., vocab_size=...)``
    or :meth:`from_file`; ``layer_cost(option, layout, micro_batch_size)`` for the planner.
    """

    def __init__(
        self,
        profile: dict[str, Any],
        shape: ModelShape,
        p: int,
        *,
        dtype: torch.dtype = torch.float32,
        static_bytes: float = 0.0,
        vocab_size: int = 0,
        rotary_dim: int = 0,
        bias: bool = True,
        normalization: str = "LayerNorm",
        hidden_dropout: bool = False,
        tied_unfused_output: bool = False,
        use_correction: bool = True,
    ):
        """``static_bytes``: what the rank holds whatever the plan, its weights, gradients and optimizer state
        (see :mod:`megatron_paradyse.mcore.static_memory`) and anything else resident; ``vocab_size``:
        Megatron's padded vocabulary if the stage holds the output layer, else 0 (see :meth:`loss_bytes`);
        ``rotary_dim``: the channels of each head RoPE rotates (0: the model has no RoPE); ``bias``: the
        linear layers have biases; ``normalization``: Megatron's ``LayerNorm`` or ``RMSNorm`` (they keep
        different tensors); ``hidden_dropout``: Megatron's hidden dropout is on (the embedding's output and
        every sublayer's are dropped out, each keeping its mask); ``tied_unfused_output``: the stage's output
        layer shares its embedding's weight and weight gradients are not fused into Megatron's buffer (no
        Transformer Engine or apex): autograd then holds the output layer's weight gradient ``[V/p, h]`` until
        the embedding's backward adds its own, through every layer's backward. Memory is counted for the
        profile's device."""
        if p > 1 and str(p) not in profile["collectives"]:
            raise ValueError(f"the profile has no collectives for p={p}; run `paradyse calibrate --p {p}`")
        dtype_name = str(dtype).removeprefix("torch.")
        if profile["dtype"] != dtype_name:
            raise ValueError(
                f"the profile's rates were measured in {profile['dtype']}, the model runs in {dtype_name}; "
                f"run `paradyse calibrate --dtype {dtype_name}`"
            )
        self.profile = profile
        self.shape = shape
        self.p = p
        self.dtype = dtype
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.static_bytes = float(static_bytes)
        self.vocab_size = vocab_size
        self.rotary_dim = rotary_dim
        self.bias = bias
        self.normalization = normalization
        self.hidden_dropout = hidden_dropout
        self.tied_unfused_output = tied_unfused_output
        self.device = profile["fingerprint"]["device"]
        correction = profile.get("correction") if use_correction else None
        self._k_compute = correction["compute"] if correction else 1.0
        self._k_comm = correction["comm"] if correction else 1.0
        self._per_layer = correction["per_layer_s"] if correction else 0.0
        self._per_sync = correction["per_sync_s"] if correction else 0.0
        self._terms = TermPrices(profile, p, self.element_size)
        self._latest = _LatestLayout()

    def for_stage(
        self, *, static_bytes: float, vocab_size: int, tied_unfused_output: bool = False
    ) -> AnalyticCostModel:
        """This model for another pipeline stage of the same layers, with that stage's static bytes and
        output layer (``vocab_size``, ``tied_unfused_output``: see the constructor); the two share what
        they price of a layout's layers."""
        stage = copy.copy(self)  # the profile, the shape, ``_terms`` and ``_latest`` shared
        stage.static_bytes = float(static_bytes)
        stage.vocab_size = vocab_size
        stage.tied_unfused_output = tied_unfused_output
        return stage

    @classmethod
    def from_file(cls, path: str | os.PathLike, shape: ModelShape, p: int, **kwargs) -> AnalyticCostModel:
        check_machine = kwargs.pop("check_machine", True)
        return cls(load_profile(path, p=p, check_machine=check_machine), shape, p, **kwargs)

    # -- the CostModel protocol ------------------------------------------------------------------
    def layer_cost(self, option: LayerOption, layout: SequenceLayout, micro_batch_size: int) -> LayerCost:
        """The slowest rank's time, the largest saved and transient bytes of any rank."""
        memo = self._memo(layout, micro_batch_size)
        key = (option, self._backward_held_bytes())
        cost = memo.layer_costs.get(key)
        if cost is None:
            times, saved, transient = zip(*self._per_rank(option, layout, micro_batch_size))
            host = memo.dims.x if option.offload else 0.0
            cost = memo.layer_costs[key] = LayerCost(max(t.total_s for t in times), max(saved), max(transient), host)
        return cost

    def peak_bytes(
        self,
        layout: SequenceLayout,
        micro_batch_size: int,
        saved_bytes: float,
        transient_bytes: float,
        stage: StageOptions = WHOLE_LOSS,
    ) -> float:
        """Static bytes, the stage's own activations (:meth:`stage_bytes`), every layer's saved
        activations, and the larger of the largest layer working set (a tied, unfused output layer's
        weight gradient beside its backward included: :meth:`layer_cost`) and the output layer's (it runs
        between the last layer's forward and its backward, with every layer's activations kept and no
        layer working), with the allocator's slack."""
        working = max(transient_bytes, self.loss_bytes(layout, micro_batch_size, stage.loss_chunk_tokens))
        resident = self.static_bytes + self.stage_bytes(layout, micro_batch_size, stage) + saved_bytes
        return resident + working * (1.0 + self.profile["allocator_slack"])

    def held_bytes(
        self, layout: SequenceLayout, micro_batch_size: int, saved_bytes: float, stage: StageOptions = WHOLE_LOSS
    ) -> float:
        """The stage's own activations (:meth:`stage_bytes`) and the layers' saved ones: :meth:`peak_bytes`
        above the static bytes, less the working set."""
        return self.stage_bytes(layout, micro_batch_size, stage) + saved_bytes

    def plan_peak_bytes(self, plan: Plan, layout: SequenceLayout, micro_batch_size: int) -> float:
        """:meth:`peak_bytes` of ``plan``'s layers and stage options at ``layout`` (as it is: the planner
        prices a bucket's edge)."""
        costs = [self.layer_cost(option, layout, micro_batch_size) for option in plan]
        saved, transient = stage_layer_bytes(((1, c) for c in costs), len(costs))
        return self.peak_bytes(layout, micro_batch_size, saved, transient, StageOptions.of(plan))

    def stage_options(self, loss_chunk_tokens: int) -> tuple[StageOptions, ...]:
        """:data:`WHOLE_LOSS`; on a stage that holds the output layer and with ``loss_chunk_tokens``, the
        loss in chunks; with p > 1 and no output layer gathering the whole sequence (none, or a chunked
        one), the layers without ``tp_sp`` and Megatron's whole-sequence buffer."""
        chunk = loss_chunk_tokens if self.vocab_size else 0
        options = [WHOLE_LOSS]
        if chunk:
            options.append(StageOptions(chunk))
        if self.p > 1 and (chunk or not self.vocab_size):
            options.append(StageOptions(chunk, sequence_buffer=False))
        return tuple(options)

    def stage_time_s(self, layout: SequenceLayout, micro_batch_size: int, stage: StageOptions) -> float:
        """The stage's work outside its layers, the same under every plan of ``stage``: where the stage
        holds the output layer (``vocab_size``), the output layer and the loss, forward and backward, and
        a chunked loss's recompute, one more forward of each chunk. The embedding's lookup and its
        reduce-scatter are left out (their share is small, and a micro-batch's measured window ends
        before the embedding's backward: :class:`~megatron_paradyse.run.log.MicroBatchMeter`)."""
        if not self.vocab_size:
            return 0.0
        d = self._memo(layout, micro_batch_size).dims
        gathered = d.t * self.p * d.b
        time = self._output_and_loss(gathered, backward=False) + self._output_and_loss(gathered, backward=True)
        if stage.loss_chunk_tokens:
            rows = loss_chunk_rows(stage.loss_chunk_tokens, self.p, d.t)
            time += -(-d.t // rows) * self._output_and_loss(rows * self.p * d.b, backward=False)
        return time

    def _output_and_loss(self, tokens: int, *, backward: bool) -> float:
        """One pass of the vocab-parallel output layer and cross-entropy over ``tokens`` gathered tokens:
        forward, the input's all-gather, the GEMM into this rank's ``V/p`` fp32 logits, the loss's passes
        over them and its three all-reduces (the logits' max, the sum of their exponentials, the target's
        logit; each priced as a reduce-scatter and an all-gather); backward, the loss's passes, the GEMM's
        two products and the input gradient's reduce-scatter."""
        d_h, element = self.shape.hidden_size, self.element_size
        logits = tokens * (self.vocab_size // self.p)
        ew = self.profile["elementwise"]
        gemm = Gemm(tokens, self.vocab_size // self.p, d_h)
        if backward:
            passes = _CROSS_ENTROPY_BACKWARD_PASSES
            compute = self._terms.gemm(gemm, "backward")
            comms = (Collective("reduce_scatter", tokens * d_h * element),)
        else:
            passes = _CROSS_ENTROPY_PASSES
            compute = self._terms.gemm(gemm, "forward")
            comms = (Collective("all_gather", tokens * d_h * element),)
            comms += (Collective("reduce_scatter", 4 * tokens), Collective("all_gather", 4 * tokens)) * 3
        compute += passes * (4 * logits * ew["per_byte_s"] + ew["per_op_s"])
        syncs = len(comms) if self.p > 1 else 0
        return self._k_compute * compute + self._k_comm * self._terms.comms(comms) + self._per_sync * syncs

    def stage_bytes(self, layout: SequenceLayout, micro_batch_size: int, stage: StageOptions = WHOLE_LOSS) -> float:
        """What the stage keeps outside its layers for the whole step: the micro-batch's inputs on the
        device (tokens, labels and position ids in int64, the loss mask in fp32: ``[b, s]`` each) and the
        layout's index tensors (:meth:`SequenceLayout.indices`: three int64 ``[s]``); its input
        ``[t, b, h]`` (the embedding's output or the previous stage's activation; the first layer's norm
        keeps it) and, with p > 1, what Megatron's vocab-parallel embedding keeps for its backward (its
        out-of-range mask, bool, and masked token ids, int64, ``[b, s]``; counted on every stage), and with
        hidden dropout the mask of the embedding's dropout (:attr:`Dims.dropout_mask`; every stage too);
        GPTModel's rotary table ``[s, 1, 1, rotary_dim]`` (fp32); with sequence parallelism, Megatron's
        global all-gather buffer: Megatron's sequence-parallel column linears (``tp_sp``'s, the output
        layer's) gather their input into it and keep it, so the layers' memory (:mod:`cost.layer_memory`)
        has no gathered input. It holds ``[s, b, h]``; where no layer runs ``tp_sp``
        (``stage.sequence_buffer`` False), what the output layer gathers: ``[s, b, h]``, one chunk of a
        chunked loss, or nothing on a stage without it. The training entry point
        releases the buffer and the rotary tables before each micro-batch
        (:mod:`megatron_paradyse.mcore.step_buffers`): they are the micro-batch's own."""
        tokens = layout.padded_len * micro_batch_size
        inputs = tokens * (3 * 8 + 4) + 3 * layout.padded_len * 8
        embedding_saved = tokens * (1 + 8) if self.p > 1 else 0
        if self.hidden_dropout:
            embedding_saved += self._memo(layout, micro_batch_size).dims.dropout_mask
        activation = tokens * self.shape.hidden_size * self.element_size
        gathered_rows = 0  # by the layers (tp_sp) or the output layer, whichever gathers more
        if self.p > 1 and (stage.sequence_buffer or (self.vocab_size and not stage.loss_chunk_tokens)):
            gathered_rows = layout.padded_len
        elif self.p > 1 and self.vocab_size:
            gathered_rows = self.p * loss_chunk_rows(stage.loss_chunk_tokens, self.p, layout.padded_len // self.p)
        gather_buffer = gathered_rows * micro_batch_size * self.shape.hidden_size * self.element_size
        rotary = layout.padded_len * self.rotary_dim * 4
        return inputs + activation // self.p + embedding_saved + rotary + gather_buffer

    def loss_bytes(self, layout: SequenceLayout, micro_batch_size: int, chunk_tokens: int = 0) -> float:
        """The output layer's working set on a stage that holds it, as Megatron computes it with
        sequence parallelism and its (unfused) vocab-parallel cross-entropy. Kept from forward to
        backward: the final norm's output ``[t, b, h]`` (the projection's input) and statistics. The
        projection gathers its input into Megatron's global buffer (:meth:`stage_bytes`, p > 1) and makes
        the logits ``[s, b, V/p]``; half-precision logits are copied to fp32, which the cross-entropy
        turns into its softmax in place and keeps as the logits' gradient (fp32 logits are used in
        place). Peak: in forward, the logits beside the fp32 copy and the cross-entropy's per-token
        temporaries (before the per-token loss exists); or, in backward, the logits' gradient beside
        the projection's input gradient ``[s, b, h]``, its reduce-scatter to ``[t, b, h]`` (p > 1) and
        the weight's gradient ``[V/p, h]`` (accumulated into ``.grad``, unfused as
        :mod:`cost.layer_memory` counts every linear's), once the per-token loss is gone.

        With ``chunk_tokens`` (:mod:`megatron_paradyse.mcore.chunked_loss`) and more than one chunk, the
        same working set is one chunk's (``chunk_tokens / p`` rows of every rank). Autograd holds more
        until every chunk's backward has run: the chunks' per-token losses (fp32 ``[s, b]`` in all), the
        chunks' input gradients (they add up to one ``[t, b, h]``, joined at the end into another) and
        the weight gradients of the chunks so far, summed out of place into a buffer (so three
        ``[V/p, h]`` at each sum)."""
        if not self.vocab_size:
            return 0.0
        d = self._memo(layout, micro_batch_size).dims
        tokens = d.s * d.b
        rows = loss_chunk_rows(chunk_tokens, self.p, d.t) if chunk_tokens else d.t
        gathered = rows * self.p * d.b
        logits = gathered * (self.vocab_size // self.p)
        fp32_copy = 4 * logits if d.e < 4 else 0
        row_grads = rows * d.b * d.h * d.e
        weight_grad = self._output_weight_grad_bytes()
        forward = fp32_copy + _CROSS_ENTROPY_TOKEN_BYTES * gathered
        backward = gathered * d.h * d.e + (row_grads if self.p > 1 else 0) + weight_grad
        working = logits * d.e + max(forward, backward)
        losses = 0
        if rows < d.t:
            working = max(d.x - row_grads + working + weight_grad, d.x + 3 * weight_grad, 2 * d.x + weight_grad)
            losses = 4 * tokens
        # beside the final norm's output and statistics; or the final norm's own working set
        return max(working + d.x + d.norm_stats, norm_peak(d) + self._backward_held_bytes()) + losses

    def _output_weight_grad_bytes(self) -> float:
        """The output layer's weight gradient ``[V/p, h]``."""
        return self.vocab_size // self.p * self.shape.hidden_size * self.element_size

    def _backward_held_bytes(self) -> float:
        """What exists beside every layer's backward but not its forward: a tied, unfused output layer's
        weight gradient, which autograd holds until the embedding's backward adds its own."""
        return self._output_weight_grad_bytes() if self.tied_unfused_output else 0.0

    # -- details ---------------------------------------------------------------------------------
    def time_breakdown(self, option: LayerOption, layout: SequenceLayout, micro_batch_size: int) -> TimeBreakdown:
        """Where the slowest rank's time goes."""
        return max((time for time, _, _ in self._per_rank(option, layout, micro_batch_size)), key=lambda b: b.total_s)

    def _per_rank(
        self, option: LayerOption, layout: SequenceLayout, micro_batch_size: int
    ) -> list[tuple[TimeBreakdown, float, float]]:
        """(time, saved bytes, transient bytes) of the layer on every rank whose work differs (ring
        hops see different blocks)."""
        memo = self._memo(layout, micro_batch_size)
        ranks = range(self.p) if get_strategy("attention", option.attention).depends_on_rank else (0,)
        ahead = gathers_mlp_weight_ahead(option, self.p)
        mlp = (  # the same on every rank
            self._tiled_mlp(memo, layout, option.mlp, option.mlp_tile_tokens)
            if option.mlp_tile_tokens
            else self._sublayer(memo, layout, "mlp", option.mlp, 0, ahead)
        )
        per_rank = []
        for rank in ranks:
            attn = self._sublayer(memo, layout, "attention", option.attention, rank, ahead)
            kept = (
                self._sublayer(memo, layout, "attention", option.attention, rank, ahead, core_kept=True)
                if option.keep_core
                else None
            )
            key = (attn.memory_key, mlp.memory_key, kept and kept.memory_key)
            if key not in memo.layer_memory:
                memo.layer_memory[key] = layer_memory(attn.memory, mlp.memory, memo.dims, kept and kept.memory)
            saved, peak = memo.layer_memory[key].saved_and_peak(
                recompute=option.recompute,
                offload=option.offload,
                keep_core=option.keep_core,
                backward_held=self._backward_held_bytes(),
            )
            per_rank.append((self._time(attn, mlp, kept, option, memo.dims.x), saved, peak - saved))
        return per_rank

    def _memo(self, layout: SequenceLayout, micro_batch_size: int) -> _LayoutMemo:
        """The memo of this (layout, micro-batch size); only the latest is kept (the planner prices
        every option of one layout in a row), so memory stays bounded."""
        if layout.p != self.p:
            raise ValueError(f"the layout is for p={layout.p}, the cost model for p={self.p}")
        key = (layout.value, micro_batch_size)
        memo = self._latest.memo
        if memo is None or memo.key != key:
            dims = Dims(
                self.shape,
                self.p,
                layout.padded_len,
                micro_batch_size,
                self.element_size,
                self.rotary_dim,
                bias=self.bias,
                normalization=self.normalization,
                device=self.device,
                hidden_dropout=self.hidden_dropout,
            )
            memo = self._latest.memo = _LayoutMemo(key, dims)
            self._terms.forget_calls()
        return memo

    def _sublayer(
        self,
        memo: _LayoutMemo,
        layout: SequenceLayout,
        sublayer: str,
        name: str,
        rank: int,
        mlp_weight_ahead: bool,
        *,
        core_kept: bool = False,
    ) -> _Sublayer:
        """A sublayer's terms on ``rank`` and its priced forward and backward (the MLP's first weight gathered
        during the attention or not: :attr:`Dims.mlp_weight_ahead`), memoised. ``core_kept``: the
        attention's rerun in a recompute that keeps its core (:attr:`Dims.core_kept`), its forward priced
        without the core (:meth:`SublayerTerms.without_core`)."""
        key = (sublayer, name, rank, mlp_weight_ahead, core_kept)
        entry = memo.sublayers.get(key)
        if entry is None:
            dims = dataclasses.replace(memo.dims, mlp_weight_ahead=mlp_weight_ahead, core_kept=core_kept)
            sub = sublayer_terms(sublayer, name, dims, layout, rank)
            memory = sublayer_memory(sublayer, name, dims, layout, rank)
            memory_key = _memory_key(memory)
            if core_kept:  # the rerun's forward; its backward is the attention's own
                forward = self._terms.sublayer_pass(sub.without_core(), backward=False)
                backward = self._sublayer(memo, layout, sublayer, name, rank, mlp_weight_ahead).backward
            else:
                forward = self._terms.sublayer_pass(sub, backward=False)
                backward = self._terms.sublayer_pass(sub, backward=True)
            entry = _Sublayer(forward, backward, memory, memory_key)
            memo.sublayers[key] = entry
        return entry

    def _tiled_mlp(self, memo: _LayoutMemo, layout: SequenceLayout, name: str, tile_tokens: int) -> _Sublayer:
        """MLP strategy ``name`` over row tiles of ``tile_tokens`` gathered tokens: each tile priced at its
        size, forward once, then forward again and backward (its recompute); memory from
        :func:`tiled_mlp_memory`. Memoised."""
        key = ("mlp", name, -tile_tokens)  # no rank is negative
        entry = memo.sublayers.get(key)
        if entry is None:
            d = memo.dims
            rows = mlp_tile_rows(tile_tokens, self.p, d.t)
            forward, backward = PassTime(0.0, 0.0, 0), PassTime(0.0, 0.0, 0)
            full, last = divmod(d.t, rows)
            for tile_rows, tiles in ((rows, full), (last, 1 if last else 0)):
                if tiles:
                    sub = sublayer_terms("mlp", name, dataclasses.replace(d, s=tile_rows * self.p), layout)
                    tile_forward = self._terms.sublayer_pass(sub, backward=False)
                    tile_backward = self._terms.sublayer_pass(sub, backward=True)
                    forward = forward + tile_forward * tiles
                    backward = backward + (tile_forward + tile_backward) * tiles
            memory = tiled_mlp_memory(name, d, layout, tile_tokens)
            memory_key = _memory_key(memory)
            entry = memo.sublayers[key] = _Sublayer(forward, backward, memory, memory_key)
        return entry

    def _time(
        self, attn: _Sublayer, mlp: _Sublayer, kept: _Sublayer | None, option: LayerOption, activation_bytes: float
    ) -> TimeBreakdown:
        """The layer's time from its sublayers' priced passes; ``kept``: the attention's rerun where the
        option keeps its core; ``activation_bytes``: one ``[t, b, h]``."""
        forwards = 2 if option.recompute else 1
        attention_forwards = [(attn.forward, 1), (kept.forward, 1)] if kept else [(attn.forward, forwards)]
        passes = [*attention_forwards, (attn.backward, 1), (mlp.forward, forwards), (mlp.backward, 1)]
        compute = comm = 0.0
        syncs = 0
        for priced, times in passes:
            compute += times * priced.compute_s
            comm += times * priced.comm_s
            syncs += times * priced.syncs
        elementwise = (
            self.profile["elementwise"]["per_byte_s"] * _NORMS_AND_RESIDUALS_PASSES * activation_bytes * (forwards + 2)
        )
        compute += elementwise
        syncs = syncs if self.p > 1 else 0
        total = self._k_compute * compute + self._k_comm * comm + self._per_sync * syncs + self._per_layer
        if option.offload:
            forward = attn.forward.compute_s + mlp.forward.compute_s
            host = self._terms.host_copies(forward, compute - forward, activation_bytes)
            comm += host
            total += host
        return TimeBreakdown(compute, comm, syncs, total)
