"""An out-of-memory error that slips past the planner costs a step, never the run (megatron_paradyse.run.fault).

Four gloo ranks (TP=2 x DP=2) run the entry point, ``pretrain_gpt.main``, started by
:mod:`helpers.job_ranks`: like torchrun it gives each rank its environment, unlike torchrun it never ends
a rank when another exits (that is the behaviour under test). It raises ``torch.OutOfMemoryError`` once
on rank 1 at iteration 3: in an attention forward, or in an MLP backward. Every rank must exit within
seconds with the fault's exit code and one line each, the shrunk budget saved; the relaunch of the same
command with ``--load`` re-runs iteration 3 under another plan and finishes the run with the losses and
weights of a run that never failed.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from megatron_paradyse.config import ConfigError, MemorySection, load_config
from megatron_paradyse.data.corpora import build_code_corpus
from megatron_paradyse.mcore import compat
from megatron_paradyse.run.fault import (
    FAULT_EXIT_CODE,
    STATE_FILE,
    STOP_EXIT_CODE,
    BudgetState,
    read_state,
    write_state,
)
from megatron_paradyse.run.log import read_jsonl

from helpers import injections
from helpers.injections import Injection
from helpers.job_ranks import Job, launch
from helpers.paths import ROOT

MIB, GIB = 2**20, 2**30

MODEL = [
    "--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "256", "--position-embedding-type", "rope", "--attention-dropout", "0",
    "--hidden-dropout", "0", "--global-batch-size", "2", "--lr", "1e-3", "--log-interval", "1",
    "--train-iters", "6", "--save-interval", "1", "--ckpt-format", "torch",
]  # fmt: skip
# Twelve files of 533 to 1000 tokens, two per iteration, all in one length bucket: every plan's predicted
# peak is 3.5 to 8.1 MiB. The budget of 9 MiB fits them all, so the clean run runs the fastest plan, which
# has no recomputed layer (each has a faster twin without). Shrunk by 0.55, to 4.05 MiB, the budget fits
# only plans that recompute (the leanest without peaks at 4.33 MiB): from iteration 3 on the relaunch
# runs another plan, whatever the calibration says is fastest.
DOCS = {"num_documents": 12, "min_len": 520, "max_len": 1000}
BUDGET_BYTES, SHRINK = 9 * MIB, 0.55
FAULT_RANK, FAULT_ITERATION = 1, 3


@dataclass
class Run:
    """One training run: the launch that ran out of memory (None for the clean run) and the last launch."""

    save: Path
    log: list
    fault: Job | None
    fault_time: float | None
    last: Job


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The corpus and the quick cost profile (calibrated by the first run), shared by every run here."""
    path = tmp_path_factory.mktemp("cache")
    build_code_corpus(path)
    return path


def _config(folder: Path, cache: Path, **memory) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "memory": {"budget_gib": BUDGET_BYTES / GIB, "oom_shrink": SHRINK, **memory},
        "data": {"dataset": "code", "cache_dir": str(cache), **DOCS},
        "log": {"jsonl": "log.jsonl"},
    }
    path = folder / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _launch(folder: Path, config: Path, *flags: str, inject: Injection | None = None) -> Job:
    out = folder / f"launch{len(list(folder.glob('launch*')))}"
    program = ["-m", "megatron_paradyse.pretrain_gpt", "--paradyse-config", str(config), *MODEL]
    # Megatron's start-up warms its fused kernels up with torch.compile, ~13 s a rank on this CPU; every run
    # here runs them eager instead, alike, so that the runs compare
    return launch(
        4, [*program, "--save", str(folder / "ckpt"), *flags], out, env={"TORCH_COMPILE_DISABLE": "1"}, before=inject
    )


def _train(folder: Path, config: Path, site: str | None) -> Run:
    """Train to the end: one launch, or (``site``) one that runs out of memory and its relaunch."""
    if site is None:
        last = _launch(folder, config)
        return Run(folder / "ckpt", read_jsonl(folder / "log.jsonl"), None, None, last)
    marker = folder / "fault-time"
    inject = Injection(site, FAULT_RANK, FAULT_ITERATION, marker)
    fault = _launch(folder, config, inject=inject)
    shutil.copytree(folder / "ckpt", folder / "ckpt-after-fault")  # for the retries test
    last = _launch(folder, config, "--load", str(folder / "ckpt"), inject=inject)
    return Run(folder / "ckpt", read_jsonl(folder / "log.jsonl"), fault, float(marker.read_text()), last)


