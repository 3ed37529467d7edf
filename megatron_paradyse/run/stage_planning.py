"""The planners of a Megatron job's pipeline stages, from its arguments: each stage's static memory
(:func:`stage_footprints`), cost model (:func:`stage_cost_models`), budget over a step's schedule
(:func:`step_stage_budgets`) and planner (:func:`stage_planners`, for training steps or forward-only
ones). One assembly for the training entry point (:mod:`megatron_paradyse.run.job`,
:mod:`~megatron_paradyse.run.training`), the drop-in spec (:mod:`megatron_paradyse.run.drop_in`) and
``paradyse plan`` (:mod:`~megatron_paradyse.run.plan_cli`).
"""

from __future__ import annotations

import argparse
import dataclasses
import types

from megatron_paradyse.cost import AnalyticCostModel
from megatron_paradyse.mcore.model_shape import model_shape, rotary_dim
from megatron_paradyse.mcore.static_memory import OptimizerSetup, megatron_optimizer_implementation, pipeline_footprints
from megatron_paradyse.planner import Planner
from megatron_paradyse.planner.planner import ForwardOnlyCost

from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

__all__ = [
    "StageBudget",
    "cross_entropy_problem",
    "forwards_in_flight",
    "forwards_in_flight_message",
    "kept_between_micro_batches_bytes",
    "recompute_only",
    "stage_cost_models",
    "stage_footprints",
    "stage_planners",
    "step_micro_batches",
    "step_stage_budgets",
]


def stage_footprints(args: argparse.Namespace, transformer, device_type: str):
    """Static memory of every pipeline stage of a job with Megatron arguments ``args``, its optimizer
    stepping as Megatron's would on a ``device_type`` machine."""
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
        hidden_dropout=transformer.hidden_dropout > 0,
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


def stage_planners(
    planner_config,
    args: argparse.Namespace,
    transformer,
    cost_models,
    footprints,
    budget_bytes: float,
    *,
    forward_only: bool = False,
    time_corrections=None,
    bucket_cap: int | None = None,
) -> list[Planner]:
    """One planner per pipeline stage of the job with Megatron's validated ``args``: each stage's layers
    (``footprints``: :func:`stage_footprints`), in model chunks where the schedule interleaves them, priced
    by its cost model (:func:`stage_cost_models`), to its share of ``budget_bytes`` over a step
    (:func:`step_stage_budgets`), for micro-batches up to ``--seq-length`` tokens. ``forward_only``: for
    validation and test steps (:class:`~megatron_paradyse.planner.planner.ForwardOnlyCost`, no recompute).
    ``bucket_cap``: the longest micro-batch the planners will see, where their last length bucket ends
    (default ``--seq-length``, a job's longest: the entry point's ``data.token_budget`` or ``data.max_len``)."""
    budgets = step_stage_budgets(budget_bytes, footprints, args, transformer, forward_only=forward_only)
    if forward_only:
        planner_config = planner_config.forward_only()
        cost_models = [ForwardOnlyCost(cost) for cost in cost_models]
    return [
        Planner.for_model(
            planner_config,
            cost,
            shape=cost.shape,
            p=args.tensor_model_parallel_size,
            num_layers=footprint.layers,
            budget_bytes=budget.bytes,
            chunk_layers=footprint.chunk_layers,
            forwards_in_flight=budget.forwards_in_flight,
            longest_tokens=args.seq_length,
            reserved_bytes_per_token=budget.kept_bytes_per_token,
            bucket_cap=args.seq_length if bucket_cap is None else bucket_cap,
            time_corrections=time_corrections,
        )
        for cost, footprint, budget in zip(cost_models, footprints, budgets)
    ]


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


def recompute_only(planner_config):
    """At TP=1 one rank holds the whole sequence and every strategy runs the same computation: plans
    choose recompute per layer only."""
    return dataclasses.replace(planner_config, pairs=("tp_sp/tp_sp",), attention=None, mlp=None)


def forwards_in_flight_message(args: argparse.Namespace, transformer, on_infeasible: str) -> str | None:
    """Where the pipeline schedule keeps several forwards on a stage, the line that says how the planner
    budgets them (:func:`forwards_in_flight`; by each step's longest micro-batch where the
    step is known before it runs, :meth:`PlannedMicroBatches.check_step`)."""
    pp, virtual_stages, micro_batches = (
        args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        step_micro_batches(args),
    )
    in_flight = forwards_in_flight(pp, micro_batches, virtual_stages, transformer.microbatch_group_size_per_vp_stage)
    if max(in_flight) < 2:
        return None
    if virtual_stages is None:
        schedule, held = "1F1B", "micro-batches"
    else:
        schedule, held = f"the interleaved schedule ({virtual_stages} chunks a stage)", "model chunks of micro-batches"
    return (
        f"paradyse: PP={pp}: with {micro_batches} micro-batches per step under {schedule}, pipeline stages "
        f"0..{pp - 1} hold activations of up to {', '.join(map(str, in_flight))} {held} at once: each may hold "
        + (
            f"what the step's longest micro-batch (at most --seq-length {args.seq_length} tokens) holds"
            if on_infeasible == "stop"
            else f"what a micro-batch of --seq-length {args.seq_length} tokens holds"
        )
        + " under the fastest plan that fits that many of it, and peak in what the others leave"
    )
