"""``bench e2e``'s weights, gradients and optimizer state of an arm, kept as Megatron keeps them: every
gradient in one flat fp32 buffer made before any step (its DDP's), and Adam on fp32 weights: the model's
own in fp32; for a bf16 model, fp32 copies of its weights, as Megatron's mixed-precision optimizer keeps
them: each gradient goes into the buffer as the parameter's ``main_grad`` when backward makes it, and
each step copies the updated copies back into the model. That is the static memory
:func:`~megatron_paradyse.mcore.static_memory.pipeline_footprints` counts with fp32 gradients: 16 bytes a
parameter in fp32, 18 in bf16."""

from __future__ import annotations

import torch

from megatron_paradyse.core.memory import storage_bytes

__all__ = ["Adam", "accumulate_into_main_grads", "gradient", "gradient_buffer", "resident_bytes"]


def gradient_buffer(model: torch.nn.Module) -> torch.Tensor:
    """One flat fp32 buffer holding every parameter's gradient (one DP all-reduce), on the model's device:
    an fp32 parameter's ``grad``, a bf16 one's ``main_grad``."""
    params = list(model.parameters())
    grads = torch.zeros(sum(param.numel() for param in params), device=params[0].device)
    offset = 0
    for param in params:
        view = grads[offset : offset + param.numel()].view_as(param)
        if param.dtype == torch.float32:
            param.grad = view
        else:
            param.main_grad = view
        offset += param.numel()
    return grads


def accumulate_into_main_grads(model: torch.nn.Module) -> None:
    """Once per model: the gradient backward makes for each bf16 parameter is added to its ``main_grad`` and
    freed (Megatron's DDP hook, without gradient-accumulation fusion)."""
    for param in model.parameters():
        if param.dtype != torch.float32:
            param.register_post_accumulate_grad_hook(_into_main_grad)


def _into_main_grad(param: torch.Tensor) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


def gradient(param: torch.Tensor) -> torch.Tensor:
    """Where ``param``'s gradient is: its ``main_grad`` (bf16 parameters), else its ``grad``."""
    return getattr(param, "main_grad", param.grad)


class Adam(torch.optim.Adam):
    """torch's Adam on ``model``'s weights in fp32: its parameters themselves where they are fp32; else fp32
    copies of ``weights`` (the values the arm starts from, one per parameter) whose gradients are the
    parameters' ``main_grad`` (:func:`gradient_buffer` first), copied back into the model after each step."""

    def __init__(self, model: torch.nn.Module, weights: list[torch.Tensor], lr: float) -> None:
        self.model_params = list(model.parameters())
        self.mixed = any(param.dtype != torch.float32 for param in self.model_params)
        params = self.model_params
        if self.mixed:
            params = [torch.nn.Parameter(weight.detach().float().clone()) for weight in weights]
            for copy, param in zip(params, self.model_params):
                copy.grad = param.main_grad
        super().__init__(params, lr=lr)

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        if self.mixed:
            for param, copy in zip(self.model_params, self.param_groups[0]["params"]):
                param.copy_(copy)
        return loss


def resident_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages of ``model``'s parameters and gradients, and ``optimizer``'s weights
    (the fp32 copies) and state."""
    tensors = [t for p in model.parameters() for t in (p, gradient(p)) if t is not None]
    tensors += [p for group in optimizer.param_groups for p in group["params"]]
    tensors += [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    return storage_bytes(tensors)
