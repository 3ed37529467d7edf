"""The training entry point: Megatron's own pretrain() on gloo ranks with the Paradyse layers, planned
dynamic-sequence micro-batches and the per-iteration log; clear errors before any process group; the
CPU demo.

The resuming run goes through ``torchrun``, as a user launches it (its report of a failed rank included); the
others start their ranks as ``srun`` would (:mod:`helpers.job_ranks`). The first run calibrates a quick cost
profile at start-up into the shared cache, later runs reuse it.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from megatron_paradyse import pretrain_gpt
from megatron_paradyse.cli import main as paradyse
from megatron_paradyse.cost.profile import save_profile
from megatron_paradyse.data import DocumentDataset
from megatron_paradyse.data.corpora import build_code_corpus
from megatron_paradyse.data.subset import spread_by_length
from megatron_paradyse.run import demo
from megatron_paradyse.run.log import read_jsonl

from helpers import entry_point
from helpers.cost_profiles import synthetic_profile
from helpers.job_ranks import Job, launch
from helpers.paths import ROOT
from helpers.torchrun import torchrun

# A 2-layer GPT on TP=2, one file per iteration. Budget 32 MiB per rank: the files of up to ~3.6K tokens
# fit (the leanest plan peaks at ~21 MiB at 3.6K), the one of ~11K does not (~56 MiB).
SMALL_GPT = [
    *entry_point.SMALL_GPT,
    "--tensor-model-parallel-size",
    "2",
    "--global-batch-size",
    "1",
    "--log-interval",
    "1",
]
SMALL_DOCS = dict(num_documents=6, min_len=128, max_len=32768)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """Corpus and calibrated profiles, shared by the runs of this module."""
    path = tmp_path_factory.mktemp("cache")
    build_code_corpus(path)
    return path


def _write_config(path: Path, cache: Path, **sections) -> Path:
    data = {"memory": {"budget_gib": 1.0}, "data": {"dataset": "code", "cache_dir": str(cache)}}
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values} if isinstance(values, dict) else values
    path.write_text(yaml.safe_dump(data))
    return path


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    return torchrun(nproc, "-m", "megatron_paradyse.pretrain_gpt", *args, timeout=300)


def _job(nproc: int, folder: Path, *args: str) -> Job:
    return launch(nproc, ["-m", "megatron_paradyse.pretrain_gpt", *args], folder)


# -- errors before any process group ------------------------------------------------------------
def test_a_config_error_is_a_message_and_exit_code_2(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("planner:\n  pairs: [tp_sp/tp_sp, ringg/zero3]\nmemory:\n  budget_gb: 1\n")
    assert pretrain_gpt.main(["--paradyse-config", str(path), "--num-layers", "2"]) == 2
    assert capsys.readouterr().err == (
        f"paradyse: error: {path}:\n"
        "  planner.pairs: unknown attention strategy 'ringg'; known: tp_sp, ulysses, ring, lean\n"
        "  memory.budget_gb: unknown key; did you mean 'budget_gib'?\n"
    )

    assert pretrain_gpt.main(["--num-layers", "2"]) == 2
    assert capsys.readouterr().err == "paradyse: error: --paradyse-config FILE is required (see docs/configs.md)\n"
    assert pretrain_gpt.main(["--num-layers", "2", "--paradyse-config"]) == 2
    assert capsys.readouterr().err == "paradyse: error: argument --paradyse-config: expected one argument\n"


def _refusal(capsys, config: Path, *flags: str) -> str:
    """What ``pretrain_gpt.main`` prints to stderr as one process, not launched (no process group is
    made when it refuses); it must refuse with exit code 2."""
    assert pretrain_gpt.main(["--paradyse-config", str(config), *flags]) == 2
    captured = capsys.readouterr()
    assert not torch.distributed.is_initialized() and "initializing torch distributed" not in captured.out
    return captured.err


def test_megatron_arguments_that_cannot_work_are_refused_before_any_process_group(tmp_path, cache, capsys):
    config = _write_config(tmp_path / "cfg.yaml", cache, data={"max_len": 512})
    one_rank = [*SMALL_GPT, "--tensor-model-parallel-size", "1", "--train-iters", "2"]
    stderr = _refusal(
        capsys, config, *one_rank, "--micro-batch-size", "2", "--global-batch-size", "2", "--seq-length", "256"
    )
    assert stderr.endswith(
        "paradyse: error: the Megatron arguments do not fit this entry point:\n"
        "  - --micro-batch-size: a micro-batch is one row (one document or a packing); got 2, leave it out or set 1\n"
        "  - --seq-length 256 is shorter than the longest micro-batch, 512 tokens (data.token_budget or "
        "data.max_len); leave it out\n"
    )

    stderr = _refusal(capsys, config, *one_rank, "--eval-interval", "2")  # never silently without validation
    assert stderr.endswith(
        "paradyse: error: the Megatron arguments do not fit this entry point:\n"
        "  - --eval-interval 2 without --eval-iters: no validation would run; add --eval-iters N (validation "
        "steps per evaluation, N > 0), or leave --eval-interval out\n"
    )

    # their memory is not counted
    stderr = _refusal(capsys, config, *one_rank, "--optimizer", "lion", "--qk-l2-norm", "--cross-entropy-loss-fusion")
    assert stderr.endswith(
        "paradyse: error: the Megatron arguments do not fit this entry point:\n"
        "  - --qk-l2-norm: the planner counts the memory of q/k norms of --normalization's kind (--qk-layernorm), "
        "not Megatron's L2 norm; got True, leave it out or set False\n"
        "  - --optimizer lion: the planner counts the memory of adam and sgd only; use one of them\n"
        "  - --cross-entropy-loss-fusion: the planner counts the memory of Megatron's unfused vocab-parallel "
        "cross-entropy; leave it out\n"
    )

    # 1 MiB per rank: less than the weights, gradients and Adam state (16 B per parameter, fp32) and the
    # step's working set (torch's for-loop AdamW on CPU: three fp32 copies of the largest parameter)
    small = _write_config(tmp_path / "small.yaml", cache, data={"max_len": 512}, memory={"budget_gib": 1 / 1024})
    stderr = _refusal(capsys, small, *one_rank)
    refused = re.search(
        r"paradyse: error: the memory budget \(1024.00 KiB per rank\) cannot hold what every plan holds:\n"
        r"  - pipeline stage 0: ([\d.]+) KiB of weights, gradients and optimizer state, and ([\d.]+) KiB more "
        r"while the optimizer steps\n"
        r"what would fit: more tensor- or pipeline-parallel ranks, the distributed optimizer over data-parallel ranks "
        r"\(--use-distributed-optimizer\), Transformer Engine or apex installed \(a fused optimizer step needs no "
        r"working set\), or a larger memory.budget_gib\n$",
        stderr,
    )
    assert refused, stderr[-3000:]
    step = float(refused.group(2)) * 2**10
    assert step == pytest.approx(3 * 4 * 384 * 64, rel=5e-3)  # the embedding: 258 tokens padded to 384 rows, fp32

    stderr = _refusal(capsys, config, *one_rank, "--save", str(tmp_path / "ckpt"))  # Megatron's own check
    assert stderr.endswith(
        "paradyse: error: Megatron's argument check failed: assert args.save_interval is not None (arguments.py:1322)\n"
    )


def test_a_flag_megatrons_parser_refuses_is_one_line_not_its_usage(tmp_path, capsys):
    """Megatron's parser would print its usage (700 lines) before its reason, on every rank."""
    config = _write_config(tmp_path / "cfg.yaml", tmp_path, megatron_args=["--hiden-size", "64"])
    assert _refusal(capsys, config, "--num-layer", "2", "--lr", "1e-3") == (
        "paradyse: error: --hiden-size (in the config's megatron_args): not a Megatron flag; did you mean "
        "--hidden-size?; --num-layer: not a Megatron flag; did you mean --num-layers?\n"
    )
    config = _write_config(tmp_path / "cfg.yaml", tmp_path)
    assert _refusal(capsys, config, "--lr", "abc") == "paradyse: error: argument --lr: invalid float value: 'abc'\n"


