"""scripts/node_check.sh: its reduced form (``--cpu``) end to end, as on a node but on 2 gloo ranks (the
training comparison under torchrun, the summary line, the result file), its exit when a part fails, and
its messages for bad arguments. The calibration is given (``--profile``: published figures relabelled
bf16), as a CPU calibration takes minutes; the GPU tests do not run in the reduced form. The run trains in
bf16 with the optimizer's fp32 weights, as on the node: every rank's measured peak is within 2% of the
cost model's, and the adaptive arm's forward and backward read nothing back to the host."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from megatron_paradyse.bench.memory import PAIRINGS
from megatron_paradyse.cost.profile import save_profile

from helpers.cost_profiles import published_profile
from helpers.paths import ROOT, SCRIPTS

RANKS = 2
SUMMARY = (
    r"node_check: tests=0 calibration=0 training=0 adaptive_vs_best_static=\S+ adaptive_vs_megatron=\S+ .* "
    r"peak_predicted_over_measured_min=(\S+) peak_predicted_over_measured_max=(\S+) .* host_syncs=0 "
    r"tokens_per_s=(\d+) mfu=nan"
)


def _node_check(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    command = ["bash", str(SCRIPTS / "node_check.sh"), *args]
    environment = {**os.environ, **(env or {})}
    return subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("node-check")
    save_profile(published_profile(RANKS, "bfloat16"), tmp / "profile.json")
    run = _node_check("--cpu", "--profile", str(tmp / "profile.json"), "--results-dir", str(tmp / "results"))
    return run, tmp / "results"


def test_the_reduced_run_compares_every_arm_and_writes_its_result(reduced):
    run, results = reduced
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    out = run.stdout
    last = out.strip().splitlines()[-1]
    summary = re.fullmatch(SUMMARY, last)
    assert summary, last
    low, high, tokens_per_s = map(float, summary.groups())
    assert 0.98 <= low <= high <= 1.02 and tokens_per_s > 0
    assert (
        f"bench e2e: {RANKS} gloo ranks (TP={RANKS}, sequence parallel), GPT 2 layers h=64 heads=4 (2 KV groups)" in out
    )
    assert "SwiGLU RMSNorm RoPE (base 500000), untied embeddings" in out  # configs/llama3-8b.yaml's layer
    for arm in (*PAIRINGS, "megatron", "adaptive"):
        assert re.search(rf"^{re.escape(arm)}\s+\d/4\s", out, re.M), arm
    for arm in (*PAIRINGS, "adaptive"):
        for rank in range(RANKS):
            assert re.search(rf"^{re.escape(arm)}\s+{rank}\s+\d+\.\d\s+\d+\.\d\s+\d\.\d{{3}}\s", out, re.M), (arm, rank)

    (result,) = results.glob("node-check_cpu-*core_*_*.md")
    text = result.read_text()
    assert text.startswith("# node check: cpu-")
    assert re.search(
        r"^`bash scripts/node_check.sh --cpu --profile \S+ --results-dir \S+` at \w+, .* exit 0$", text, re.M
    )
    assert re.search(rf"^torch {re.escape(torch.__version__)}, CUDA .*, NCCL none$", text, re.M)
    assert last in text and "[node_check] --cpu: no GPU tests" in text


def test_a_failed_part_exits_non_zero_and_still_writes_the_result(tmp_path):
    """Every Python step fails (PYTHON=false): the training run, so no summary; the exit says so."""
    profile = tmp_path / "profile.json"
    profile.write_text("{}")
    run = _node_check("--cpu", "--profile", str(profile), "--results-dir", str(tmp_path), env={"PYTHON": "false"})
    assert run.returncode == 1, run.stdout + run.stderr
    last = run.stdout.strip().splitlines()[-1]
    assert last == "node_check: tests=0 calibration=0 training=1 (no summary: the training run failed)"
    (result,) = tmp_path.glob("node-check_*.md")
    assert ", exit 1\n" in result.read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--bogus"],
            "unknown argument '--bogus' (usage: bash scripts/node_check.sh [--cpu] [--gpus N] [--wheels DIR] "
            "[--profile FILE] [--results-dir DIR])",
        ),
        (
            ["--cpu", "--gpus"],
            "--gpus takes a value (usage: bash scripts/node_check.sh [--cpu] [--gpus N] "
            "[--wheels DIR] [--profile FILE] [--results-dir DIR])",
        ),
        (["--cpu", "--gpus", "0"], "--gpus takes a number of ranks, got '0'"),
        (["--cpu", "--wheels", "w"], "--wheels installs for CUDA; the --cpu form uses what is installed"),
        (["--cpu", "--profile", "/no/such.json"], "--profile /no/such.json: no such file"),
        (["--cpu", "--results-dir", "/proc/node-check"], "--results-dir /proc/node-check: not a writable folder"),
    ],
)
def test_bad_arguments_exit_2_in_one_line(args, message):
    run = _node_check(*args)
    assert (run.returncode, run.stderr, run.stdout) == (2, f"node_check.sh: error: {message}\n", "")


@pytest.mark.skipif(torch.cuda.device_count() >= 8, reason="this machine has the GPUs")
def test_without_the_gpus_it_stops_rather_than_run_on_the_cpu(tmp_path):
    run = _node_check("--results-dir", str(tmp_path))
    message = f"--gpus 8, and torch sees {torch.cuda.device_count()} CUDA device(s) (--cpu: the reduced form)"
    assert (run.returncode, run.stderr) == (2, f"node_check.sh: error: {message}\n")
    assert not list(tmp_path.iterdir())
