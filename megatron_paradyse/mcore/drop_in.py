"""The Paradyse layers in a job that does not know them: a stock ``pretrain_gpt.py`` with
``--spec megatron_paradyse.spec get_paradyse_layer_spec`` and Megatron's own data pipeline.

Such a job calls the model as for Megatron's stock spec: tokens in natural order, split contiguously
over the tensor-parallel ranks by sequence parallelism, packed documents (if any) as
``PackedSeqParams`` (THD, ``cu_seqlens``), no :func:`~megatron_paradyse.core.micro_batch.micro_batch_scope`.
A Paradyse layer that finds no scope builds the micro-batch from what Megatron passes
(:func:`implicit_micro_batch`): the layout (the sequence length, the packed documents, the contiguous
order) and the plan of a planner made on first use from the paradyse config ``PARADYSE_CONFIG`` names
(or the defaults: what the CUDA caching allocator can hold, less ``memory.margin``; on a machine without
CUDA the config must give ``memory.budget_gib``), priced by its ``cost.profile`` or a quick profile the
tensor-parallel group calibrates on itself once and caches in ``data.cache_dir``. Every layer of a
forward gets the same micro-batch; a new plan is printed once.

The helpers that turn a Megatron job's arguments into the planner's inputs (:func:`stage_footprints`,
:func:`stage_cost_models`) serve the entry point (:mod:`megatron_paradyse.pretrain_gpt`) too.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import types
import weakref
from pathlib import Path

import torch

from megatron_paradyse.config import DataSection, ParadyseConfig, load_config
from megatron_paradyse.core.allocator import expandable_segments_off
from megatron_paradyse.core.comm import StepGroup, warm_communicators
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.memory import allocator_capacity_bytes
from megatron_paradyse.core.micro_batch import MicroBatch

__all__ = ["CONFIG_ENV", "implicit_micro_batch", "stage_cost_models", "stage_footprints", "stage_planner"]

logger = logging.getLogger(__name__)

CONFIG_ENV = "PARADYSE_CONFIG"
_GIB = 2**30


# -- a Megatron job's planner inputs --------------------------------------------------------------------
def stage_footprints(args: argparse.Namespace, transformer, device_type: str):
    """Static memory of every pipeline stage of a job with Megatron arguments ``args``, its optimizer
    stepping as Megatron's would on a ``device_type`` machine."""
    from megatron_paradyse.mcore.static_memory import (
        OptimizerSetup,
        megatron_optimizer_implementation,
        pipeline_footprints,
    )

    optimizer = OptimizerSetup(
        megatron_optimizer_implementation(device_type),
        name=args.optimizer,
        sgd_momentum=bool(args.sgd_momentum),
        weight_decay=args.weight_decay > 0,
        shards=args.data_parallel_size if args.use_distributed_optimizer else 1,
    )
    return pipeline_footprints(
        transformer,
        vocab_size=args.padded_vocab_size,
        tied_embeddings=not args.untie_embeddings_and_output_weights,
        learned_positions=args.max_position_embeddings if args.position_embedding_type == "learned_absolute" else 0,
        optimizer=optimizer,
        grads_in_fp32=args.accumulate_allreduce_grads_in_fp32 or not (args.bf16 or args.fp16),
    )


def cross_entropy_problem(fused: bool) -> str | None:
    """What is wrong with Megatron's ``--cross-entropy-loss-fusion`` (``fused``) for the memory count, if
    anything: the cost model counts the unfused cross-entropy's working set."""
    if not fused:
        return None
    return (
        "--cross-entropy-loss-fusion: the planner counts the memory of Megatron's unfused vocab-parallel "
        "cross-entropy; leave it out"
    )


