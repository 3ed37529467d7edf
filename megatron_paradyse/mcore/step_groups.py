"""The process groups a Megatron training step of this entry point communicates on, and how (its
checkpoints and validation included).

NCCL holds device memory outside PyTorch's caching allocator for each communicator and connects each
algorithm's and each peer's buffers at first use. The memory budget is sized by what the allocator can
hold once all of that is taken (:func:`megatron_paradyse.core.comm.warm_communicators`), so the list
must hold every group the step uses (``tests/e2e/test_communicators.py`` records a step's collectives and
checks that none runs on a group, or to a peer, not warmed first) and no other: a group warmed but never
used holds its buffers for nothing.
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from megatron_paradyse.core.comm import StepGroup

from megatron.core import parallel_state as mpu

__all__ = ["step_groups"]


def step_groups(args: argparse.Namespace) -> list[StepGroup]:
    """This rank's groups in one order on every rank (Megatron's parallel state must be initialised)."""
    groups = [
        # Megatron's flags and checks, the planners' agreement
        StepGroup(dist.group.WORLD, "none"),
        # the strategies: sequence-parallel collectives, ZeRO-3 gathers, all-to-alls, ring hops
        StepGroup(mpu.get_tensor_model_parallel_group(), "all"),
        # Megatron's DDP: gradient reduce-scatters (or all-reduces), parameter gathers; the loss
        StepGroup(mpu.get_data_parallel_group(with_context_parallel=True), "none"),
        # activations between neighbouring stages, the step's token count from the last stage
        StepGroup(mpu.get_pipeline_model_parallel_group(), "neighbours"),
        # the step's success, gradient norm and zeros (and, without the distributed optimizer, their reduction)
        StepGroup(mpu.get_model_parallel_group(), "none"),
    ]
    if args.use_distributed_optimizer:  # the gradient norm over an optimizer instance, instances' gradients
        groups.append(StepGroup(mpu.get_intra_distributed_optimizer_instance_group(), "none"))
        if args.num_distributed_optimizer_instances > 1:
            groups.append(StepGroup(mpu.get_inter_distributed_optimizer_instance_group(), "none"))
            partial = mpu.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
            groups.append(StepGroup(partial, "none"))
    if args.save and mpu.get_tensor_model_parallel_rank() == 0 and mpu.is_pipeline_first_stage(ignore_virtual=True):
        # a checkpoint's data-loader state: a barrier over the data-parallel group without context parallelism
        groups.append(StepGroup(mpu.get_data_parallel_group(), "none"))
    if not args.untie_embeddings_and_output_weights:  # the shared embedding's gradient, first and last stage
        groups.append(StepGroup(mpu.get_embedding_group(check_initialized=False), "none"))
    if args.position_embedding_type == "learned_absolute":
        groups.append(StepGroup(mpu.get_position_embedding_group(check_initialized=False), "none"))
    return groups
