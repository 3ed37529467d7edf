"""The Paradyse layers in a job that does not know them: a stock ``pretrain_gpt.py`` with
``--spec megatron_paradyse.spec get_paradyse_layer_spec`` and Megatron's own data pipeline.

Such a job calls the model as for Megatron's stock spec: tokens in natural order, split contiguously
over the tensor-parallel ranks by sequence parallelism, packed documents (if any) as
``PackedSeqParams`` (THD, ``cu_seqlens``), no :func:`~megatron_paradyse.core.micro_batch.micro_batch_scope`.
A Paradyse layer that finds no scope builds the micro-batch from what Megatron passes
(:func:`implicit_micro_batch`): the layout (the sequence length, the packed documents, the contiguous
order) and the plan of its stage's planner, made on first use by the planner factory
:func:`plan_with` installs (:func:`megatron_paradyse.run.drop_in.stage_planner_of`, which
:mod:`megatron_paradyse.spec` installs: it calibrates and reads the config, above this adapter). Every
layer of a forward gets the same micro-batch; a new plan is printed once.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import torch

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.micro_batch import MicroBatch
from megatron_paradyse.planner import Planner

__all__ = ["StagePlanner", "implicit_micro_batch", "plan_with"]

_GIB = 2**30


@dataclasses.dataclass(frozen=True, slots=True)
class StagePlanner:
    """What a planner factory gives for a layer's pipeline stage."""

    planner: Planner
    pp_rank: int
    printing: bool
    """This rank prints the stage's plans (one rank of the stage's tensor-parallel group, of data-parallel
    rank 0)."""


_factory: Callable[[object], StagePlanner] | None = None


def plan_with(factory: Callable[[object], StagePlanner]) -> None:
    """Make the planner of a layer's stage with ``factory(layer)`` on the stage's first implicit micro-batch."""
    global _factory
    _factory = factory


# -- the implicit micro-batch ------------------------------------------------------------------------------
def implicit_micro_batch(layer, hidden_states: torch.Tensor, packed_seq_params) -> MicroBatch:
    """The micro-batch a Paradyse ``layer`` runs when Megatron calls it outside any scope: built from its
    input ``hidden_states [s/p, b, h]`` (contiguous sequence-parallel shard) and ``packed_seq_params``."""
    p = layer.tp_group.size()
    s, b = hidden_states.shape[0] * p, hidden_states.shape[1]
    stage = _Stage.of(layer)
    key = (s, b, None if packed_seq_params is None else id(packed_seq_params))
    if stage.last is not None and stage.last[0] == key and stage.last[1]() is packed_seq_params:
        return stage.last[2]  # the other layers of the same forward
    layout = _layout(s, p, layer.self_attention.causal, packed_seq_params)
    micro_batch = stage.plan(layout, b)
    anchor = packed_seq_params if packed_seq_params is not None else _NOTHING
    stage.last = (key, weakref.ref(anchor), micro_batch)
    return micro_batch


class _Nothing:
    """What an unpacked micro-batch's layers share: any object a weak reference can point to."""


_NOTHING = _Nothing()


def _layout(s: int, p: int, causal: bool, packed) -> SequenceLayout:
    if s % (2 * p):
        raise ValueError(
            f"the Paradyse layers split a sequence into 2p = {2 * p} equal chunks, but it has {s} tokens; give "
            f"--seq-length a multiple of {2 * p} (twice the tensor-parallel size)"
        )
    docs: tuple[int, ...] = (s,)
    if packed is not None:
        if packed.qkv_format != "thd":
            raise ValueError(f"PackedSeqParams with qkv_format={packed.qkv_format!r}: the Paradyse layers read 'thd'")
        cu = packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else packed.cu_seqlens_q
        bounds = [int(v) for v in cu.tolist()]
        docs = tuple(e - a for a, e in zip(bounds, bounds[1:]) if e > a)
        if bounds[0] != 0 or sum(docs) > s:
            raise ValueError(f"PackedSeqParams' cu_seqlens {bounds} do not describe the micro-batch's {s} tokens")
    return SequenceLayout(docs, p, causal, s, order="contiguous")


class _Stage:
    """The planner of this process's pipeline stage, made on first use, and the last micro-batch it planned."""

    _by_layers: dict[tuple[int, int], _Stage] = {}

    def __init__(self, layer) -> None:
        if _factory is None:
            raise ValueError(
                "the Paradyse layers ran outside micro_batch_scope with no planner installed: build the spec "
                "with megatron_paradyse.spec.get_paradyse_layer_spec (which installs the drop-in planner), or "
                "plan the model's inputs yourself under `with micro_batch_scope(MicroBatch(layout=..., plan=...)):`"
            )
        stage = _factory(layer)
        self.planner, self.pp_rank, self.printing = stage.planner, stage.pp_rank, stage.printing
        self.shown: str | None = None
        self.last: tuple | None = None

    @classmethod
    def of(cls, layer) -> _Stage:
        key = (layer.tp_group.size(), layer.stage_layers)
        if key not in cls._by_layers:
            cls._by_layers[key] = cls(layer)
        return cls._by_layers[key]

    def plan(self, layout: SequenceLayout, micro_batch_size: int) -> MicroBatch:
        decision = self.planner.decide(layout, micro_batch_size)
        plan = decision.plan
        if self.printing and plan.compact() != self.shown:
            self.shown = plan.compact()
            print(
                f"paradyse: stage {self.pp_rank}: {layout.valid_len} tokens ({len(layout.doc_lengths)} documents) x "
                f"{micro_batch_size}: plan {plan.compact()} (predicted {plan.predicted_time_s:.4g} s, peak "
                f"{plan.predicted_peak_bytes / _GIB:.3f} GiB of {self.planner.step_budget_bytes(layout.p) / _GIB:.3f})",
                flush=True,
            )
        return MicroBatch(layout=layout, plan=plan)