@pytest.fixture(scope="module")
def clean(tmp_path_factory, cache) -> Run:
    folder = tmp_path_factory.mktemp("clean")
    return _train(folder, _config(folder, cache), None)


@pytest.fixture(scope="module")
def attention_fault(tmp_path_factory, cache) -> Run:
    folder = tmp_path_factory.mktemp("attention")
    return _train(folder, _config(folder, cache), "attention-forward")


@pytest.fixture(scope="module")
def mlp_fault(tmp_path_factory, cache) -> Run:
    folder = tmp_path_factory.mktemp("mlp")
    return _train(folder, _config(folder, cache), "mlp-backward")


def _paradyse_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("paradyse:")]


def _check_survived(run: Run, clean: Run, site: str) -> None:
    fault = run.fault
    shrunk = BUDGET_BYTES * (1 - SHRINK)
    gib = f"{BUDGET_BYTES / GIB:.4g} to {shrunk / GIB:.4g} GiB"

    # every rank exits at once, with the fault's exit code, no rank waiting for a collective's timeout
    assert fault.codes == [FAULT_EXIT_CODE] * 4, fault.output()
    delays = [t - run.fault_time for t in (r.at for r in fault.ranks)]
    print(f"{site}: seconds from the fault to each rank's exit: {', '.join(f'{d:.3f}' for d in delays)}")
    assert max(delays) < 5.0, delays
    # one line each, and nothing else from the fault: no traceback, no store or collective noise
    where = f"injected by the test: out of memory in the {site} (rank 1, iteration 3)"
    assert _paradyse_lines(fault.ranks[FAULT_RANK].err) == [
        f"paradyse: rank 1 ran out of memory at iteration 3: {where} (raised at injections.py:{_line(site)}); every "
        f"rank stops and the memory budget shrinks from {gib} (saved in {run.save / STATE_FILE}): relaunch with "
        f"--load {run.save} to re-plan and re-run iteration 3 from the last checkpoint (torchrun --max-restarts "
        f"does it)"
    ]
    for rank in (0, 2, 3):
        assert _paradyse_lines(fault.ranks[rank].err) == [
            f"paradyse: rank {rank} stops: rank 1 ran out of memory at iteration 3 (the memory budget shrinks from "
            f"{gib}; rank 1 says more)"
        ]
    for err in (r.err for r in fault.ranks):
        assert not re.search(r"Traceback|TCPStore|Connection|Gloo", err), err[-3000:]
    state = read_state(str(run.save))
    assert state.budget_bytes == shrunk
    [event] = state.out_of_memory
    assert (event.iteration, event.rank, event.stopped, event.budget_before_bytes) == (3, 1, False, BUDGET_BYTES)
    assert event.where.startswith(where)

    # the relaunch plans under the shrunk budget, re-runs iteration 3 and finishes
    last = run.last
    assert last.codes == [0] * 4, last.output()
    assert (
        f"paradyse: memory budget {shrunk / GIB:.4g} GiB (shrunk after out-of-memory at iteration 3, from "
        f"{run.save / STATE_FILE})"
    ) in _paradyse_lines(last.ranks[3].out)
    for err in (r.err for r in last.ranks):
        assert not re.search(r"Traceback|TCPStore|Connection", err), err[-3000:]
    assert [r.iteration for r in run.log] == [1, 2, 3, 4, 5, 6]  # nothing lost, nothing counted twice
    plans = [[mb.plan for mb in r.micro_batches] for r in run.log]
    clean_plans = [[mb.plan for mb in r.micro_batches] for r in clean.log]
    assert plans[:2] == clean_plans[:2]
    assert not any("+rc" in plan for p in clean_plans for plan in p), clean_plans
    assert all("+rc" in plan for p in plans[2:] for plan in p), plans  # another plan from iteration 3 on
    assert all(mb.predicted_peak_bytes <= shrunk for r in run.log[2:] for mb in r.micro_batches)

    # what it computed is what the run without the error computed, within fp32 round-off
    losses, clean_losses = [r.loss for r in run.log], [r.loss for r in clean.log]
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses, clean_losses)), (losses, clean_losses)
    for tp_rank in (0, 1):
        _check_same_tensors(run.save, clean.save, f"iter_0000006/mp_rank_{tp_rank:02d}/model_optim_rng.pt")