def stage_cost_models(args: argparse.Namespace, transformer, profile: dict, footprints) -> list:
    """One analytic cost model per pipeline stage of the job (``footprints``: :func:`stage_footprints`),
    priced by ``profile``. The stages run the same layers: their models share what they price of them
    (:meth:`~megatron_paradyse.cost.AnalyticCostModel.for_stage`; every rank plans every stage)."""
    from megatron_paradyse.cost import AnalyticCostModel
    from megatron_paradyse.mcore.model_shape import model_shape, rotary_dim

    if problem := cross_entropy_problem(transformer.cross_entropy_loss_fusion):
        raise ValueError(problem)

    layers = AnalyticCostModel(
        profile,
        model_shape(transformer),
        args.tensor_model_parallel_size,
        dtype=transformer.params_dtype,
        rotary_dim=rotary_dim(transformer, args.position_embedding_type, args.rotary_percent),
        bias=transformer.add_bias_linear,
        normalization=transformer.normalization,
    )
    # one stage holds both: with pipeline stages the last one's copy is tied by an all-reduce
    tied_unfused_output = (
        args.pipeline_model_parallel_size == 1
        and not args.untie_embeddings_and_output_weights
        and not transformer.gradient_accumulation_fusion
    )
    return [
        layers.for_stage(
            static_bytes=f.static_bytes,
            vocab_size=args.padded_vocab_size if f.has_output_layer else 0,
            tied_unfused_output=tied_unfused_output,
        )
        for f in footprints
    ]


@dataclasses.dataclass(frozen=True, slots=True)
class StageBudget:
    """What a pipeline stage's planner plans to (:class:`~megatron_paradyse.planner.Planner`)."""

    bytes: float
    """The memory budget, shared by the stage's forwards and what its schedule keeps of the previous
    micro-batch."""
    forwards_in_flight: int
    """The most forwards the stage holds at once (:func:`forwards_in_flight`)."""
    kept_bytes_per_token: float = 0.0
    """What the schedule keeps of the previous micro-batch (:func:`kept_between_micro_batches_bytes`), per
    token of the step's longest micro-batch."""

    def holding(self, tokens: int) -> float:
        """The most the stage's forwards may hold at once in a step whose longest micro-batch has ``tokens``."""
        return self.bytes - self.kept_bytes_per_token * tokens


def forwards_in_flight(
    pp: int, micro_batches: int, virtual_stages: int | None = None, group_size: int | None = None
) -> list[int]:
    """The most forwards whose backward has not run yet that each pipeline stage holds at once in a
    training step of Megatron's schedule. 1F1B: stage ``s`` runs ``min(pp - s - 1, m)`` forwards of a
    micro-batch before its first backward, then one more before each: ``min(pp - s, m)``. Interleaved
    over ``virtual_stages`` model chunks a stage (micro-batches in groups of ``group_size``,
    ``microbatch_group_size_per_vp_stage``), a forward is one chunk's, of one micro-batch: Megatron's
    warm-up count of them, then one more before each backward."""
    if virtual_stages is None:
        return [min(pp - stage, micro_batches) for stage in range(pp)]
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    most = []
    for stage in range(pp):
        group = types.SimpleNamespace(size=lambda: pp, rank=lambda stage=stage: stage)
        schedule = types.SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=virtual_stages)
        total, _, warmup, _ = get_pp_rank_microbatches(
            micro_batches, virtual_stages, group_size, p2p_communicator=schedule
        )
        most.append(min(warmup + 1, total))
    return most


def step_stage_budgets(
    budget_bytes: float, footprints, args: argparse.Namespace, transformer, *, forward_only: bool = False
) -> list[StageBudget]:
    """Each pipeline stage's :class:`StageBudget` (``footprints``: :func:`stage_footprints`) in a step of the
    job with Megatron's validated ``args``: a training step runs the global batch's micro-batches (the
    final one, also while ``--rampup-batch-size`` grows it) through 1F1B or the interleaved schedule,
    each stage that receives its input from another keeping the previous micro-batch's input and its
    gradient, at most as long as the step's longest, into the next micro-batch's forward; a forward-only
    step keeps nothing past a forward."""
    virtual_stages = args.virtual_pipeline_model_parallel_size
    chunks = {len(f.chunk_layers) for f in footprints}
    if chunks != {virtual_stages or 1}:
        raise ValueError(
            f"the footprints' stages have {sorted(chunks)} model chunks, the schedule {virtual_stages or 1}: give "
            f"the TransformerConfig the arguments' virtual_pipeline_model_parallel_size"
        )
    micro_batches = 1 if forward_only else step_micro_batches(args)
    in_flight = forwards_in_flight(
        len(footprints),
        micro_batches,
        None if forward_only else virtual_stages,
        transformer.microbatch_group_size_per_vp_stage,
    )
    tp = transformer.tensor_model_parallel_size
    # per token of the step's longest micro-batch: what tp tokens (one row on each rank) keep, over tp
    kept = kept_between_micro_batches_bytes(transformer, tp, args.micro_batch_size) / tp if micro_batches > 1 else 0.0
    # interleaved, the first stage's later chunks receive their input from the last stage
    return [
        StageBudget(budget_bytes, k, kept if stage > 0 or virtual_stages is not None else 0.0)
        for stage, k in enumerate(in_flight)
    ]


