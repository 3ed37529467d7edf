"""RoPE (``mcore.rotary``): Megatron's unfused rotation and its gradient to the bit, nothing kept for backward.

Its memory inside Megatron's layer, every attention strategy on gloo ranks:
tests/megatron/test_megatron_layer_memory.py.
"""

from __future__ import annotations

import pytest
import torch

import megatron_paradyse.mcore  # noqa: F401  (the CPU shim, before megatron)
from megatron_paradyse.mcore.rotary import rotate

from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from helpers.numerics import assert_same_output_and_gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rotary_dim", [16, 12])  # the whole head, or part of it
def test_rotate_gives_megatrons_rotation_and_gradient_to_the_bit(dtype, rotary_dim):
    gen = torch.Generator().manual_seed(rotary_dim)
    table = 3 * torch.randn(50, 1, 1, rotary_dim, generator=gen)
    positions = torch.randint(0, 50, (20,), generator=gen)
    t, grad = (torch.randn(20, 2, 3, 16, generator=gen).to(dtype) for _ in range(2))
    assert_same_output_and_gradient(
        lambda x: rotate(x, table, positions, 0.9),
        lambda x: _apply_rotary_pos_emb_bshd(x, table.index_select(0, positions), mscale=0.9),
        t,
        grad,
    )


def test_rotate_keeps_nothing_for_backward():
    kept = []
    t = torch.randn(8, 1, 2, 16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda x: kept.append(x) or x, lambda x: x):
        rotate(t * 1, torch.randn(8, 1, 1, 16), torch.arange(8), 1.0)
    assert kept == []  # Megatron's unfused rotation keeps cos and sin