def _line(site: str) -> str:
    """Where the injection raises (the message names it, as the innermost frame)."""
    source = Path(injections.__file__).read_text().splitlines()
    fn = "attention" if site == "attention-forward" else "backward"
    start = next(i for i, line in enumerate(source) if re.match(rf"\s+def {fn}\(", line))
    raise_at = next(i for i in range(start, len(source)) if "raise out_of_memory()" in source[i])
    return f"{raise_at + 1} in {fn}"


def _check_same_tensors(save: Path, reference: Path, name: str) -> None:
    """Every weight and optimizer state of a final checkpoint equals the reference's within 1e-5 relative
    (the norm of the difference to the norm of the tensor): fp32 round-off of reductions in another order,
    through six Adam steps. Per element is too strict: the gradient of the key bias is zero but for
    round-off (softmax ignores a shift of every score), and Adam scales that round-off up to a step."""

    compat.install()  # the checkpoint holds Megatron's objects: unpickling it imports megatron.core

    def tensors(path: Path) -> dict[str, torch.Tensor]:
        checkpoint = torch.load(path, weights_only=False)
        flat = {}

        def walk(value, key):
            if isinstance(value, torch.Tensor):
                flat[key] = value
            elif isinstance(value, dict):
                for k, v in value.items():
                    walk(v, f"{key}/{k}")

        walk({"model": checkpoint["model"], "optimizer": checkpoint["optimizer"]["state"]}, "")
        return flat

    got, expected = tensors(save / name), tensors(reference / name)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        difference = (got[key] - value).norm().item() / max(value.norm().item(), 1e-30)
        assert difference <= 1e-5, f"{name} {key}: relative difference {difference:.3g}"


def test_an_out_of_memory_error_in_an_attention_forward_costs_one_step(attention_fault, clean):
    _check_survived(attention_fault, clean, "attention-forward")


def test_an_out_of_memory_error_in_an_mlp_backward_costs_one_step(mlp_fault, clean):
    _check_survived(mlp_fault, clean, "mlp-backward")


def test_an_iteration_that_keeps_running_out_of_memory_stops_the_run(attention_fault, cache, tmp_path):
    """From the attention run's first failure, with memory.oom_retries = 1: iteration 3 fails again, every
    rank stops with exit code 2 and a message; a relaunch is refused at start-up."""
    save = tmp_path / "ckpt"
    shutil.copytree(attention_fault.save.parent / "ckpt-after-fault", save)
    config = _config(tmp_path, cache, oom_retries=1)
    inject = Injection("attention-forward", FAULT_RANK, FAULT_ITERATION)
    again = _launch(tmp_path, config, "--load", str(save), inject=inject)
    assert again.codes == [STOP_EXIT_CODE] * 4, again.output()
    shrunk = BUDGET_BYTES * (1 - SHRINK)
    budgets = f"{BUDGET_BYTES / GIB:.4g}, {shrunk / GIB:.4g} GiB"
    [message] = _paradyse_lines(again.ranks[FAULT_RANK].err)
    assert message.startswith("paradyse: error: rank 1 ran out of memory at iteration 3: injected by the test")
    assert message.endswith(
        f"; this is failure 2 of iteration 3, under budgets {budgets}, and memory.oom_retries is 1: every rank "
        "stops. To go on, raise memory.oom_retries (each retry shrinks the budget by memory.oom_shrink) and "
        "relaunch with --load; or shorten the sequences or lower memory.budget_gib, and delete paradyse_state.json"
    )
    for rank in (0, 2, 3):
        assert _paradyse_lines(again.ranks[rank].err) == [
            f"paradyse: error: rank {rank} stops: rank 1 ran out of memory at iteration 3 2 times, more than "
            "memory.oom_retries = 1 allows (rank 1 says more)"
        ]
    state = read_state(str(save))
    assert state.budget_bytes == shrunk  # not shrunk again
    assert [(e.iteration, e.stopped) for e in state.out_of_memory] == [(3, False), (3, True)]

    # relaunched as torchrun --max-restarts would: refused at start-up, every rank, one message
    relaunch = _launch(tmp_path, config, "--load", str(save))
    assert relaunch.codes == [STOP_EXIT_CODE] * 4, relaunch.output()
    assert _paradyse_lines(relaunch.ranks[0].err) == [
        f"paradyse: error: iteration 3 ran out of memory 2 times, under budgets {budgets} ({save / STATE_FILE}), "
        "more than memory.oom_retries = 1 allows. To go on, raise memory.oom_retries (each retry shrinks the "
        "budget by memory.oom_shrink) and relaunch with --load; or shorten the sequences or lower "
        "memory.budget_gib, and delete paradyse_state.json"
    ]
    for rank in (1, 2, 3):
        assert _paradyse_lines(relaunch.ranks[rank].err) == []
    assert not any("initializing torch distributed" in out for out in (r.out for r in relaunch.ranks))


