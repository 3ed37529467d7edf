"""Jobs of the training entry point small enough for gloo ranks on a 2-core machine."""

from __future__ import annotations

from pathlib import Path

import yaml

SMALL_GPT = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
    "--position-embedding-type", "rope", "--attention-dropout", "0", "--hidden-dropout", "0", "--lr", "1e-3",
]  # fmt: skip
"""A 2-layer GPT's Megatron flags; each test adds the parallel layout, batch and iterations it runs."""


def small_job_config(path: Path, cache_p2: Path, **sections) -> Path:
    """A paradyse config at ``path`` for :data:`SMALL_GPT` on TP=2: 8 code files of 128 to 4,096 tokens
    from ``cache_p2`` (the ``cache_p2`` fixture: its corpus and profile), 16 MiB a rank, files no plan
    fits skipped; ``sections`` replace the defaults' sections."""
    data = {
        "memory": {"budget_gib": 1 / 64},
        "cost": {"profile": str(cache_p2 / "profile.json"), "check_machine": False},
        "data": {
            "dataset": "code",
            "cache_dir": str(cache_p2),
            "num_documents": 8,
            "min_len": 128,
            "max_len": 4096,
        },
        "planner": {"on_infeasible": "skip"},
        "log": {"jsonl": "log.jsonl"},
        **sections,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path
