"""The gated MLP activation (``strategies.common.activate``): autograd's gradients to the bit, one tensor kept.

Its memory against the storage tracker, every MLP strategy on gloo ranks: tests/ranks/test_memory_scripts.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from megatron_paradyse.strategies import ModelShape
from megatron_paradyse.strategies.common import activate

SHAPE = ModelShape(
    hidden_size=16, num_attention_heads=2, num_query_groups=2, kv_channels=8, ffn_hidden_size=24, gated_mlp=True
)
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu-tanh": functools.partial(F.gelu, approximate="tanh")}


def _autograds(h: torch.Tensor, activation, blocks: int) -> torch.Tensor:
    """What autograd makes of ``activation(gate) * up`` over ``blocks`` ``[gate | up]`` shards."""
    gate, up = h.unflatten(-1, (blocks, 2, -1)).unbind(-2)
    return (activation(gate) * up).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("blocks", [1, 3])
def test_the_gated_activation_gives_autograds_output_and_gradient_to_the_bit(dtype, activation, blocks):
    gen = torch.Generator().manual_seed(blocks)
    h = torch.randn(5, 2, blocks * 2 * 8, generator=gen).to(dtype)
    dy = torch.randn(5, 2, blocks * 8, generator=gen).to(dtype)
    grads = []
    for fn in (functools.partial(activate, shape=SHAPE), _autograds):
        x = h.clone().requires_grad_()
        y = fn(x, activation=ACTIVATIONS[activation], blocks=blocks)
        y.backward(dy)
        grads.append((y.detach(), x.grad))
    (y, dx), (y_ref, dx_ref) = grads
    assert torch.equal(y, y_ref)
    assert torch.equal(dx, dx_ref)


def test_the_gated_activation_keeps_only_its_input_for_backward():
    kept = []
    h = torch.randn(4, 1, 2 * 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        activate(h * 1, SHAPE, F.silu, blocks=1)  # h * 1: the input is a tensor of the graph, as fc1's output
    assert [t.shape for t in kept] == [h.shape]  # autograd alone would keep activation(gate), up and gate too