# -- the state and the config, without ranks ------------------------------------------------------
def test_each_failure_of_an_iteration_shrinks_the_budget_until_the_retries_are_spent(tmp_path):
    memory = MemorySection(oom_shrink=0.5, oom_retries=2)
    state = BudgetState(budget_bytes=8 * GIB)
    for where in "abc":  # each run plans with the budget the previous one saved
        state = state.after_out_of_memory(
            iteration=5, rank=0, where=where, budget_bytes=state.budget_bytes, memory=memory
        )
    assert [(e.budget_before_bytes / GIB, e.budget_after_bytes / GIB, e.stopped) for e in state.out_of_memory] == [
        (8, 4, False),
        (4, 2, False),
        (2, 2, True),
    ]
    assert state.budget_bytes == 2 * GIB
    other = state.after_out_of_memory(iteration=6, rank=3, where="d", budget_bytes=2 * GIB, memory=memory)
    assert other.budget_bytes == 1 * GIB  # another iteration has retries of its own

    assert read_state(str(tmp_path)) is None
    path = write_state(str(tmp_path / "ckpt"), state)
    assert read_state(str(tmp_path / "ckpt")) == state
    with pytest.raises(ValueError, match=r"^iteration 5 ran out of memory 3 times, under budgets 8, 4, 2 GiB \("):
        state.check_retries(2, path)
    state.check_retries(3, path)

    path.write_text('{"budget_bytes": 1}')
    with pytest.raises(ValueError, match=f"{re.escape(str(path))} is not a megatron-paradyse state file .*"):
        read_state(str(tmp_path / "ckpt"))


def test_the_memory_section_checks_the_out_of_memory_settings(tmp_path):
    path = tmp_path / "cfg.yaml"
    for memory, error in (
        ({"oom_shrink": 0}, "memory.oom_shrink must be in (0, 1), got 0.0"),
        ({"oom_shrink": 1.0}, "memory.oom_shrink must be in (0, 1), got 1.0"),
        ({"oom_retries": -1}, "memory.oom_retries must be >= 0, got -1"),
        ({"oom_retries": 1.5}, "memory.oom_retries: must be int, got 1.5"),
    ):
        path.write_text(yaml.safe_dump({"memory": memory}))
        with pytest.raises(ConfigError) as e:
            load_config(path)
        assert str(e.value) == f"{path}:\n  {error}"
    path.write_text("memory: {}\n")
    assert (load_config(path).memory.oom_shrink, load_config(path).memory.oom_retries) == (0.1, 3)


def test_the_torchrun_job_restarts_through_the_c10d_rendezvous_with_a_store_per_attempt(tmp_path):
    """scripts/slurm/env.sh with MAX_RESTARTS: the static rendezvous and torchrun's shared store keep the
    first attempt's keys, and a restart fails to connect (docs/configs.md, "Out of memory")."""
    shared = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    (tmp_path / "torchrun").write_text(f'#!/bin/bash\necho "{shared}=${shared}"\nprintf "%s\\n" "$@"\n')
    (tmp_path / "torchrun").chmod(0o755)
    job = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_ID": "42", "GPUS_PER_NODE": "8"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "MAX_", "TORCH_DISABLE"))}
    env.update(job, PATH=f"{tmp_path}:{env['PATH']}", MASTER_ADDR="node7", MASTER_PORT="24242")
    script = f"source {ROOT / 'scripts/slurm/env.sh'} && paradyse_torchrun_node -m megatron_paradyse.pretrain_gpt"
    run = subprocess.run(["bash", "-c", script], env={**env, "MAX_RESTARTS": "3"}, capture_output=True, text=True)
    assert run.stdout.splitlines() == [
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        *("--nnodes", "2", "--nproc_per_node", "8", "--max-restarts", "3"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", "node7:24242", "--rdzv-id", "paradyse-42"),
        *("-m", "megatron_paradyse.pretrain_gpt"),
    ], run.stderr
    static = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    assert static.stdout.splitlines()[1:] == [
        *("--nnodes", "2", "--node_rank", "1", "--nproc_per_node", "8"),
        *("--master_addr", "node7", "--master_port", "24242", "-m", "megatron_paradyse.pretrain_gpt"),
    ], static.stderr
