"""Cost profiles and shapes the cost tests share: a synthetic CPU profile (plausible constants, so that
nothing depends on this machine's speed), the layers it prices, and a calibration grid small enough for
a test."""

from __future__ import annotations

import dataclasses

from megatron_paradyse.calibration import grid as grids
from megatron_paradyse.cost.hardware import HARDWARE, hardware_profile
from megatron_paradyse.cost.profile import PROFILE_SCHEMA, fingerprint
from megatron_paradyse.strategies import ModelShape

MHA = ModelShape(hidden_size=256, num_attention_heads=8, num_query_groups=8, kv_channels=32, ffn_hidden_size=1024)
GQA = ModelShape(
    hidden_size=256, num_attention_heads=8, num_query_groups=4, kv_channels=32, ffn_hidden_size=512, gated_mlp=True
)


def synthetic_profile(p_values=(2, 4)) -> dict:
    """A CPU profile with collectives for each of ``p_values``."""
    linear = {"coef": [2e-5, 1.5e-11, 1e-11]}
    rates = {"lengths": [128.0, 2048.0], "per_unit_s": [3e-11, 2e-11]}
    attention = {"per_call_s": 5e-5, "by_head_dim": {"32": rates, "128": rates}}
    attention_bwd = {"per_call_s": 1e-4, "by_head_dim": {"64": {"lengths": [128.0], "per_unit_s": [7e-11]}}}
    comm = {"latency_s": 5e-4, "per_byte_s": 1e-9}
    return {
        "schema": PROFILE_SCHEMA,
        "version": 2,
        "grid": "quick",
        "fingerprint": fingerprint("cpu"),
        "dtype": "float32",
        "concurrency": max(p_values),
        "gemm": {"forward": linear, "backward": {"coef": [4e-5, 1.5e-11, 2e-11]}},
        "attention": {
            "kernel": "torch",
            "forward": {"causal": attention, "full": attention},
            "backward": {"causal": attention_bwd, "full": attention_bwd},
        },
        "elementwise": {"per_byte_s": 2e-11, "per_op_s": 1e-6},
        "collectives": {
            str(p): {
                k: dict(comm)
                for k in ("all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast", "reduce")
            }
            for p in p_values
        },
        "ring_overlap": 0.5,
        "allocator_slack": 0.0,
        "correction": None,
    }


def published_profile(p: int, dtype: str = "float32") -> dict:
    """Published A100 figures for ``p`` ranks relabelled ``dtype``, no allocator slack: for a CPU run whose
    plans and peaks do not depend on the rates (the adaptive arm's choices do, which is all such a test
    needs), where a CPU calibration would take minutes."""
    profile = hardware_profile(dataclasses.replace(HARDWARE["a100"], p=p))
    profile.update(dtype=dtype, allocator_slack=0.0)
    return profile


TINY_GRID = grids.Grid(
    gemm_m=(32, 256),
    gemm_nk=((128, 128), (384, 128)),
    attention_blocks=((64, 2), (256, 1)),
    attention_hn=(32,),
    attention_rect_max=64,
    comm_bytes=(4 << 10, 256 << 10),
    repeats=2,
    correction_lengths=(64, 128),
)
"""A calibration grid for tests: two GEMM sizes, two attention blocks, two message sizes, two repeats."""
CALIBRATED_LAYER = ModelShape(
    hidden_size=128, num_attention_heads=8, num_query_groups=8, kv_channels=16, ffn_hidden_size=256
)
"""A model's layer that calibration measures in seconds (its own GEMMs and attention, its correction)."""
