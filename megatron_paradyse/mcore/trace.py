"""One rank's memory of one transformer layer, traced at any shape without the memory or the peers.

The calling process plays rank ``r`` of ``p``: it joins PyTorch's fake process group
(:func:`fake_world`; collectives move nothing, so every tensor has the size rank ``r`` allocates and
nothing waits for a peer) and runs one layer's forward and backward under ``FakeTensorMode``
(tensors with shapes, dtypes and devices but no data), counting the storages every operator creates
and frees (:class:`~megatron_paradyse.core.memory._StorageTracker`). A Llama-3-8B layer at a million
tokens traces in seconds on a CPU. With ``fake=False`` the same layer runs real tensors on a device:
on CUDA, the caching allocator's own figures come too (:class:`AllocatorPeaks`).

What a trace counts is what :func:`~megatron_paradyse.calibration.measure.measure_layer` measures for real
and :func:`~megatron_paradyse.cost.terms.layer_terms` predicts, above the layer's input, its weights
and their gradient buffers (allocated before the window, as Megatron's are) and the rotary table
(GPTModel builds it once per forward, for every layer):

- ``saved_bytes``: alive when the forward returns (kept for backward, the output included);
- ``peak_bytes``: the high-water mark over forward and backward (the input's gradient included), the
  backward run as in a training step: the output gone, its gradient made inside the backward and freed
  once used (:class:`~megatron_paradyse.core.memory.GradientRoot`).

Two layers can be traced (:data:`LayerKind`):

- ``"megatron"``: what training runs. Megatron's ``TransformerLayer`` built from
  :data:`megatron_paradyse.spec.paradyse_layer_spec` (the Paradyse layer, attention and MLP,
  ``sequence_parallel_norm``, Megatron's bias-dropout-add, RoPE through Megatron's
  ``apply_rotary_pos_emb`` with GPTModel's ``RotaryEmbedding`` table), inside
  ``micro_batch_scope``, on Megatron's parallel state initialised over the process group: the subject of
  the trace is the layer training runs, whatever the cost models below it assume.
- ``"run_layer"``: :func:`mcore.bare_layer.run_layer`, the layer the cost models were checked against:
  the strategies between two LayerNorms, no RoPE.

Python's cyclic garbage collector is paused inside the window, so figures do not depend on when it
happens to run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_paradyse.attention import get_kernel
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.memory import GradientRoot, MemoryEvent, _StorageTracker, collective_buffers_freed_promptly
from megatron_paradyse.core.micro_batch import MicroBatch, micro_batch_scope
from megatron_paradyse.core.plan import LayerOption, Plan
from megatron_paradyse.mcore.bare_layer import make_layer_params, run_layer
from megatron_paradyse.mcore.linears import gather_buffer_scope, reserve_gather_buffer
from megatron_paradyse.mcore.model_parallel import model_parallel_state
from megatron_paradyse.mcore.spec import paradyse_layer_spec
from megatron_paradyse.strategies import AttentionContext, MLPContext, ModelShape
from megatron_paradyse.strategies.dims import Dims

from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import build_module

__all__ = [
    "AllocatorPeaks",
    "LayerKind",
    "LayerModel",
    "LayerTrace",
    "RankTracer",
    "fake_world",
    "trace_rank",
]

LayerKind = Literal["megatron", "run_layer"]
LAYER_KINDS: tuple[LayerKind, ...] = ("megatron", "run_layer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerModel:
    """One transformer layer as a Megatron model configures it: what a trace builds."""

    shape: ModelShape
    """The layer's dimensions; its ``qk_norm`` is Megatron's ``qk_layernorm`` (``run_layer`` has no q/k
    norms: its traces leave it out)."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    norm_epsilon: float = 1e-5
    rotary_base: int | None = 10000
    """RoPE over the whole head dimension with this base, as GPTModel's ``RotaryEmbedding`` builds it;
    None: no position embedding in the layer. ``run_layer`` has none either way."""
    bias: bool = False
    """Biases of the linear layers (Megatron's ``add_bias_linear``)."""
    hidden_dropout: float = 0.0
    """Megatron's ``hidden_dropout`` (``run_layer`` has none: its traces leave it out)."""

    def __post_init__(self) -> None:
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"LayerModel.normalization must be 'LayerNorm' or 'RMSNorm', got {self.normalization!r}")

    def dims(
        self,
        layer: LayerKind,
        p: int,
        layout: SequenceLayout,
        micro_batch_size: int,
        dtype: torch.dtype,
        device: Literal["cpu", "cuda"] = "cpu",
    ) -> Dims:
        """The sizes :func:`~megatron_paradyse.cost.terms.layer_terms` predicts ``layer`` from, run on
        ``device``."""
        megatron = layer == "megatron"
        rotary_dim = self.shape.kv_channels if megatron and self.rotary_base is not None else 0
        return Dims(
            self.shape if megatron else dataclasses.replace(self.shape, qk_norm=False),
            p,
            layout.padded_len,
            micro_batch_size,
            dtype.itemsize,
            rotary_dim,
            bias=self.bias,
            normalization=self.normalization if megatron else "LayerNorm",
            device=device,
            hidden_dropout=megatron and self.hidden_dropout > 0,
        )

    def transformer_config(self, p: int, dtype: torch.dtype):
        """Megatron's ``TransformerConfig`` of one such layer on ``p`` tensor-parallel ranks (sequence
        parallel, no attention dropout, fusions off as Megatron-Core's config defaults them; parameters in
        ``dtype`` and left uninitialised: memory does not depend on their values)."""
        s = self.shape
        return TransformerConfig(
            num_layers=1,
            hidden_size=s.hidden_size,
            num_attention_heads=s.num_attention_heads,
            num_query_groups=s.num_query_groups,
            kv_channels=s.kv_channels,
            ffn_hidden_size=s.ffn_hidden_size,
            gated_linear_unit=s.gated_mlp,
            activation_func=F.silu if s.gated_mlp else F.gelu,
            qk_layernorm=s.qk_norm,
            normalization=self.normalization,
            layernorm_epsilon=self.norm_epsilon,
            add_bias_linear=self.bias,
            hidden_dropout=self.hidden_dropout,
            attention_dropout=0.0,
            use_cpu_initialization=True,
            perform_initialization=False,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            tensor_model_parallel_size=p,
            sequence_parallel=p > 1,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllocatorPeaks:
    """The CUDA caching allocator over one trace window, above what it held when the window opened."""

    allocated_bytes: int
    """``torch.cuda.max_memory_allocated`` minus the bytes allocated at the start."""
    reserved_bytes: int
    """``torch.cuda.max_memory_reserved`` minus the bytes reserved at the start."""
    saved_allocated_bytes: int
    """``torch.cuda.memory_allocated`` when the forward returned, minus the start."""
    held_allocated_bytes: int
    """``torch.cuda.memory_allocated`` when the window opened (weights, gradient buffers, input)."""
    held_reserved_bytes: int
    """``torch.cuda.memory_reserved`` when the window opened (with the cache of earlier windows)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerTrace:
    """One layer option on one micro-batch, traced on one rank (see the module docstring)."""

    saved_bytes: int
    peak_bytes: int
    events: tuple[MemoryEvent, ...] = ()
    """Every storage created and freed in the window, in order (``record=True`` only)."""
    forward_events: int = 0
    """How many of :attr:`events` happened before the forward returned."""
    allocator: AllocatorPeaks | None = None
    """The CUDA allocator's figures (real tensors on CUDA only)."""
    seconds: float = 0.0
    """Wall time of the traced forward and backward."""

    @property
    def transient_bytes(self) -> int:
        return self.peak_bytes - self.saved_bytes

    def alive_at_peak(self) -> list[MemoryEvent]:
        """The creations whose storages were alive when the high-water mark was first reached, in the
        order they were made (``record=True`` only): what a prediction's peak must add up to."""
        if not self.events:
            raise ValueError("the trace kept no events; trace with record=True")
        alive: dict[int, MemoryEvent] = {}
        for event in self.events:
            if event.nbytes < 0:
                del alive[event.storage]
                continue
            alive[event.storage] = event
            if event.live == self.peak_bytes:
                return list(alive.values())
        raise AssertionError("no event reaches the trace's peak")


@contextlib.contextmanager
def fake_world(rank: int, p: int) -> Iterator[None]:
    """Make this process rank ``rank`` of a fake ``p``-rank default process group, inside the block.

    Collectives on it return at once and move no data (received buffers keep what they held), so a
    rank's allocations are those of a real run; they take CPU, CUDA and ``meta`` tensors (the device
    that stands in for a GPU in :mod:`megatron_paradyse.core.host_sync`'s checks). The process must not be in
    a process group already.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if not 0 <= rank < p:
        raise ValueError(f"rank must be in [0, {p}), got {rank}")
    if dist.is_initialized():
        raise RuntimeError("fake_world: this process already belongs to a process group; trace in a process of its own")
    dist.init_process_group("cpu:fake,cuda:fake,meta:fake", store=FakeStore(), rank=rank, world_size=p)
    try:
        yield
    finally:
        dist.destroy_process_group()


class RankTracer:
    """One layer of this rank of the default process group, built once and traced under any option.

    ``with RankTracer(model, layer="megatron") as tracer: tracer.trace(option, layout)``. On a fake
    group (:func:`fake_world`) with ``fake=True`` nothing real is allocated; with ``fake=False`` the
    layer runs real tensors on ``device``. For ``"megatron"``, Megatron's parallel state is set up over
    the default group (tensor parallel across all of it) for the tracer's life, its process groups
    destroyed with it; the process must not have one already.
    """

    def __init__(
        self,
        model: LayerModel,
        *,
        layer: LayerKind = "megatron",
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        fake: bool = True,
        kernel: str = "auto",
        micro_batch_size: int = 1,
        seed: int = 0,
    ):
        if layer not in LAYER_KINDS:
            raise ValueError(f"layer must be one of {', '.join(LAYER_KINDS)}, got {layer!r}")
        self.model, self.layer, self.dtype, self.kernel = model, layer, dtype, kernel
        self.device = torch.device(device)
        self.micro_batch_size = micro_batch_size
        self.rank, self.p = dist.get_rank(), dist.get_world_size()
        self._gen = torch.Generator().manual_seed(seed + self.rank)
        # Real tensors the code holds (the layout's index tensors) enter a fake trace as constants.
        self._mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
        self._held = contextlib.ExitStack()  # for the tracer's life: Megatron's parallel state, or the gather buffer
        self._rotary_tables: dict[int, Tensor] = {}
        try:
            with self._tensors():
                self._run = self._build_megatron() if layer == "megatron" else self._build_run_layer(seed)
        except BaseException:
            self.close()  # Megatron's parallel state, if it got that far
            raise

    # -- the window ----------------------------------------------------------------------------------
    def trace(
        self,
        option: LayerOption,
        layout: SequenceLayout,
        *,
        record: bool = False,
        watch: contextlib.AbstractContextManager | None = None,
    ) -> LayerTrace:
        """Forward and backward of the layer under ``option`` on ``layout``, counted (module docstring);
        ``watch``: a context the layer's forward and backward run in, and nothing else (a dispatch mode
        that sees their operators, :func:`~megatron_paradyse.core.host_sync.cuda_sync_debug`)."""
        if layout.p != self.p:
            raise ValueError(f"the layout is for p={layout.p}, this rank's group has {self.p} ranks")
        cuda = self.device.type == "cuda" and self._mode is None
        with self._tensors():
            if self._mode is not None:  # index tensors of the mode's own, made here: a real one would
                layout = SequenceLayout(*layout.value)  # become a fake inside the window, counted there
            layout.indices(self.device)  # on the device before the layer runs, as the entry point does
            if self.p > 1:  # Megatron's sequence-parallel gather buffer, held outside the layer
                reserve_gather_buffer(
                    layout.padded_len * self.micro_batch_size, self.model.shape.hidden_size, self.dtype, self.device
                )
            size = (layout.local_len, self.micro_batch_size, self.model.shape.hidden_size)
            x_local = self._random(size).requires_grad_()
            dy_local = self._random(size)
            rotary = self._rotary_table(layout.padded_len)
            gc.collect()
            gc.disable()
            try:
                with collective_buffers_freed_promptly(), _AllocatorWindow(self.device, enabled=cuda) as allocator:
                    start = time.perf_counter()
                    with _StorageTracker(record=record) as tracker, watch or contextlib.nullcontext():
                        y_local = self._run(x_local, option, layout, rotary)
                        if self._mode is None and self.device.type == "cpu":
                            time.sleep(0.001)  # gloo's thread: its last sent buffer (see above)
                        saved, forward_events = tracker.live, len(tracker.events or ())
                        allocator.forward_done()
                        root = GradientRoot(y_local, dy_local)  # the output gone, its gradient made in backward
                        del y_local
                        root.backward()
                        x_local.grad = None
                    seconds = time.perf_counter() - start
            finally:
                gc.enable()
        return LayerTrace(
            saved_bytes=saved,
            peak_bytes=tracker.peak,
            events=tuple(tracker.events or ()),
            forward_events=forward_events,
            allocator=allocator.peaks(),
            seconds=seconds,
        )

    def close(self) -> None:
        self._held.close()

    def __enter__(self) -> RankTracer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- building ------------------------------------------------------------------------------------
    def _tensors(self) -> contextlib.AbstractContextManager:
        """Where the tracer's tensors are made: under its fake mode, or real ones."""
        return self._mode if self._mode is not None else contextlib.nullcontext()

    def _random(self, size: tuple[int, ...]) -> Tensor:
        if self._mode is not None:  # no data to draw
            return torch.empty(size, dtype=self.dtype, device=self.device)
        return torch.randn(size, generator=self._gen).to(self.device, self.dtype)

    def _initialise(self, params: Sequence[Tensor]) -> None:
        """Values drawn for real parameters; gradient buffers before any window, as Megatron's."""
        for param in params:
            if self._mode is None:
                with torch.no_grad():
                    param.copy_(torch.randn(param.shape, generator=self._gen) / param.shape[-1] ** 0.5)
            param.grad = torch.zeros_like(param)

    def _build_run_layer(self, seed: int) -> Callable:
        self._held.enter_context(gather_buffer_scope())  # the linears' and trace()'s, where this tracer made it
        params = make_layer_params(
            self.model.shape, self.p, self.rank, bias=self.model.bias, dtype=self.dtype, device=self.device, seed=seed
        )
        group, shape = dist.group.WORLD, self.model.shape
        mctx = MLPContext(group=group, shape=shape, activation=F.silu if shape.gated_mlp else F.gelu)
        kernel = get_kernel(self.kernel, self.device, self.dtype)

        def run(x_local: Tensor, option: LayerOption, layout: SequenceLayout, rotary: Tensor | None) -> Tensor:
            actx = AttentionContext(
                group=group, layout=layout, shape=shape, kernel=kernel, softmax_scale=shape.kv_channels**-0.5
            )
            return run_layer(x_local, params, option, actx, mctx)

        return run

    def _build_megatron(self) -> Callable:
        if parallel_state.model_parallel_is_initialized():
            raise RuntimeError("RankTracer: Megatron's parallel state is already initialised in this process")
        self._held.enter_context(  # its gather buffer and process groups gone with it
            model_parallel_state(tensor_model_parallel_size=self.p, create_gloo_process_groups=False)
        )
        config = self.model.transformer_config(self.p, self.dtype)
        layer = build_module(paradyse_layer_spec, config=config, layer_number=1)
        if self._mode is None:
            layer.to(self.device)  # Megatron builds on the CPU (use_cpu_initialization), as get_model moves it
        self._initialise(list(layer.parameters()))

        def run(x_local: Tensor, option: LayerOption, layout: SequenceLayout, rotary: Tensor | None) -> Tensor:
            micro_batch = MicroBatch(layout=layout, plan=Plan((option,)), attention_kernel=self.kernel)
            with micro_batch_scope(micro_batch):
                y_local, _ = layer(x_local, attention_mask=None, rotary_pos_emb=rotary)
            return y_local

        return run

    def _rotary_table(self, padded_len: int) -> Tensor | None:
        """GPTModel's rotary table for ``padded_len`` positions, ``[s, 1, 1, hn]`` fp32 (made before the
        window, once per length: the model computes it once per forward for all its layers)."""
        if self.layer != "megatron" or self.model.rotary_base is None:
            return None
        if padded_len not in self._rotary_tables:
            rope = RotaryEmbedding(
                kv_channels=self.model.shape.kv_channels,
                rotary_percent=1.0,
                rotary_base=self.model.rotary_base,
                use_cpu_initialization=True,
            )
            self._rotary_tables = {padded_len: rope(padded_len)}  # one at a time: tables are large
        return self._rotary_tables[padded_len]