def stage_planner(
    planner_config, cost_model, footprint, budget: StageBudget, args: argparse.Namespace, *, time_corrections=None
):
    """The planner of one pipeline stage of the job with Megatron's validated ``args``: its layers
    (``footprint``), in model chunks where the schedule interleaves them, priced by ``cost_model``, to
    ``budget`` (:func:`step_stage_budgets`) for micro-batches up to ``--seq-length`` tokens."""
    from megatron_paradyse.planner import Planner

    return Planner.for_model(
        planner_config,
        cost_model,
        shape=cost_model.shape,
        p=args.tensor_model_parallel_size,
        num_layers=footprint.layers,
        budget_bytes=budget.bytes,
        chunk_layers=footprint.chunk_layers,
        forwards_in_flight=budget.forwards_in_flight,
        longest_tokens=args.seq_length,
        reserved_bytes_per_token=budget.kept_bytes_per_token,
        time_corrections=time_corrections,
    )


def step_micro_batches(args: argparse.Namespace) -> int:
    """The most micro-batches one data-parallel rank runs in a training step (Megatron's validated ``args``):
    the global batch's, which ``--rampup-batch-size`` reaches last."""
    return args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)


def kept_between_micro_batches_bytes(transformer, tokens: int, micro_batch_size: int) -> float:
    """What a stage that receives its input keeps beside the forwards in flight, at the longest micro-batch
    (``tokens`` a row), each an ``[s/p, b, h]`` in the pipeline's dtype: the previous micro-batch's input
    gradient (the schedule's, until the next backward) and its input (a leaf of its output's autograd
    graph, which lives until the next forward's output replaces it); with Megatron's overlapped p2p
    exchange (``overlap_p2p_comm``, the interleaved schedule's default), also the next forward's input and
    the next backward's output gradient, received into ahead of the work they overlap."""
    dtype = transformer.pipeline_dtype or transformer.params_dtype
    rows = tokens // transformer.tensor_model_parallel_size * micro_batch_size
    activations = 4 if transformer.overlap_p2p_comm else 2
    return activations * rows * transformer.hidden_size * dtype.itemsize


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
    step = stage.plan(layout, b)
    anchor = packed_seq_params if packed_seq_params is not None else _NOTHING
    stage.last = (key, weakref.ref(anchor), step)
    return step


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
        from megatron.core.utils import get_pg_rank

        config = _paradyse_config()
        transformer = layer.config
        args = _megatron_args()
        p = layer.tp_group.size()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        profile = _profile(config, p, transformer, args.seq_length, device, layer.tp_group)
        pp_rank = get_pg_rank(layer.pg_collection.pp)
        footprints = stage_footprints(args, transformer, device.type)
        cost = stage_cost_models(args, transformer, profile, footprints)[pp_rank]
        budget = _budget_bytes(config, device, layer.tp_group)
        budget = step_stage_budgets(budget, footprints, args, transformer)[pp_rank]
        # Megatron's own forward step computes the loss: whole, never in chunks
        planner_config = dataclasses.replace(config.planner, loss_chunk_tokens=0)
        if p == 1:
            planner_config = _recompute_only(planner_config)
        self.planner = stage_planner(planner_config, cost, footprints[pp_rank], budget, args)
        self.printing = torch.distributed.get_rank(layer.tp_group) == 0 and _data_parallel_rank() == 0
        self.pp_rank = pp_rank
        reserving_more = device.type == "cuda" and expandable_segments_off()
        if reserving_more and self.printing:  # CUDA is up: too late to turn them on here
            logger.warning("paradyse: stage %d: %s", pp_rank, reserving_more)
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


