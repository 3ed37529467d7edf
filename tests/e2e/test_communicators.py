"""The entry point warms every communicator its steps use before it measures the memory budget, and no other.

On CUDA, NCCL takes device memory outside PyTorch's caching allocator for each group's communicator, at its
first collective, and for each algorithm's and each peer's buffers at their first use. The budget is what
the allocator can hold, measured at start-up; whatever a step first uses after that measurement comes out
of the margin, in the middle of a step. Each rank here records every ``torch.distributed`` call it makes
(``helpers/scripts/record_collectives.py``): every group of two or more ranks, and every peer, that training,
validation and a checkpoint communicate with must have been warmed before the measurement, and every group
warmed must be used (a communicator made for nothing holds its buffers for nothing). The groups are
gloo's here; which groups a Megatron step uses does not depend on the backend.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from helpers.entry_point import SMALL_GPT, small_job_config
from helpers.job_ranks import launch
from helpers.paths import HELPERS

RECORDER = str(HELPERS / "scripts" / "record_collectives.py")


def _recorded_run(tmp_path: Path, cache_p2: Path, flags: list[str]) -> list[dict[str, set]]:
    """Four ranks train two iterations with ``flags``; each rank's (group, peer) pairs by phase."""
    config = small_job_config(tmp_path / "cfg.yaml", cache_p2, planner={"on_infeasible": "skip"})
    records = tmp_path / "records"
    records.mkdir()
    program = [RECORDER, "--paradyse-config", str(config), *SMALL_GPT, "--global-batch-size", "4", "--train-iters", "2"]
    result = launch(4, [*program, *flags], tmp_path / "ranks", env={"RECORD_DIR": str(records)})
    assert result.ok, result.output()
    ranks = []
    for rank in range(4):
        phases = defaultdict(set)
        for phase, group, size, peer in json.loads((records / f"rank{rank}.json").read_text()):
            if size > 1:  # a group of one rank connects to no one
                phases[phase].add((group, peer))
        ranks.append(phases)
    return ranks


def _check(ranks: list[dict[str, set]]) -> None:
    for rank, phases in enumerate(ranks):
        assert phases["step"] - phases["warming"] == set(), f"rank {rank}: first used after the budget was measured"
        unused = {group for group, _ in phases["warming"]} - {group for group, _ in phases["step"]}
        assert unused == set(), f"rank {rank}: warmed and never used"


def test_tensor_and_data_parallel_steps_use_only_warmed_communicators(tmp_path, cache_p2):
    """TP=2 x DP=2 with the distributed optimizer: the strategies' collectives and ring transfers, Megatron's
    gradient reduce-scatters, parameter gathers and its checks."""
    flags = ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]
    ranks = _recorded_run(tmp_path, cache_p2, flags)
    _check(ranks)
    # what the check covers: every kind of group, and transfers to a peer inside the tensor-parallel group
    groups = {group.split(" ")[1] for group, _ in ranks[0]["step"]}
    assert groups == {
        "default_pg", "TENSOR_MODEL_PARALLEL_GROUP", "DATA_PARALLEL_GROUP_WITH_CP", "MODEL_PARALLEL_GROUP",
        "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
    }  # fmt: skip
    assert {peer for group, peer in ranks[0]["step"] if "TENSOR" in group} == {None, 1}


def test_pipeline_steps_validation_and_checkpoints_use_only_warmed_communicators(tmp_path, cache_p2):
    """PP=2 x DP=2, two distributed-optimizer instances, tied and learned position embeddings, a validation
    and a checkpoint: activations between stages, the shared embedding's gradient, the instances' reduction,
    the data loader's state saved on the first stage."""
    flags = ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "1"]
    flags += ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]
    flags += ["--position-embedding-type", "learned_absolute", "--eval-iters", "1", "--eval-interval", "2"]
    flags += ["--save", str(tmp_path / "checkpoint"), "--save-interval", "2"]
    ranks = _recorded_run(tmp_path, cache_p2, flags)
    _check(ranks)
    for rank, peer in enumerate([2, 3, 0, 1]):
        assert {p for group, p in ranks[rank]["step"] if "PIPELINE" in group} == {None, peer}
    assert any("EMBEDDING_GROUP" in group for group, _ in ranks[0]["step"])
    assert any(group.endswith(" DATA_PARALLEL_GROUP") for group, _ in ranks[0]["step"])
