"""Failures a test injects into a rank of a job (:func:`helpers.job_ranks.launch`'s ``before``), in
training iteration ``iteration`` (Megatron's 1-based number), on rank ``rank``:

- ``attention-forward``: ``torch.OutOfMemoryError`` where the Paradyse layers call the attention strategy;
- ``mlp-backward``: the same in the backward of an MLP strategy's output (the step's first MLP backward);
- ``death``: every rank starts a child process, as Megatron starts a checkpoint writer (forked by
  multiprocessing, daemonic; its pid in ``folder/child{r}.pid``), then rank ``rank`` kills itself
  (SIGKILL: it dies without a word).
- ``extra-bytes``: in every forward of rank ``rank``'s first transformer layer that builds a graph (the
  training steps', the pre-flight's; ``iteration`` unused), ``nbytes`` more are allocated and kept until
  that layer's backward has run: the model's peak exceeds its prediction by ``nbytes``.

With a ``marker`` file an out-of-memory error fires once: it writes the marker (the time.time() of the
raise) and does not fire while the marker exists, so the relaunch of the same command runs clean; without,
it fires every time. A death writes the marker (its time) before it dies.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Injection:
    site: str
    rank: int
    iteration: int
    marker: Path | None = None
    folder: Path | None = None
    """Where a death's children write their pids."""
    nbytes: int = 0
    """What ``extra-bytes`` allocates."""

    def __call__(self, this_rank: int) -> None:
        """Install the injection in the rank ``this_rank`` (before the program runs)."""
        if self.site == "death":
            _inject_death(self, this_rank)
        elif self.site == "extra-bytes":
            if this_rank == self.rank:
                _inject_extra_bytes(self.nbytes)
        else:
            _inject_out_of_memory(self)


def _this_iteration() -> int:
    from megatron.training import get_args

    return get_args().curr_iteration + 1  # curr_iteration counts the steps done


def _inject_death(injection: Injection, rank: int) -> None:
    from megatron_paradyse.mcore import modules

    run_attention = modules.run_attention
    children = []

    def attention(*a, **kw):
        if not children and torch.is_grad_enabled() and _this_iteration() == injection.iteration:
            children.append(multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,), daemon=True))
            children[0].start()
            (injection.folder / f"child{rank}.pid").write_text(f"{children[0].pid}\n")
            if rank == injection.rank:
                injection.marker.write_text(f"{time.time()}\n")
                os.kill(os.getpid(), signal.SIGKILL)
        return run_attention(*a, **kw)

    modules.run_attention = attention


def _inject_out_of_memory(injection: Injection) -> None:
    from megatron_paradyse.mcore import modules

    message = (
        f"injected by the test: out of memory in the {injection.site} (rank {injection.rank}, "
        f"iteration {injection.iteration})"
    )

    def fires() -> bool:
        if not torch.is_grad_enabled() or torch.distributed.get_rank() != injection.rank:
            return False
        if _this_iteration() != injection.iteration:
            return False
        return injection.marker is None or not injection.marker.exists()

    def out_of_memory() -> torch.OutOfMemoryError:
        if injection.marker is not None:
            injection.marker.write_text(f"{time.time()}\n")
        return torch.OutOfMemoryError(message)

    if injection.site == "attention-forward":
        run_attention = modules.run_attention

        def attention(*a, **kw):
            if fires():
                raise out_of_memory()
            return run_attention(*a, **kw)

        modules.run_attention = attention
    else:
        run_mlp = modules.run_mlp

        class RaiseInBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, y_local):
                return y_local.view_as(y_local)

            @staticmethod
            def backward(ctx, grad):
                raise out_of_memory()

        def mlp(*a, **kw):
            y_local = run_mlp(*a, **kw)
            return RaiseInBackward.apply(y_local) if fires() else y_local

        modules.run_mlp = mlp


def _inject_extra_bytes(nbytes: int) -> None:
    from megatron_paradyse.mcore.modules import ParadyseTransformerLayer

    class KeptUntilBackward(torch.autograd.Function):
        """The layer's input as it is, holding ``extra`` until the gradient has passed the layer."""

        @staticmethod
        def forward(ctx, hidden_states, extra):
            ctx.extra = extra
            return hidden_states.view_as(hidden_states)

        @staticmethod
        def backward(ctx, grad):
            del ctx.extra
            return grad, None

    layer_forward = ParadyseTransformerLayer.forward

    def forward(self, hidden_states, **kwargs):
        if self.plan_index == 0 and torch.is_grad_enabled():
            extra = torch.empty(nbytes, dtype=torch.uint8, device=hidden_states.device)
            hidden_states = KeptUntilBackward.apply(hidden_states, extra)
        return layer_forward(self, hidden_states, **kwargs)

    ParadyseTransformerLayer.forward = forward
