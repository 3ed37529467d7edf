"""Run megatron-core 0.19 on a machine without CUDA (CPU tests, the CPU demo); a no-op with CUDA.

megatron-core assumes CUDA in a handful of places. :func:`install` rebinds exactly those (the only other
changes to Megatron are the training entry point's hooks in :mod:`~megatron_paradyse.mcore.training_hooks`):

- ``import megatron.core`` imports triton unguarded (MoE paged stash kernels): without triton a
  stand-in module takes its place, whose kernels raise if launched;
- ``megatron.training`` uses ``typing.override`` (Python 3.12): aliased to ``typing_extensions``;
- ``torch.cuda.current_device()`` names the device of Megatron's buffers: it returns the CPU;
- the RNG tracker (``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()``) keeps
  and swaps CPU generator states instead of CUDA ones;
- the default causal mask (``attention_mask=None``) is built on the CPU.

Megatron's optimizer and pipeline schedules also allocate on ``device="cuda"`` and synchronise the
device; :func:`cuda_to_cpu` runs such calls on the CPU, inside its ``with`` block only.
:func:`megatron_training_on_cpu` adds what Megatron's own training entry (argument validation,
``pretrain()``) needs on top, for the CPU demo and tests.

Call :func:`install` before the first ``import megatron.core``; it is idempotent. Every patch is
skipped when ``torch.cuda.is_available()``, so the same code runs unpatched on GPUs.

On any machine, :func:`install` also filters the warnings megatron-core's modules give at import, one
per module, that Transformer Engine or apex is missing and torch's implementations run instead (nine
for ``paradyse plan``, which runs no model); :func:`missing_fused_libraries` says it in one line, which
the training entry point prints.

On any machine, GPUs included, :func:`drop_unavailable_gradient_accumulation_fusion` turns off the one
fusion Megatron's defaults ask for that needs apex, where apex's kernel is missing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import sys
import types
import typing
import warnings
from collections.abc import Iterator

import torch
import typing_extensions
from torch.overrides import TorchFunctionMode

__all__ = [
    "cuda_to_cpu",
    "drop_unavailable_gradient_accumulation_fusion",
    "install",
    "megatron_training_on_cpu",
    "missing_fused_libraries",
]

logger = logging.getLogger(__name__)

_FALLBACK_WARNINGS = (
    r"(Transformer Engine and Apex are|Apex is) not installed"
    r"|Only transformer-engine>=\S+ supports MoE experts"
)
"""megatron-core 0.19's import-time warnings that a fused library is missing (``UserWarning``)."""

_FUSED_LIBRARIES = {"Transformer Engine": "transformer_engine", "apex": "apex"}


def install() -> None:
    """Filter megatron-core's missing-library warnings; without CUDA, apply the CPU patches (once)."""
    warnings.filterwarnings("ignore", message=_FALLBACK_WARNINGS, category=UserWarning)
    if torch.cuda.is_available():
        return
    _install_once()


