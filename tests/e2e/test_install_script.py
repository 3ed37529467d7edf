"""scripts/install.sh: its arguments and the commands each recipe runs (``--dry-run``: nothing installed).

CI runs the CPU recipe for real; the CUDA recipe runs only where a GPU is lent (docs/gpu.md), so its
commands are checked here: the installed torch is never a requirement pip may replace, and nothing
outside ``--wheels`` is needed offline.
"""

from __future__ import annotations

import shlex
import subprocess

import pytest
import torch

from helpers.paths import ROOT

SCRIPT = ROOT / "scripts" / "install.sh"


def _install(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def _commands(result: subprocess.CompletedProcess) -> list[list[str]]:
    assert result.returncode == 0, result.stderr
    return [shlex.split(line[2:]) for line in result.stdout.splitlines() if line.startswith("+ ")]


def _pip_installs(commands: list[list[str]]) -> list[list[str]]:
    """The arguments after ``pip install --disable-pip-version-check`` of each pip install."""
    return [c[5:] for c in commands if c[1:4] == ["-m", "pip", "install"]]


def test_the_cpu_recipe_is_the_one_ci_has_always_run():
    installs = _pip_installs(_commands(_install("--machine", "cpu", "--dry-run")))
    assert installs == [
        ["torch==2.13.0"],
        ["numpy", "packaging>=24.2", "einops", "pyyaml", "psutil", "scikit-learn==1.9.1", "matplotlib==3.11.2"]
        + ["pytest", "pytest-timeout", "tensorboard==2.21.0"],
        ["--no-deps", "--ignore-requires-python", "megatron-core==0.19.2"],
        ["--no-deps", "--no-build-isolation", "-e", "."],
    ]


def test_the_cuda_recipe_keeps_torch_compiles_nothing_and_installs_offline_from_wheels(tmp_path):
    commands = _commands(_install("--machine", "cuda", "--wheels", str(tmp_path), "--dry-run"))
    assert "torch.version.cuda" in commands[0][-1]  # a CPU torch is refused before anything is installed
    installs = _pip_installs(commands)
    assert all(c[:3] == ["--no-index", "--find-links", str(tmp_path)] for c in installs)
    named = [arg for c in installs for arg in c[3:] if not arg.startswith("-")]
    assert not any(name.startswith("torch") for name in named)
    assert ["--no-deps", "megatron-core==0.19.2"] in [c[3:] for c in installs]  # its torch>=2.6 never resolved
    assert ["--no-deps", "--no-build-isolation", "-e", "."] in [c[3:] for c in installs]
    assert not any("transformer-engine" in n or "flash-attn" in n for n in named)  # extras only when asked


def test_extras_on_request():
    installs = _pip_installs(_commands(_install("--machine", "cuda", "--with", "te,flash-attn", "--dry-run")))
    extras = installs[-1]
    assert extras[0] == "--no-build-isolation"  # they build against the installed torch
    assert extras[1].startswith("transformer-engine[") and extras[1].endswith("pytorch]")
    assert extras[2] == "flash-attn>=2.6"
    assert _pip_installs(_commands(_install("--machine", "cuda", "--with=flash-attn", "--dry-run")))[-1] == [
        "--no-build-isolation",
        "flash-attn>=2.6",
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--with", "te", "--machine", "cpu"], "--with te: Transformer Engine and flash-attn need a CUDA machine"),
        (["--with", "apex", "--machine", "cuda"], "apex is not on PyPI"),
        (["--with", "te,xformers", "--machine", "cuda"], "--with takes te and flash-attn, got 'xformers'"),
        (["--with"], "--with needs a value"),
        (["--machine", "tpu"], "--machine takes cpu or cuda, got 'tpu'"),
        (["--wheels", "/no/such/folder"], "--wheels /no/such/folder: no such folder"),
        (["--bogus"], "unknown argument '--bogus'"),
    ],
)
def test_bad_arguments_stop_before_anything_runs(args, message):
    result = _install(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(f"install.sh: error: {message}")


def test_gpu_check_refuses_bad_arguments_and_a_machine_without_cuda():
    run = ["bash", str(ROOT / "scripts" / "gpu_check.sh")]
    result = subprocess.run([*run, "--bogus"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "gpu_check.sh: error: unknown argument '--bogus'" in result.stderr
    result = subprocess.run([*run, "--wheels"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--wheels takes one folder" in result.stderr
    if not torch.cuda.is_available():
        result = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert result.returncode == 1 and result.stderr.strip() == "gpu_check.sh: error: no CUDA device"
