"""The plan context: what the layers of a Megatron model need to know about the micro-batch they run.

Megatron hands a transformer layer only its hidden states (the MLP not even the packing
parameters), so the micro-batch's layout and plan travel beside the call::

    micro_batch = MicroBatch(layout=layout, plan=plan)
    with micro_batch_scope(micro_batch):
        output = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask)

Every Paradyse layer reads :func:`current_micro_batch` once, in its forward, and keeps what it read
for backward: the strategies' autograd functions store group and layout on ``ctx``, and a
recomputed layer re-enters the scope it captured. So the scope only has to cover the forward call;
a pipeline schedule may run the backward of one micro-batch after the forward of the next, each
keeping its own plan. The scope is a :mod:`contextvars` variable: nested scopes restore the outer
one, and threads (autograd's device threads included) never see another thread's scope.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.offload import ActivationOffload
from megatron_paradyse.core.plan import LayerOption, Plan

__all__ = ["MicroBatch", "active_micro_batch", "current_micro_batch", "micro_batch_scope"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MicroBatch:
    """One micro-batch as the layers of one pipeline stage see it."""

    layout: SequenceLayout
    """Padding, canonical order and attention visibility, shared by every sample of the micro-batch.
    Its ``p`` is the tensor-parallel size; the model's inputs are already in its canonical order."""
    plan: Plan
    """One option per transformer layer of this pipeline stage (all virtual-pipeline chunks of the
    stage, in layer order)."""
    attention_kernel: str = "auto"
    """Attention kernel for every strategy (:func:`megatron_paradyse.attention.get_kernel`)."""
    offload: ActivationOffload = dataclasses.field(default_factory=ActivationOffload, compare=False, repr=False)
    """Where the micro-batch's offloaded layers keep their inputs (layers whose option says ``+off``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.layout, SequenceLayout):
            raise ValueError(f"MicroBatch.layout must be a SequenceLayout, got {type(self.layout).__name__}")
        if not isinstance(self.plan, Plan):
            raise ValueError(f"MicroBatch.plan must be a Plan, got {type(self.plan).__name__}")

    def option(self, index: int, stage_layers: int) -> LayerOption:
        """The option of the stage's layer ``index`` (0-based, of ``stage_layers`` layers)."""
        if len(self.plan) != stage_layers:
            raise ValueError(
                f"the plan has {len(self.plan)} layer options, but this pipeline stage has {stage_layers} "
                f"transformer layers; plan every layer of the stage ({self.plan.compact()})"
            )
        return self.plan[index]


_CURRENT: contextvars.ContextVar[MicroBatch | None] = contextvars.ContextVar("paradyse_micro_batch", default=None)


@contextlib.contextmanager
def micro_batch_scope(micro_batch: MicroBatch) -> Iterator[MicroBatch]:
    """Make ``micro_batch`` the one the Paradyse layers run, for the calls inside the ``with``."""
    if not isinstance(micro_batch, MicroBatch):
        raise ValueError(f"micro_batch_scope takes a MicroBatch, got {type(micro_batch).__name__}")
    token = _CURRENT.set(micro_batch)
    try:
        yield micro_batch
    finally:
        _CURRENT.reset(token)


def active_micro_batch() -> MicroBatch | None:
    """The micro-batch of the innermost :func:`micro_batch_scope`, or None outside any."""
    return _CURRENT.get()


def current_micro_batch() -> MicroBatch:
    """The micro-batch of the innermost :func:`micro_batch_scope`; raises outside any."""
    micro_batch = _CURRENT.get()
    if micro_batch is None:
        raise RuntimeError(
            "a Paradyse layer ran outside micro_batch_scope: wrap the model call in "
            "`with micro_batch_scope(MicroBatch(layout=..., plan=...)):` (megatron_paradyse.core.micro_batch)"
        )
    return micro_batch
