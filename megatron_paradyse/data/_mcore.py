"""Import megatron-core's indexed-dataset module on a machine without triton.

``import megatron.core`` imports ``transformer/moe/ops/paged_stash.py``, whose unguarded
``import triton`` fails where triton is not installed (CPU machines; megatron_on_cpu.md section 3.1),
although the indexed dataset needs none of it. Where triton is missing, a stand-in for that one
module is registered first; its kernels raise if anything launches them.

To be folded into ``megatron_paradyse/compat.py`` once that module lands.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from types import ModuleType

_PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


class _NeedsTriton:
    """A triton kernel placeholder: ``kernel[grid](...)`` raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getitem__(self, grid):
        raise RuntimeError(f"{self._name}: MoE paged stash needs triton and CUDA, neither is installed")


def _install_triton_stub() -> None:
    if _PAGED_STASH in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    stub = types.ModuleType(_PAGED_STASH)
    stub.GLOBAL_BLOCK_SIZE = 1024
    stub.paged_stash_copy_kernel = _NeedsTriton("paged_stash_copy_kernel")
    stub.paged_stash_pop_kernel = _NeedsTriton("paged_stash_pop_kernel")
    sys.modules[_PAGED_STASH] = stub


def indexed_dataset_module() -> ModuleType:
    """``megatron.core.datasets.indexed_dataset``, importable with or without triton."""
    _install_triton_stub()
    return importlib.import_module("megatron.core.datasets.indexed_dataset")