def _recompute_only(planner_config):
    """At TP=1 one rank holds the whole sequence and every strategy runs the same computation: plans
    choose recompute per layer only."""
    return dataclasses.replace(planner_config, pairs=("tp_sp/tp_sp",), attention=None, mlp=None)


def _paradyse_config() -> ParadyseConfig:
    path = os.environ.get(CONFIG_ENV)
    if path is None:
        return ParadyseConfig(data=DataSection(cache_dir=str(_default_cache())))
    config = load_config(path)
    if config.planner.learn_time:  # every rank reads the same file: every rank stops here
        raise ValueError(
            f"{path}: planner.learn_time: the drop-in spec cannot learn the time model (it plans inside the "
            f"layers, and Megatron's own loop gives the ranks no iteration boundary to agree on what they "
            f"measured); set planner.learn_time: false, or train with "
            f"`python -m megatron_paradyse.pretrain_gpt --paradyse-config {path}`"
        )
    if config.planner.on_infeasible == "skip":
        raise ValueError(
            f"{path}: planner.on_infeasible: skip: the drop-in spec cannot skip a micro-batch (Megatron's own "
            f"loop runs every one it is given); set planner.on_infeasible: stop, or train with "
            f"`python -m megatron_paradyse.pretrain_gpt --paradyse-config {path}`, which skips"
        )
    return config


def _default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megatron-paradyse"


def _megatron_args() -> argparse.Namespace:
    from megatron.training.global_vars import get_args

    try:
        return get_args()
    except AssertionError as e:
        raise ValueError(
            "the Paradyse layers ran outside micro_batch_scope and outside Megatron's training entry "
            "(megatron.training's arguments are not set): plan the model's inputs yourself, under "
            "`with micro_batch_scope(MicroBatch(layout=..., plan=...)):` (megatron_paradyse.core.micro_batch)"
        ) from e


def _data_parallel_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0


def _budget_bytes(config: ParadyseConfig, device: torch.device, group) -> float:
    """The config's budget; on CUDA sized by what the caching allocator can hold, the least over ``group``
    (the ranks that plan together; collectives over them), once the group's communicator is connected for
    every transfer the strategies make. The other groups of Megatron's step are left to the margin: this
    runs inside Megatron's schedule, where a collective over them could cross a pipeline transfer."""
    warm_communicators([StepGroup(group, "all")], device)
    budget = config.memory.budget_bytes(allocator_capacity_bytes(device, group))
    if budget is None:
        raise ValueError(
            f"the Paradyse layers need a memory budget on a machine without CUDA: set memory.budget_gib in the "
            f"paradyse config {CONFIG_ENV} names"
        )
    return budget


def _profile(config: ParadyseConfig, p: int, transformer, longest: int, device: torch.device, group) -> dict:
    """The config's cost profile; or a quick one with the model's own work up to ``longest`` tokens, read
    from the cache or calibrated by the tensor-parallel group on itself (the ranks that plan together,
    which reach their first Paradyse layer together: the pipeline's other stages are not waited for)."""
    from megatron_paradyse.cost import load_profile

    if config.cost.profile is not None:
        return load_profile(
            config.cost.profile,
            p=p,
            check_machine=config.cost.check_machine,
            host_link=config.planner.host_memory_gib > 0,
        )
    from megatron_paradyse.calibration.calibrate import startup_profile
    from megatron_paradyse.mcore.model_shape import model_shape

    return startup_profile(
        config.data.cache_dir,
        group,
        group,
        device=device,
        dtype=transformer.params_dtype,
        shape=model_shape(transformer),
        longest=longest,
    )
