"""Run megatron-core 0.19 on a machine without CUDA (CPU tests, the CPU demo); a no-op with CUDA.

megatron-core assumes CUDA in a handful of places. :func:`install` rebinds exactly those, and
nothing else in the project patches Megatron:

- ``import megatron.core`` imports triton unguarded (MoE paged stash kernels): without triton a
  stand-in module takes its place, whose kernels raise if launched;
- ``megatron.training`` uses ``typing.override`` (Python 3.12): aliased to ``typing_extensions``;
- ``torch.cuda.current_device()`` names the device of Megatron's buffers: it returns the CPU;
- the RNG tracker (``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()``) keeps
  and swaps CPU generator states instead of CUDA ones;
- the default causal mask (``attention_mask=None``) is built on the CPU.

Megatron's optimizer and pipeline schedules also allocate on ``device="cuda"`` and synchronise the
device; :func:`cuda_to_cpu` runs such calls on the CPU, inside its ``with`` block only.

Call :func:`install` before the first ``import megatron.core``; it is idempotent. Every patch is
skipped when ``torch.cuda.is_available()``, so the same code runs unpatched on GPUs.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import types
import typing
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cuda_to_cpu", "install"]


def install() -> None:
    """Apply the CPU patches (once); do nothing when CUDA is available."""
    if torch.cuda.is_available():
        return
    _install_once()


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
        import typing_extensions

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


@contextlib.contextmanager
def cuda_to_cpu() -> Iterator[None]:
    """Inside the block, tensors requested on a CUDA device are made on the CPU, and
    ``torch.cuda.synchronize`` / ``current_stream`` have nothing to wait for; with CUDA available,
    the block runs unchanged.

    For Megatron's DDP gradient sync (stream waits), optimizer (``device="cuda"`` flags and scales)
    and pipeline schedules (token counters, shape exchange) in CPU tests.
    """
    if torch.cuda.is_available():
        yield
        return
    saved = {name: getattr(torch.cuda, name) for name in ("synchronize", "current_stream")}
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_stream = lambda device=None: _NullStream()
    try:
        with _CudaFactoriesOnCpu():
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)


class _NullStream:
    """The CPU runs everything in order: nothing to wait for."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


class _CudaFactoriesOnCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)