def missing_fused_libraries() -> str | None:
    """One line for what :func:`install` keeps megatron-core from warning about module by module, or
    None where Transformer Engine and apex are both installed."""
    missing = [name for name, module in _FUSED_LIBRARIES.items() if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    return (
        f"megatron-core runs without {' and '.join(missing)}: torch's optimizers, norms and multi-tensor "
        f"kernels in their place"
    )


@functools.cache
def _install_once() -> None:
    _stub_triton_kernels()
    _alias_typing_override()
    torch.cuda.current_device = lambda: torch.device("cpu")
    _patch_rng_tracker()
    _patch_causal_masks()


def _stub_triton_kernels() -> None:
    if importlib.util.find_spec("triton") is not None:
        return
    name = "megatron.core.transformer.moe.ops.paged_stash"
    if name in sys.modules:
        return
    stub = types.ModuleType(name, "CPU stand-in for Megatron's triton paged-stash kernels (MoE only).")
    stub.GLOBAL_BLOCK_SIZE = 1024
    stub.paged_stash_copy_kernel = stub.paged_stash_pop_kernel = _TritonKernelStub()
    stub.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    sys.modules[name] = stub


class _TritonKernelStub:
    """Stands in for a ``@triton.jit`` kernel; launching it (``kernel[grid](...)``) raises."""

    def __getitem__(self, grid):
        raise RuntimeError("Megatron's MoE paged stash needs triton and CUDA")


def _alias_typing_override() -> None:
    if not hasattr(typing, "override"):
        typing.override = typing_extensions.override


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random

    class CpuRNGStatesTracker(random.CudaRNGStatesTracker):
        """Megatron's named RNG states, kept as CPU generator states."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise ValueError(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    random.CudaRNGStatesTracker = CpuRNGStatesTracker
    random._CUDA_RNG_STATE_TRACKER = None
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def _patch_causal_masks() -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.ones(sq, sq, dtype=torch.bool).triu(diagonal=1)

    def get_sliding_window_causal_mask(sq, skv, window_size):
        visible = torch.ones(sq, skv, dtype=torch.bool).triu(diagonal=skv - sq - window_size[0])
        return ~visible.tril(diagonal=skv - sq + window_size[1])

    for module in (utils, fused_softmax):
        module.get_default_causal_mask = get_default_causal_mask
        module.get_sliding_window_causal_mask = get_sliding_window_causal_mask


def drop_unavailable_gradient_accumulation_fusion(config) -> None:
    """Turn ``config.gradient_accumulation_fusion`` off, with one warning, where apex's
    ``fused_weight_gradient_mlp_cuda`` is not installed: Megatron's arguments default the fusion on, and
    its ``ColumnParallelLinear`` (the local layers', and GPTModel's output layer whatever the transformer
    implementation) refuses to be built without that kernel. The weight gradients are then accumulated
    as ``--no-gradient-accumulation-fusion`` does: the same sums, unfused."""
    if not config.gradient_accumulation_fusion:
        return
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available:
        return
    logger.warning(
        "paradyse: gradient_accumulation_fusion turned off: its kernel, apex's fused_weight_gradient_mlp_cuda, "
        "is not installed (pass --no-gradient-accumulation-fusion to say so yourself)"
    )
    config.gradient_accumulation_fusion = False


@contextlib.contextmanager
def cuda_to_cpu() -> Iterator[None]:
    """Inside the block, CPU tensors stand in for CUDA ones; with CUDA available, the block runs unchanged.

    - tensors requested on a CUDA device (``device="cuda"``, ``.cuda()``, ``.to("cuda")``) are made
      or stay on the CPU;
    - ``Tensor.type()`` names a CPU tensor by its CUDA type (``torch.cuda.FloatTensor``): Megatron's
      grad clipping and its mixed-precision and distributed optimizers check parameters that way;
    - streams, ``synchronize`` and the CUDA generator state have nothing to wait for or keep.

    For Megatron's DDP gradient sync (stream waits), optimizer (``device="cuda"`` flags and scales),
    pipeline schedules (token counters, shape exchange) and training loop.
    """
    if torch.cuda.is_available():
        yield
        return
    names = ("synchronize", "current_stream", "Stream", "stream", "get_rng_state", "set_rng_state")
    saved = {name: getattr(torch.cuda, name) for name in names}
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.Stream = _NullStream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    # There is no CUDA generator to save or restore (Megatron's rerun state machine asks).
    torch.cuda.get_rng_state = lambda device="cuda": torch.empty(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda new_state, device="cuda": None
    try:
        with _CudaOnCpu():
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)


class _NullStream:
    """The CPU runs everything in order: nothing to wait for."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


class _CudaOnCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            return func(*args).replace("torch.", "torch.cuda.", 1)
        device = kwargs.get("device")
        if device is not None and _is_cuda(device):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _is_cuda(device) -> bool:
    """A CUDA device, spelt as Megatron spells them (``"cuda"``, ``torch.device("cuda", i)``, or an index)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"


@contextlib.contextmanager
def megatron_training_on_cpu() -> Iterator[None]:
    """Megatron's training entry (``parse_and_validate_args``, ``pretrain()``) on CPU ranks, inside the
    block; with CUDA available, the block runs unchanged.

    On top of :func:`install` (call it first) and :func:`cuda_to_cpu` (entered here):

    - argument validation asks the GPU's architecture to check ``CUDA_DEVICE_MAX_CONNECTIONS``: a
      CPU has no CUDA connections to limit, so it answers as a GPU without that limit (10);
    - ``initialize_megatron`` asserts CUDA, and creates the model-parallel groups and RNG states only
      if ``torch.cuda.device_count() > 0``: it runs with ``allow_no_cuda=True`` and sees one device,
      whose selection does nothing (the groups are gloo groups);
    - ``pretrain()`` warms Megatron's fused bias-GELU, bias-SwiGLU and bias-dropout-add kernels up with
      ``torch.compile``, which on a CPU builds C++ for each (about 13 s a rank, before the first step):
      the warm-up is skipped. The entry point runs without those fusions on a CPU (``--no-bias-*-fusion``).
    """
    if torch.cuda.is_available():
        yield
        return
    from megatron.training import arguments, training
    from megatron.training.initialize import initialize_megatron

    def initialize_megatron_on_cpu(*args, **kwargs):
        saved = torch.cuda.device_count, torch.cuda.set_device
        torch.cuda.device_count = lambda: 1
        torch.cuda.set_device = lambda device: None
        try:
            return initialize_megatron(*args, **{**kwargs, "allow_no_cuda": True})
        finally:
            torch.cuda.device_count, torch.cuda.set_device = saved

    saved = arguments.get_device_arch_version, training.initialize_megatron, training.set_jit_fusion_options
    arguments.get_device_arch_version = lambda: 10
    training.initialize_megatron = initialize_megatron_on_cpu
    training.set_jit_fusion_options = lambda tp_size=None: None
    try:
        with cuda_to_cpu():
            yield
    finally:
        arguments.get_device_arch_version, training.initialize_megatron, training.set_jit_fusion_options = saved
