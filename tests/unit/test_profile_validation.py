"""A cost profile is checked field by field when it is loaded: every value a cost model reads is present,
of its type, finite and in its range, and the message names the field."""

from __future__ import annotations

import copy
import json

import pytest

from megatron_paradyse.cost.hardware import HARDWARE, hardware_profile
from megatron_paradyse.cost.profile import ProfileError, load_profile, save_profile


@pytest.fixture
def profile() -> dict:
    return hardware_profile(HARDWARE["h100"])


def _load(tmp_path, data: dict) -> dict:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"schema": "megatron-paradyse/cost-profile", "version": 2, **data}))
    return load_profile(path, check_machine=False)


def test_a_valid_profile_loads_and_saves(tmp_path, profile):
    save_profile(profile, tmp_path / "saved.json")
    assert load_profile(tmp_path / "saved.json", check_machine=False)["gemm"] == profile["gemm"]


def test_a_profile_is_saved_whole_or_not_at_all(tmp_path, profile, monkeypatch):
    """Several tensor-parallel groups of a job may save the profile they calibrated into one cache file at
    once: a write cut short leaves the profile there before it, never a part of one."""
    import pathlib

    path = tmp_path / "saved.json"
    save_profile(profile, path)
    before = path.read_text()

    def cut_short(self, text):
        with open(self, "w") as f:
            f.write(text[: len(text) // 2])
        raise OSError("no space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", cut_short)
    with pytest.raises(OSError, match="no space left on device"):
        save_profile({**profile, "ring_overlap": 0.5}, path)
    monkeypatch.undo()
    assert path.read_text() == before and [f.name for f in tmp_path.iterdir()] == ["saved.json"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda p: p["attention"]["forward"]["causal"].update(per_call_s="fast"),
         "attention.forward.causal.per_call_s must be a number, got 'fast'"),
        (lambda p: p["collectives"]["8"]["all_gather"].update(per_byte_s=float("nan")),
         "collectives.8.all_gather.per_byte_s must be finite, got nan"),
        (lambda p: p["gemm"]["backward"].update(coef=[0.0, float("inf"), 0.0]),
         "gemm.backward.coef[1] must be finite, got inf"),
        (lambda p: p["gemm"]["forward"].update(coef=[1e-6, 1e-12]),
         "gemm.forward.coef must be a list of 3 numbers, got [1e-06, 1e-12]"),
        (lambda p: p["gemm"]["forward"].update(by_shape={"4096x14336": {"m": [4096, 1024], "per_flop_s": [1.0, 1.0]}}),
         "gemm.forward.by_shape.4096x14336.m must increase, got [4096, 1024]"),
        (lambda p: p["gemm"]["backward"].update(by_shape={"4096": {"m": [256], "per_flop_s": [-1.0]}}),
         "gemm.backward.by_shape: keys are GEMM shapes as strings '<n>x<k>', got '4096'; "
         "gemm.backward.by_shape.4096.per_flop_s[0] must be in [0, inf), got -1.0"),
        (lambda p: p["elementwise"].update(per_op_s=-1e-6), "elementwise.per_op_s must be in [0, inf), got -1e-06"),
        (lambda p: p.update(ring_overlap=1.5), "ring_overlap must be in [0, 1], got 1.5"),
        (lambda p: p.update(concurrency=True), "concurrency must be a positive int, got True"),
        (lambda p: p.update(dtype="fp8"), "dtype must be one of float32, bfloat16, float16, got 'fp8'"),
        (lambda p: p["attention"]["forward"]["causal"]["by_head_dim"].update({"128x2": p["elementwise"]}),
         "attention.forward.causal.by_head_dim: keys are head dims as strings '<hn>', got '128x2'; "
         "attention.forward.causal.by_head_dim.128x2.lengths must be a list of one or more numbers, got None; "
         "attention.forward.causal.by_head_dim.128x2.per_unit_s must be a list of one or more numbers, got None"),
        (lambda p: p["attention"]["backward"]["full"]["by_head_dim"]["128"]["lengths"].reverse(),
         "attention.backward.full.by_head_dim.128.lengths must increase, got [8192.0, 4096.0, 2048.0, 1024.0, 512.0]"),
        (lambda p: p.update(correction={"compute": 0, "comm": 1.0, "per_sync_s": 0.0, "per_layer_s": 0.0}),
         "correction.compute must be in (0, inf), got 0"),
    ],
)  # fmt: skip
def test_a_bad_value_is_named_with_its_field(tmp_path, profile, edit, message):
    bad = copy.deepcopy(profile)
    edit(bad)
    with pytest.raises(ProfileError) as err:
        _load(tmp_path, bad)
    assert str(err.value) == (
        f"cost profile {tmp_path / 'profile.json'} has values a cost model cannot use: {message}; recalibrate with "
        f"`paradyse calibrate`"
    )
