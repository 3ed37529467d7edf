"""``bench e2e``'s weights, gradients and Adam as Megatron keeps them (:mod:`megatron_paradyse.bench._e2e_state`):
an fp32 model trains its own weights, gradients in one flat buffer; a bf16 model's gradients reach the fp32
buffer as backward makes them, Adam steps fp32 copies of its weights and copies them back: 18 bytes held
per parameter, as ``static_memory`` counts them with fp32 gradients."""

from __future__ import annotations

import pytest
import torch

from megatron_paradyse.bench._e2e_state import Adam, accumulate_into_main_grads, gradient_buffer, resident_bytes


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(dtype)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
    model(x).float().square().sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


@pytest.mark.parametrize(("dtype", "bytes_per_parameter"), [(torch.float32, 16), (torch.bfloat16, 18)])
def test_the_static_bytes_are_megatrons(dtype, bytes_per_parameter):
    model = _model(dtype)
    accumulate_into_main_grads(model)
    grads = gradient_buffer(model)
    optimizer = Adam(model, list(model.parameters()), lr=1e-2)
    _step(model, optimizer, dtype)  # Adam makes its moments
    parameters = sum(p.numel() for p in model.parameters())
    assert grads.dtype == torch.float32 and grads.numel() == parameters
    steps = 4 * len(list(model.parameters()))  # Adam's step count, a 0-dim fp32 tensor per parameter tensor
    assert resident_bytes(model, optimizer) == bytes_per_parameter * parameters + steps


def test_a_bf16_model_steps_as_its_fp32_copy_does():
    """The bf16 model's gradients go into the fp32 buffer (its own freed), Adam steps fp32 copies of the
    weights the arm starts from, and the model holds their bf16 rounding after each step: as an fp32 model
    stepped with the same gradients, to bf16's precision."""
    model, reference = _model(torch.bfloat16), _model(torch.float32)
    with torch.no_grad():
        for ours, theirs in zip(model.parameters(), reference.parameters()):
            theirs.copy_(ours)  # the same (bf16-representable) start
    accumulate_into_main_grads(model)
    grads = gradient_buffer(model)
    optimizer = Adam(model, [p.detach().clone() for p in model.parameters()], lr=1e-2)
    gradient_buffer(reference)
    expected = Adam(reference, [], lr=1e-2)
    for _ in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
        model(x.bfloat16()).float().square().sum().backward()
        assert all(p.grad is None for p in model.parameters()) and grads.abs().sum() > 0
        reference(x).square().sum().backward()
        with torch.no_grad():  # the gradients the bf16 model computed, for the fp32 reference's Adam
            for ours, theirs in zip(model.parameters(), reference.parameters()):
                theirs.grad.copy_(ours.main_grad)
        optimizer.step()
        expected.step()
        for opt in (optimizer, expected):
            opt.zero_grad(set_to_none=False)
        assert grads.abs().sum() == 0
        for ours, copy, theirs in zip(model.parameters(), optimizer.param_groups[0]["params"], reference.parameters()):
            assert copy.dtype == torch.float32
            torch.testing.assert_close(copy, theirs)
            assert torch.equal(ours, copy.to(torch.bfloat16))
