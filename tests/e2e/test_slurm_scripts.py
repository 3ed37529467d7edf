"""scripts/slurm: the rank environment from SLURM's variables, and the job scripts run end to end with
stand-ins for srun, python and torchrun (no SLURM, no GPU)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from helpers.paths import ROOT

SLURM = ROOT / "scripts" / "slurm"
ENV_SH = SLURM / "env.sh"
CONFIG = ROOT / "configs" / "gpt-1.3b.yaml"

JOB = {  # rank 9 of 16, the second GPU of the second node
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu-a[007-008]",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "16",
    "SLURM_PROCID": "9",
    "SLURM_LOCALID": "1",
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_CPUS_PER_TASK": "8",
}
LAUNCH = (
    *("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"),
    *("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF"),
)
RANK_9_ENV = "RANK=9 WORLD_SIZE=16 LOCAL_RANK=1 MASTER_ADDR=gpu-a007 MASTER_PORT=24242"
JOB_CUDA_ENV = "CUDA_DEVICE_MAX_CONNECTIONS=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def _env(**extra: str) -> dict[str, str]:
    """This environment without any SLURM or launcher variable (the tests may run inside a job)."""
    names = ("SLURM_", "MEGATRON_", "PARADYSE_", "CONTAINER_", "CALIBRATE_", *LAUNCH, "GPUS_PER_NODE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(names)}
    return {**env, **extra}


def _bash(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, cwd=ROOT, timeout=120)


def _fake(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
    (bin_dir / name).chmod(0o755)


def test_every_script_is_valid_bash():
    scripts = sorted([*ROOT.glob("scripts/**/*.sh"), *ROOT.glob("scripts/**/*.sbatch")])
    assert {p.name for p in scripts} >= {"apply_patch.sh", "env.sh", "calibrate.sbatch", "train_srun.sbatch"}
    for script in scripts:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script}: {result.stderr}"


HOSTLISTS = {
    "node1": "node1",
    "node1,node2": "node1",
    "gpu-a[007-008,012],cpu1": "gpu-a007",
    "nid[001234-001240]": "nid001234",
    "rack[2-3]-gpu[01-04]": "rack2-gpu01",
    "x-1,x-2": "x-1",
    "dgx[10,2]": "dgx10",
}


def test_the_first_host_of_a_hostlist_without_scontrol():
    cases = " ".join(shlex.quote(h) for h in HOSTLISTS)
    result = _bash(f'source {ENV_SH}; for h in {cases}; do _paradyse_first_host_parse "$h"; done', _env())
    assert result.stdout.split() == list(HOSTLISTS.values()), result.stderr
    for bad in ("", "gpu[", ","):
        result = _bash(f"source {ENV_SH}; _paradyse_first_host_parse {shlex.quote(bad)}", _env())
        assert result.returncode == 1
        assert result.stderr == f"env.sh: cannot read a host name from the SLURM hostlist '{bad}'\n"


def _show_launch_env() -> str:
    return " ".join(f"{name}=${name}" for name in LAUNCH)


def test_srun_rank_environment():
    result = _bash(f"source {ENV_SH}; paradyse_srun_env; echo {_show_launch_env()}", _env(**JOB))
    assert result.stdout == f"{RANK_9_ENV} CUDA_DEVICE_MAX_CONNECTIONS= PYTORCH_CUDA_ALLOC_CONF=\n"
    given = _env(**JOB, MASTER_ADDR="10.0.0.1", MASTER_PORT="6000")  # the job's own choice is kept
    kept = _bash(f"source {ENV_SH}; paradyse_srun_env; echo $MASTER_ADDR:$MASTER_PORT", given)
    assert kept.stdout == "10.0.0.1:6000\n"
    outside = _bash(f"source {ENV_SH}; paradyse_srun_env", _env(**{**JOB, "SLURM_PROCID": ""}))
    assert outside.returncode == 1
    assert outside.stderr == "env.sh: SLURM_PROCID is not set (run inside a SLURM job, or export it)\n"


def _job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    flags = tmp_path / "flags.txt"
    flags.write_text("--train-iters 10   # a short run\n\n--lr\t1e-4\n")
    env = _env(**JOB, PARADYSE_ROOT=str(ROOT), PARADYSE_CONFIG=str(CONFIG.relative_to(ROOT)))
    env.update(MEGATRON_ARGS_FILE=str(flags), MEGATRON_ARGS="--log-interval 5 --save scripts/*", **extra)
    env["PATH"] = f"{tmp_path / 'bin'}:{env['PATH']}"
    _fake(tmp_path / "bin", "srun", 'while [[ $1 == -* ]]; do echo "srun $1"; shift; done\nexec "$@"')
    return env


TRAIN_ARGS = [
    *("-m", "megatron_paradyse.pretrain_gpt", "--train-iters", "10", "--lr", "1e-4"),
    *("--log-interval", "5", "--save", "scripts/*", "--paradyse-config", str(CONFIG)),
]


IMAGE = "nvcr.io/nvidia/pytorch:25.01-py3"


def test_train_srun_starts_each_rank_with_its_environment(tmp_path):
    env = _job_env(tmp_path, CONTAINER_IMAGE=IMAGE, CONTAINER_MOUNTS="/data:/data")
    _fake(tmp_path / "bin", "python", f'echo {_show_launch_env()}\nprintf "%s\\n" "$@"')
    result = _bash(f"bash {SLURM / 'train_srun.sbatch'}", env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        *("srun --kill-on-bad-exit=1", "srun --cpus-per-task=8", f"srun --container-image={IMAGE}"),
        *(f"srun --container-workdir={ROOT}", "srun --container-mounts=/data:/data"),
        f"{RANK_9_ENV} {JOB_CUDA_ENV}",
        *TRAIN_ARGS,
    ]
    own = _bash(f"bash {SLURM / 'train_srun.sbatch'}", {**env, "PYTORCH_CUDA_ALLOC_CONF": "backend:native"})
    assert f"{RANK_9_ENV} CUDA_DEVICE_MAX_CONNECTIONS=1 PYTORCH_CUDA_ALLOC_CONF=backend:native" in own.stdout
    torchs_name = _bash(f"bash {SLURM / 'train_srun.sbatch'}", {**env, "PYTORCH_ALLOC_CONF": "backend:native"})
    assert f"{RANK_9_ENV} CUDA_DEVICE_MAX_CONNECTIONS=1 PYTORCH_CUDA_ALLOC_CONF=\n" in torchs_name.stdout
    dry = _bash(f"bash {SLURM / 'train_srun.sbatch'}", {**env, "PARADYSE_DRY_RUN": "1"})
    assert shlex.split(dry.stdout)[:3] == ["srun", "--kill-on-bad-exit=1", "--cpus-per-task=8"]
    assert shlex.split(dry.stdout)[-len(TRAIN_ARGS) :] == TRAIN_ARGS


def test_train_torchrun_starts_one_torchrun_per_node(tmp_path):
    env = _job_env(tmp_path)
    _fake(tmp_path / "bin", "torchrun", 'printf "%s\\n" "$@"')
    result = _bash(f"bash {SLURM / 'train_torchrun.sbatch'}", env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        *("srun --kill-on-bad-exit=1", "srun --cpus-per-task=8", "srun --ntasks-per-node=1"),
        *("--nnodes", "2", "--node_rank", "1", "--nproc_per_node", "8"),
        *("--master_addr", "gpu-a007", "--master_port", "24242"),
        *TRAIN_ARGS,
    ]


def test_a_megatron_lm_checkout_must_be_patched(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("# stock\n")
    setup = f"source {ENV_SH}; paradyse_job_setup && printf '%s\\n' \"${{PARADYSE_CMD[@]}}\""
    env = _env(**JOB, PARADYSE_CONFIG=str(CONFIG), MEGATRON_LM_DIR=str(tmp_path))
    result = _bash(setup, env)
    assert (result.returncode, result.stderr) == (
        1,
        f"env.sh: {script} is missing or not patched; run scripts/apply_patch.sh {tmp_path}\n",
    )
    script.write_text('if "--paradyse-config" in sys.argv: ...\n')
    assert _bash(setup, env).stdout.splitlines() == [str(script), "--paradyse-config", str(CONFIG)]
    missing = _bash(setup, _env(**JOB, PARADYSE_CONFIG="nowhere.yaml"))
    assert missing.stderr == "env.sh: PARADYSE_CONFIG=nowhere.yaml is not a file\n"


@pytest.mark.timeout(120)
def test_calibrate_writes_the_profile_the_config_names(tmp_path):
    (tmp_path / "cfg.yaml").write_text(
        'cost: {profile: prof/p.json}\nmegatron_args: [--tensor-model-parallel-size, "4", --bf16, '
        '--hidden-size, "256", --num-attention-heads, "8"]\n'
    )
    stub = tmp_path / "stub"  # `paradyse calibrate` itself: a stand-in that shows its arguments
    stub.mkdir()
    (stub / "sitecustomize.py").write_text(
        "import sys, types\n"
        "cli = types.ModuleType('megatron_paradyse.cli')\n"
        "cli.main = lambda argv: print('paradyse', *argv) or 0\n"
        "sys.modules[cli.__name__] = cli\n"
    )
    env = _job_env(tmp_path, PARADYSE_CONFIG=str(tmp_path / "cfg.yaml"), CALIBRATE_ARGS="--fit-correction")
    env.update(MEGATRON_ARGS="--tensor-model-parallel-size 2", PYTHONPATH=f"{stub}:{ROOT}")
    result = _bash(f"bash {SLURM / 'calibrate.sbatch'}", env)
    assert result.returncode == 0, result.stderr
    measured = f"--fit-correction --output {tmp_path}/prof/p.json --p 2 --dtype bfloat16 --device cuda --grid full"
    command, flags = result.stdout.splitlines()[-1].split(" -- ")  # the job's model: its config, its flags last
    assert command == f"paradyse calibrate {measured} --config {tmp_path}/cfg.yaml"
    assert flags.endswith("--tensor-model-parallel-size 2")
    assert (tmp_path / "prof").is_dir()
