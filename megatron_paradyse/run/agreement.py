"""Start-up check that every rank plans from the same inputs.

Every rank computes the plan of each micro-batch itself, without communication (DESIGN.md, invariant
5), so every rank must read the same resolved config, the same cost profile and the same library
version; otherwise ranks would run different strategies inside one collective and hang.
:func:`check_ranks_agree` hashes those inputs and compares the hashes in one all-gather that every
rank reaches (a rank that cannot read its profile still takes part), then raises the same clear error
on every rank if they differ.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

import megatron_paradyse
from megatron_paradyse.strategies import strategy_names

__all__ = ["RankDisagreement", "check_ranks_agree", "config_digest"]

_ITEMS = ("config", "cost profile", "software")
_DIGEST = 32  # sha256 bytes


class RankDisagreement(ValueError):
    """Ranks would plan from different inputs."""


def config_digest(config: object) -> bytes:
    """sha256 of a canonical JSON form of ``config`` (dataclasses, mappings, sequences and scalars).

    Keys are sorted and floats written exactly, so equal configs hash equally on every rank; objects
    with no canonical form (whose ``repr`` could hold a memory address) are refused.
    """
    text = json.dumps(_canonical(config), sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).digest()


def check_ranks_agree(
    config: object, profile_paths: Sequence[str | os.PathLike] = (), *, group: ProcessGroup | None = None
) -> str:
    """Raise :class:`RankDisagreement` on every rank unless all ranks of ``group`` (default: the world)
    hold the same ``config``, the same contents of ``profile_paths`` and the same library version.

    Call it once at start-up, on every rank, after ``init_process_group``. Returns the agreed digest
    (hex) for the log.
    """
    unreadable = None
    profile = hashlib.sha256()
    for path in profile_paths:
        try:
            contents = Path(path).read_bytes()
        except OSError as e:
            unreadable = f"{path}: {e}"
            profile.update(b"\0unreadable")
            continue
        profile.update(hashlib.sha256(contents).digest())
    software = json.dumps(
        [megatron_paradyse.__version__, strategy_names("attention"), strategy_names("mlp")], separators=(",", ":")
    )
    local = (
        config_digest(config)
        + profile.digest()
        + hashlib.sha256(software.encode()).digest()
        + bytes([unreadable is not None])
    )
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.frombuffer(bytearray(local), dtype=torch.uint8).to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    rows = [bytes(t.cpu().tolist()) for t in gathered]

    problems = []
    for i, item in enumerate(_ITEMS):
        ranks_by_digest: dict[bytes, list[int]] = {}
        for rank, row in enumerate(rows):
            ranks_by_digest.setdefault(row[i * _DIGEST : (i + 1) * _DIGEST], []).append(rank)
        if len(ranks_by_digest) > 1:
            groups = "; ".join(f"ranks {ranks} have {digest.hex()[:12]}" for digest, ranks in ranks_by_digest.items())
            problems.append(f"the {item} differs: {groups}")
    failed = [rank for rank, row in enumerate(rows) if row[-1]]
    if failed:
        problems.append(f"ranks {failed} could not read their cost profile")
    if unreadable is not None:
        problems.append(f"this rank could not read {unreadable}")
    if problems:
        raise RankDisagreement(
            "ranks would plan from different inputs: "
            + "; ".join(problems)
            + ". Give every rank the same config file and overrides, the same profile files and the same "
            "megatron-paradyse version"
        )
    return hashlib.sha256(local).hexdigest()


def _canonical(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise ValueError(f"config mappings need string keys to be hashed, got keys {list(value)}")
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, enum.Enum):
        return _canonical(value.value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise ValueError(
        f"cannot hash a config holding {type(value).__name__} {value!r}; use dataclasses, mappings, sequences "
        f"and scalars"
    )
