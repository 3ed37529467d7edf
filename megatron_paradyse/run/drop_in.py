"""The drop-in spec's planner of a pipeline stage (:mod:`megatron_paradyse.mcore.drop_in` asks for it on a
layer's first call outside any micro-batch scope): the paradyse config ``PARADYSE_CONFIG`` names (or the
defaults), Megatron's arguments, the stage's cost model priced by the config's ``cost.profile`` or a quick
profile the tensor-parallel group calibrates on itself once and caches in ``data.cache_dir``, and the
stage's budget (what the CUDA caching allocator can hold less ``memory.margin``; on a machine without CUDA
the config must give ``memory.budget_gib``). :mod:`megatron_paradyse.spec` installs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path

import torch

from megatron_paradyse.calibration.startup import startup_profile
from megatron_paradyse.config import DataSection, ParadyseConfig, load_config
from megatron_paradyse.core.allocator import expandable_segments_off
from megatron_paradyse.core.comm import StepGroup, warm_communicators
from megatron_paradyse.core.memory import allocator_capacity_bytes
from megatron_paradyse.cost import load_profile
from megatron_paradyse.mcore.drop_in import StagePlanner
from megatron_paradyse.mcore.model_shape import model_shape
from megatron_paradyse.run.stage_planning import (
    recompute_only,
    stage_cost_models,
    stage_footprints,
    stage_planners,
)

from megatron.core import parallel_state
from megatron.core.utils import get_pg_rank
from megatron.training.global_vars import get_args

__all__ = ["CONFIG_ENV", "stage_planner_of"]

logger = logging.getLogger(__name__)


def stage_planner_of(layer) -> StagePlanner:
    """The planner of the pipeline stage that holds ``layer`` (a Paradyse layer of a Megatron model)."""
    config = _paradyse_config()
    transformer = layer.config
    args = _megatron_args()
    p = layer.tp_group.size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    profile = _profile(config, p, transformer, args.seq_length, device, layer.tp_group)
    pp_rank = get_pg_rank(layer.pg_collection.pp)
    footprints = stage_footprints(args, transformer, device.type)
    costs = stage_cost_models(args, transformer, profile, footprints)
    budget = _budget_bytes(config, device, layer.tp_group)
    # Megatron's own forward step computes the loss: whole, never in chunks
    planner_config = dataclasses.replace(config.planner, loss_chunk_tokens=0)
    if p == 1:
        planner_config = recompute_only(planner_config)
    planner = stage_planners(planner_config, args, transformer, costs, footprints, budget)[pp_rank]
    printing = torch.distributed.get_rank(layer.tp_group) == 0 and _data_parallel_rank() == 0
    reserving_more = device.type == "cuda" and expandable_segments_off()
    if reserving_more and printing:  # CUDA is up: too late to turn them on here
        logger.warning("paradyse: stage %d: %s", pp_rank, reserving_more)
    return StagePlanner(planner, pp_rank, printing)


CONFIG_ENV = "PARADYSE_CONFIG"


def _paradyse_config() -> ParadyseConfig:
    path = os.environ.get(CONFIG_ENV)
    if path is None:
        return ParadyseConfig(data=DataSection(cache_dir=str(_default_cache())))
    config = load_config(path)
    if config.planner.learning.learn_time:  # every rank reads the same file: every rank stops here
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
    try:
        return get_args()
    except AssertionError as e:
        raise ValueError(
            "the Paradyse layers ran outside micro_batch_scope and outside Megatron's training entry "
            "(megatron.training's arguments are not set): plan the model's inputs yourself, under "
            "`with micro_batch_scope(MicroBatch(layout=..., plan=...)):` (megatron_paradyse.core.micro_batch)"
        ) from e


def _data_parallel_rank() -> int:
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
    if config.cost.profile is not None:
        return load_profile(
            config.cost.profile,
            p=p,
            check_machine=config.cost.check_machine,
            host_link=config.planner.space.host_memory_gib > 0,
        )
    return startup_profile(
        config.data.cache_dir,
        group,
        group,
        device=device,
        dtype=transformer.params_dtype,
        shape=model_shape(transformer),
        longest=longest,
    )