# -- training on gloo ranks ---------------------------------------------------------------------
def test_training_resumes_the_data_where_the_checkpoint_left_it_and_stops_on_a_sequence_no_plan_fits(tmp_path, cache):
    sections = dict(memory={"budget_gib": 1 / 64}, data=SMALL_DOCS, planner={"on_infeasible": "stop"})
    learning = dict(sections, planner={**sections["planner"], "learn_time": True})
    config = _write_config(tmp_path / "cfg.yaml", cache, **learning, log={"jsonl": "log.jsonl", "measure": True})
    lengths = DocumentDataset(build_code_corpus(cache)).lengths
    files = sorted(lengths[spread_by_length(lengths, *SMALL_DOCS.values())])
    checkpoints = ["--save", str(tmp_path / "ckpt"), "--save-interval", "1", "--train-iters", "6"]

    first = _torchrun(2, "--paradyse-config", str(config), *SMALL_GPT, *checkpoints, "--exit-interval", "2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "paradyse: no cost.profile: calibrating a quick profile for p=2" in first.stdout
    # on CPU the memory meter slows the layers it watches: the profile's correction takes its cost in
    (profile,) = cache.glob("cost-profile-*.json")
    assert profile.name.endswith("-metered.json")
    records = read_jsonl(tmp_path / "log.jsonl")
    assert [r.iteration for r in records] == [1, 2]
    assert [mb.tokens for r in records for mb in r.micro_batches] == list(files[:2])
    assert all(math.isfinite(r.loss) for r in records) and records[1].loss < records[0].loss
    assert all(re.fullmatch(r"2x \S+/\S+", mb.plan) for r in records for mb in r.micro_batches)
    assert all(mb.measured_time_s > 0 and mb.measured_peak_bytes > 0 for r in records for mb in r.micro_batches)
    assert "the planner's static memory counts" not in first.stdout + first.stderr
    # The checkpoint keeps how the next micro-batch will be planned: what the time model learned from the
    # measured micro-batches (on both ranks), and the planner's previous plan. The process's first
    # micro-batch is its warm-up (its time holds the start's one-time costs): logged, not learned from.
    assert [mb.one_off for r in records for mb in r.micro_batches] == ["warm-up", None]

    def saved_state(iteration: int) -> dict:
        (saved,) = (tmp_path / "ckpt" / f"iter_{iteration:07d}").rglob("train_dataloader_dprank000.pt")
        return torch.load(saved, weights_only=False)["dataloader_state_dict"]

    assert saved_state(1)["time_corrections"]["log_factors"] == []
    state = saved_state(2)
    learned = {option for option, _, _ in state["time_corrections"]["log_factors"]}
    assert learned == {records[1].micro_batches[0].plan.removeprefix("2x ")}
    assert sum(state["planners"][0]["previous"]) == 2

    # resumed as a GPU run would be: learning without the memory meter (no synchronisation inside a step),
    # on the first run's profile (a quick one without the meter's cost would be calibrated anew: a minute)
    time_only = _write_config(
        tmp_path / "time_only.yaml", cache, **learning, log={"jsonl": "log.jsonl"}, cost={"profile": str(profile)}
    )
    second = _torchrun(2, "--paradyse-config", str(time_only), *SMALL_GPT, *checkpoints, "--load", checkpoints[1])
    assert second.returncode != 0
    assert "calibrating" not in second.stdout
    records = read_jsonl(tmp_path / "log.jsonl")
    assert [r.iteration for r in records] == [1, 2, 3, 4]
    assert [mb.tokens for r in records[2:] for mb in r.micro_batches] == list(files[2:4])
    # without log.measure, learning times each micro-batch and measures no peak; a new process warms up
    assert [mb.one_off for r in records[2:] for mb in r.micro_batches] == ["warm-up", None]
    assert all(mb.measured_time_s > 0 and mb.measured_peak_bytes is None for r in records[2:] for mb in r.micro_batches)
    message = re.search(
        rf"paradyse: error: a sequence of {files[4]} tokens \(padded to \d+, planned at \d+\) with micro-batch "
        r"size 1 fits no plan: the leanest \(2x [^)]+\) is predicted to peak at [\d.]+ MiB, over the budget of "
        r"1[56]\.\d\d MiB; the longest that fits is (\d+) tokens with this micro-batch size\. Shorten or split",
        second.stderr,
    )
    assert message, second.stderr[-3000:]
    assert files[3] <= int(message.group(1)) < files[4]
    # Every rank knows it alike (each checks the global batch on every stage): rank 0 alone says it, the
    # ranks stop with exit code 2, not a traceback (the one traceback is torchrun's own report).
    assert second.stderr.count("paradyse: error:") == 1, second.stderr[-3000:]
    root_cause = second.stderr[second.stderr.index("Root Cause (first observed failure)") :]
    assert re.search(r"exitcode\s*: 2\b", root_cause), root_cause
    assert "InfeasibleSequenceError" not in second.stderr


def test_the_training_job_trains_past_device_memory_with_offload_and_mlp_tiles(tmp_path, cache, capsys):
    """The files of the test above on 6 layers, under a 32 MiB budget that the one of ~11K tokens fits only
    with the planner free to keep layer inputs in host memory and to run MLPs in tiles: Megatron's training
    loop runs it under a plan that uses them, within its predicted device peak."""
    deeper = dict(memory={"budget_gib": 1 / 32}, data=SMALL_DOCS, megatron_args=[*SMALL_GPT, "--num-layers", "6"])
    levers = {"on_infeasible": "skip", "host_memory_gib": 1.0, "mlp_tile_tokens": 512}
    log = {"jsonl": "log.jsonl", "measure": True}
    config = _write_config(tmp_path / "levers.yaml", cache, **deeper, planner=levers, log=log)
    lengths = DocumentDataset(build_code_corpus(cache)).lengths
    files = sorted(lengths[spread_by_length(lengths, *SMALL_DOCS.values())])
    result = _job(2, tmp_path / "ranks", "--paradyse-config", str(config), "--train-iters", "5")
    assert result.ok, result.output()
    trained = {mb.tokens: mb for r in read_jsonl(tmp_path / "log.jsonl") for mb in r.micro_batches}
    beyond = trained[files[4]]
    assert "+off" in beyond.plan or "+tile" in beyond.plan, beyond.plan
    assert 0 < beyond.measured_peak_bytes <= beyond.predicted_peak_bytes <= 2**30 / 32
    # the same job without them: no plan fits that file (`paradyse plan`, on the profile the run calibrated)
    plain = _write_config(tmp_path / "plain.yaml", cache, **deeper, planner={"on_infeasible": "skip"})
    profile = next(cache.glob("cost-profile-quick-corrected-cpu-p2-*.json"))
    answer = tmp_path / "plan.json"
    argv = ["plan", str(plain), "--profile", str(profile), "--lengths", str(files[4]), "--json", str(answer)]
    assert paradyse(argv) == 0
    capsys.readouterr()
    assert json.loads(answer.read_text())["lengths"][0]["stage0"]["plan"] is None


def test_validation_runs_forward_only_plans_on_held_out_documents(tmp_path, cache):
    """--eval-iters with --eval-interval and --split: Megatron validates during and after training on the
    held-out documents, under plans priced for forward-only passes, the same micro-batches every time."""
    config = _write_config(
        tmp_path / "cfg.yaml",
        cache,
        data={"num_documents": 10, "min_len": 128, "max_len": 2048},
        log={"measure": True},
    )
    evaluation = ["--eval-iters", "2", "--eval-interval", "2", "--split", "70,30,0"]
    flags = [*SMALL_GPT, "--train-iters", "4", *evaluation]
    result = _job(2, tmp_path / "ranks", "--paradyse-config", str(config), *flags)
    assert result.ok, result.output()
    out = result.ranks[1].out  # the last rank logs
    assert "paradyse: documents: 7 for training, 3 for validation, 0 for test (--split 70,30,0)" in out
    losses = re.findall(r"validation loss at iteration (\d+( on validation set)?) \| lm loss value: (\S+)", out)
    assert [where for where, _, _ in losses] == ["2", "4", "4 on validation set"]
    assert losses[1][2] == losses[2][2]  # the same weights on the same micro-batches: each evaluation restarts
    assert losses[0][2] != losses[1][2]
    evaluations = re.findall(
        r"^paradyse: evaluation at iteration [^:]+: 2 micro-batches of (\d+) tokens, plans: (.+); peak up to "
        r"([\d.]+) MiB predicted, measured ([\d.]+); 0 skipped$",
        out,
        re.MULTILINE,
    )
    # every evaluation: the same micro-batches, plans and prediction; the measured peak is a measurement (a
    # first evaluation was once seen 0.1 MiB above the next ones: something built once), under the prediction
    assert len(evaluations) == 3 and len({e[:3] for e in evaluations}) == 1, re.findall(".*evaluation at.*", out)
    tokens, plans, predicted, _ = evaluations[0]
    assert "+rc" not in plans  # nothing to recompute without a backward
    assert all(0 < float(measured) <= float(predicted) for *_, measured in evaluations), evaluations
    assert re.search(r"^paradyse: 4 micro-batches, ", out, re.MULTILINE)  # the table: training's only


def test_demo_default_config_is_the_repositorys():
    """``paradyse demo`` without ``--config`` reads ``configs/tiny-cpu.yaml`` (the package's move into
    folders once left it looking in ``megatron_paradyse/configs``, and the README's first command failed)."""
    assert demo.DEFAULT_CONFIG == (ROOT / "configs" / "tiny-cpu.yaml").resolve()
    assert demo.DEFAULT_CONFIG.is_file()


def test_demo_trains_switches_plans_and_skips_what_no_plan_fits(tmp_path, cache, capsys):
    """The demo's config on fewer, longer files: 8 iterations over 256 to 8192 tokens. On a synthetic CPU
    profile (plausible rates; what is checked is the run, not the rates): the quick profile the demo would
    calibrate at start-up (the first training test above checks that step) takes 4 ranks about 3 minutes of CPU."""
    data = yaml.safe_load((ROOT / "configs" / "tiny-cpu.yaml").read_text())
    data["data"].update(num_documents=16, max_len=8192)
    save_profile(synthetic_profile(p_values=(demo.RANKS,)), tmp_path / "profile.json")
    data["cost"] = {"profile": str(tmp_path / "profile.json")}
    variant = tmp_path / "tiny.yaml"
    variant.write_text(yaml.safe_dump(data))
    out = tmp_path / "demo"
    args = ["--config", str(variant), "--output-dir", str(out), "--cache-dir", str(cache), "--iterations", "8"]
    assert demo.main(args) == 0
    stdout = capsys.readouterr().out
    records = read_jsonl(out / "iterations.jsonl")
    assert [r.iteration for r in records] == list(range(1, 9))
    losses = np.array([r.loss for r in records])
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    plans = {mb.plan for r in records for mb in r.micro_batches}
    assert len(plans) >= 2, plans
    skipped = [s for r in records for s in r.skipped]
    assert skipped and all(s["tokens"] > 4096 and s["stage"] == 0 for s in skipped)
    assert all("fits no plan" in s["reason"] for s in skipped)
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"{len(plans)} different" in stdout and "paradyse demo: done in" in stdout
    # the demo's config learns the time model from its measured micro-batches: every plan's options, the
    # warm-up's aside (the process's first micro-batch, marked as such)
    micro_batches = [mb for r in records for mb in r.micro_batches]
    assert [mb.one_off for mb in micro_batches] == ["warm-up"] + [None] * (len(micro_batches) - 1)
    train_log = (out / "train.log").read_text()
    learned = re.search(r"paradyse: learned time factors \(option x\[bucket:factor\]\): (.*)", train_log)
    assert learned, train_log[-3000:]
    timed = micro_batches[1:]
    options = {option for mb in timed for option in re.findall(r"\dx ([\w/+]+)", mb.plan)}
    assert options == set(re.findall(r"([\w/+]+) x\[", learned.group(1))), (options, learned.group(1))
    assert re.search(r"^\s+1 +[\d.]+ \|  0 +\d+  4x .* \(warm-up\) ", stdout, re.MULTILINE)  # the table's first row
    # and the summary says how the predictions held
    within = sum(abs(mb.predicted_time_s / mb.measured_time_s - 1) <= 0.25 for mb in timed)
    assert f"  time: predicted within 25% of the measured for {within} of {len(timed)} micro-batches (" in stdout
    assert "micro-batches (median error " in stdout and "%); aside, with a one-time cost: 1 warm-up\n" in stdout
    under = sum(mb.measured_peak_bytes <= mb.predicted_peak_bytes for mb in micro_batches)
    assert (
        f"  peak memory: measured at or under the predicted for {under} of {len(micro_batches)} micro-batches" in stdout
    )


def test_every_schedule_the_entry_point_runs_leaves_its_chunks_no_input(monkeypatch):
    """Megatron's training and evaluation get their schedule from ``get_forward_backward_func``; under the
    entry point each run of it then drops the input every model chunk keeps of the step's last micro-batch,
    so that a step leaves nothing to the next (``tests/megatron/test_step_memory.py`` measures it), and the hook goes
    when ``pretrain`` returns."""
    from megatron_paradyse.mcore import training_hooks  # the CPU shim, then megatron.training

    training = training_hooks.training  # the module whose functions the hooks rebind
    calls = []

    def schedule(*, model, **kwargs):
        calls.append(("ran", len(model)))
        return "losses"

    class Chunk(torch.nn.Module):
        def set_input_tensor(self, tensor):
            calls.append(("input", tensor))

    monkeypatch.setattr(training, "get_forward_backward_func", lambda **kwargs: schedule)
    with training_hooks.each_schedule_leaving_nothing():
        run = training.get_forward_backward_func(schedule_pg_collection=None)
        assert run(forward_step_func=None, model=[Chunk(), Chunk()], num_microbatches=2) == "losses"
    assert calls == [("ran", 2), ("input", None), ("input", None)]
    assert training.get_forward_backward_func() is schedule
