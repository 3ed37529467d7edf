"""Run ``megatron_paradyse.pretrain_gpt`` with its flags, recording what each rank communicates on.

Every ``torch.distributed`` communication call (not those it makes inside another) is recorded as
``[phase, group, group size, peer]``. ``group``: its name and description; ``peer``: None for a
collective, the peer's global rank for a point-to-point transfer (an all-to-all: one record per other
rank); ``phase``: ``"warming"`` inside :func:`~megatron_paradyse.core.comm.warm_communicators`,
``"start-up"`` before the memory budget is measured, ``"step"`` after. Each rank writes its records to
``$RECORD_DIR/rank<N>.json`` when it exits. The fake groups a strategy's memory is recorded on
(``mcore/memory_record.py``) communicate with no one and are left out.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
import runpy
import sys

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

COLLECTIVES = [
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "_reduce_scatter_base", "_all_gather_base", "broadcast", "reduce", "gather", "scatter", "barrier",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "monitored_barrier",
]  # fmt: skip
POINT_TO_POINT = ["send", "recv", "isend", "irecv"]
ALL_TO_ALL = ["all_to_all", "all_to_all_single"]

records: list[list] = []
phase = ["start-up"]
depth = [0]


def _record(group, peers) -> None:
    from megatron_paradyse.mcore.memory_record import FAKE_GROUP_DESC  # after the wrapping: megatron binds then

    group = group if group is not None else dist.group.WORLD
    if group.group_desc == FAKE_GROUP_DESC:  # a memory recording's: it connects to no one
        return
    size = dist.get_world_size(group)
    for peer in peers:
        records.append([phase[0], f"{group.group_name} {group.group_desc}", size, peer])


def _outermost(fn, peers_of):
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        if depth[0] == 0:
            bound = signature.bind(*args, **kwargs).arguments
            _record(bound.get("group"), peers_of(bound))
        depth[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            depth[0] -= 1

    return recorded


def _all_peers(bound) -> list[int]:
    group = bound.get("group") or dist.group.WORLD
    return [rank for rank in dist.get_process_group_ranks(group) if rank != dist.get_rank()]


def _wrap(names, peers_of) -> None:
    for name in names:
        recorded = _outermost(getattr(c10d, name), peers_of)
        setattr(c10d, name, recorded)
        setattr(dist, name, recorded)


_wrap(COLLECTIVES, lambda bound: [None])
_wrap(POINT_TO_POINT, lambda bound: [bound.get("dst", bound.get("src"))])
_wrap(ALL_TO_ALL, _all_peers)
_batch_isend_irecv = c10d.batch_isend_irecv


def batch_isend_irecv(p2p_op_list):
    if depth[0] == 0:
        for op in p2p_op_list:
            _record(op.group, [op.peer])
    depth[0] += 1
    try:
        return _batch_isend_irecv(p2p_op_list)
    finally:
        depth[0] -= 1


c10d.batch_isend_irecv = dist.batch_isend_irecv = batch_isend_irecv


def _in_phase(name, fn, after=None):
    @functools.wraps(fn)
    def in_phase(*args, **kwargs):
        before = phase[0]
        phase[0] = name
        try:
            return fn(*args, **kwargs)
        finally:
            phase[0] = after or before

    return in_phase


@atexit.register
def _write() -> None:
    with open(os.path.join(os.environ["RECORD_DIR"], f"rank{os.environ['RANK']}.json"), "w") as out:
        json.dump(records, out)


if __name__ == "__main__":
    from megatron_paradyse.run import job

    job.warm_communicators = _in_phase("warming", job.warm_communicators)
    job.Job.measure_budget = _in_phase("start-up", job.Job.measure_budget, after="step")
    sys.argv = ["megatron_paradyse.pretrain_gpt", *sys.argv[1:]]
    runpy.run_module("megatron_paradyse.pretrain_gpt", run_name="__main__", alter_sys=True)