def trace_rank(
    model: LayerModel,
    rank: int,
    p: int,
    cases: Sequence[tuple[LayerOption, SequenceLayout]],
    *,
    layer: LayerKind = "megatron",
    dtype: torch.dtype = torch.bfloat16,
    record: bool = False,
    progress: Callable[[int, LayerTrace], None] | None = None,
) -> list[LayerTrace]:
    """:meth:`RankTracer.trace` of every ``(option, layout)`` case, as rank ``rank`` of a fake
    ``p``-rank group under ``FakeTensorMode``; ``progress(i, trace)`` after each."""
    traces = []
    with fake_world(rank, p), RankTracer(model, layer=layer, dtype=dtype) as tracer:
        for i, (option, layout) in enumerate(cases):
            traces.append(tracer.trace(option, layout, record=record))
            if progress is not None:
                progress(i, traces[-1])
    return traces


class _AllocatorWindow:
    """The CUDA caching allocator's peaks over a window (nothing when not ``enabled``)."""

    def __init__(self, device: torch.device, *, enabled: bool):
        self.device, self.enabled = device, enabled
        self._start_allocated = self._start_reserved = self._saved = 0

    def __enter__(self) -> _AllocatorWindow:
        if self.enabled:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start_allocated = torch.cuda.memory_allocated(self.device)
            self._start_reserved = torch.cuda.memory_reserved(self.device)
        return self

    def forward_done(self) -> None:
        if self.enabled:  # the allocator counts on the host, as it hands out and takes back blocks: no sync
            self._saved = torch.cuda.memory_allocated(self.device) - self._start_allocated

    def __exit__(self, *exc) -> None:
        if self.enabled:
            torch.cuda.synchronize(self.device)

    def peaks(self) -> AllocatorPeaks | None:
        if not self.enabled:
            return None
        return AllocatorPeaks(
            allocated_bytes=torch.cuda.max_memory_allocated(self.device) - self._start_allocated,
            reserved_bytes=torch.cuda.max_memory_reserved(self.device) - self._start_reserved,
            saved_allocated_bytes=self._saved,
            held_allocated_bytes=self._start_allocated,
            held_reserved_bytes=self._start_reserved,
        )
