"""Megatron's own flags under the entry point: ``--help``, TP=1, ``--overlap-grad-reduce`` and
``--overlap-param-gather`` with the distributed optimizer (the same losses and weights as without them),
pipeline parallelism (PP=2 trains, and says what its budget leaves out), and the combinations refused
at start-up.

Multi-rank runs are gloo ranks started as ``srun`` starts them (:mod:`helpers.job_ranks`); the cost profile
is calibrated once for the whole run (``quick_profile_p2``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megatron_paradyse import pretrain_gpt
from megatron_paradyse.cost.correction import TimeCorrections
from megatron_paradyse.run.log import read_jsonl

from helpers import entry_point
from helpers.entry_point import small_job_config
from helpers.job_ranks import Job, launch

SMALL_GPT = [*entry_point.SMALL_GPT, "--log-interval", "1"]


def _job(nproc: int, folder: Path, *args: str) -> Job:
    return launch(nproc, ["-m", "megatron_paradyse.pretrain_gpt", *args], folder)


def _refused(config: Path, flags: list[str], error: str) -> None:
    """Two ranks started with ``flags`` stop before start-up, one of them saying ``error`` (a regular expression)."""
    result = _job(2, config.parent / "refused", "--paradyse-config", str(config), *flags)
    assert result.codes == [2, 2], result.output()
    assert re.search(f"paradyse: error: {error}", result.stderr), result.stderr[-3000:]
    assert result.stderr.count("paradyse: error:") == 1
    assert "initializing torch distributed" not in result.stdout


def test_help_lists_megatrons_flags_and_ours(tmp_path, capsys):
    for argv in (["--help"], ["--paradyse-config", str(tmp_path / "none.yaml"), "-h"]):
        assert pretrain_gpt.main(argv) == 0
        stdout = capsys.readouterr().out
        assert stdout.startswith("usage: pretrain_gpt ")
        assert "paradyse:\n  megatron-paradyse (see docs/configs.md)\n\n  --paradyse-config FILE" in stdout
        # Megatron's own, the one whose help text has a bare "%" among them
        assert "--tensor-model-parallel-size" in stdout
        assert "(e.g. 1.10 = 10%)" in " ".join(stdout.split())


def test_tp1_trains_choosing_recompute_only(tmp_path, cache_p2):
    # files of 519 to 2549 tokens: at TP=1 the longest fit the budget only recomputed
    data = {
        "dataset": "code",
        "cache_dir": str(cache_p2),
        "num_documents": 4,
        "min_len": 512,
        "max_len": 2560,
    }
    config = small_job_config(tmp_path / "cfg.yaml", cache_p2, data=data)
    flags = [*SMALL_GPT, "--tensor-model-parallel-size", "1", "--global-batch-size", "1", "--train-iters", "4"]
    result = _job(1, tmp_path / "ranks", "--paradyse-config", str(config), *flags)
    assert result.ok, result.output()
    assert "layer options: tp_sp/tp_sp, tp_sp/tp_sp+rc, tp_sp/tp_sp+rc+keepcore." in result.stdout
    records = read_jsonl(tmp_path / "log.jsonl")
    assert [r.iteration for r in records] == [1, 2, 3, 4]
    plans = {mb.plan for r in records for mb in r.micro_batches}
    runs = {plan: [run.split("x ", 1)[1] for run in plan.split(", ")] for plan in plans}
    assert {option for options in runs.values() for option in options} <= {
        "tp_sp/tp_sp",
        "tp_sp/tp_sp+rc",
        "tp_sp/tp_sp+rc+keepcore",
    }, plans
    # a mix runs its recomputed layer first (the larger working set beside the fewer saved bytes)
    assert all("+rc" in options[0] for options in runs.values() if len(options) > 1), plans
    assert any("+rc" in option for options in runs.values() for option in options), plans  # the longer files recompute


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Data-parallel rank 0's model state, both tensor-parallel ranks (legacy ``torch`` checkpoint format)."""
    files = sorted(checkpoint.glob("iter_*/mp_rank_*/model_optim_rng.pt"))
    assert len(files) == 2, files
    return {
        f"{f.parent.name}/{k}": v
        for f in files
        for k, v in torch.load(f, map_location="cpu", weights_only=False)["model"].items()
        if isinstance(v, torch.Tensor)
    }


def test_overlapped_gradient_reduction_and_parameter_gather_give_the_same_losses_and_weights(tmp_path, cache_p2):
    """TP=2 x DP=2 with the distributed optimizer. Every strategy reads the linear layers' weights without
    calling the modules, where Megatron's DDP waits for the overlapped all-gather of their parameters."""
    flags = [*SMALL_GPT, "--tensor-model-parallel-size", "2", "--global-batch-size", "2", "--train-iters", "4"]
    flags += ["--use-distributed-optimizer", "--ckpt-format", "torch", "--save-interval", "4"]
    flags += ["--ddp-bucket-size", "4096"]  # many buckets: the layers' weights are gathered apart from the rest
    runs = {}
    for name, extra in (("plain", []), ("overlap", ["--overlap-grad-reduce", "--overlap-param-gather"])):
        config = small_job_config(tmp_path / name / "cfg.yaml", cache_p2)
        save = ["--save", str(tmp_path / name / "ckpt")]
        result = _job(4, tmp_path / name / "ranks", "--paradyse-config", str(config), *flags, *extra, *save)
        assert result.ok, result.output()
        runs[name] = read_jsonl(tmp_path / name / "log.jsonl"), _weights(tmp_path / name / "ckpt")
    (plain, plain_weights), (overlap, overlap_weights) = runs["plain"], runs["overlap"]
    assert [mb.plan for r in overlap for mb in r.micro_batches] == [mb.plan for r in plain for mb in r.micro_batches]
    # The same arithmetic in the same order: only when the reductions and gathers run differs.
    assert [r.loss for r in overlap] == pytest.approx([r.loss for r in plain], rel=1e-6)
    assert overlap_weights.keys() == plain_weights.keys()
    for key, value in plain_weights.items():
        torch.testing.assert_close(overlap_weights[key], value, rtol=1e-5, atol=1e-7, msg=key)


def test_overlapped_reduction_is_refused_where_lean_would_break_it(tmp_path, cache_p2):
    config = small_job_config(tmp_path / "cfg.yaml", cache_p2)
    flags = [*SMALL_GPT, "--tensor-model-parallel-size", "2", "--global-batch-size", "1", "--train-iters", "2"]
    flags += ["--qk-layernorm", "--use-distributed-optimizer", "--overlap-grad-reduce"]
    _refused(
        config,
        flags,
        r"the Paradyse layers cannot run this model:\n  - --overlap-grad-reduce with --qk-layernorm and the lean "
        r"attention strategy in the plans: lean's backward adds the q/k norm weights' gradients once per head group, "
        r".* keep lean out of the plans \(planner.attention or planner.pairs\)\n",
    )

    config = small_job_config(tmp_path / "no-lean" / "cfg.yaml", cache_p2, planner={"attention": ["tp_sp", "ring"]})
    result = _job(2, tmp_path / "no-lean" / "ranks", "--paradyse-config", str(config), *flags)
    assert result.ok, result.output()


def test_pipeline_parallelism_trains_learns_and_says_what_its_budget_leaves_out(tmp_path, cache_p2):
    """PP=2 with two micro-batches per step trains; stage 0 holds both micro-batches' activations at once,
    and plans each to hold no more than the step's longest would beside the other (``stop``: the step is known
    before it runs): one line says so. Each stage's micro-batches are timed (their forward and backward, not
    the other micro-batches' work between them; no peak, which would hold that work too) and the time model
    learns from them. The interleaved schedule trains too, with its own counts, planned for --seq-length
    (``skip``), each micro-batch timed through both model chunks of a stage. A budget that cannot hold what
    the schedule keeps between micro-batches is refused."""
    flags = [*SMALL_GPT, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]
    flags += ["--global-batch-size", "2", "--train-iters", "2"]
    log = {"jsonl": "log.jsonl", "measure": True}
    config = small_job_config(
        tmp_path / "cfg.yaml", cache_p2, planner={"on_infeasible": "stop", "learn_time": True}, log=log
    )
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    result = _job(2, tmp_path / "ranks", "--paradyse-config", str(config), *flags, *save)
    stdout = [rank.out for rank in result.ranks]
    assert result.ok, result.output()
    records = read_jsonl(tmp_path / "log.jsonl")
    assert [r.iteration for r in records] == [1, 2] and all(len(r.micro_batches) == 2 for r in records)
    micro_batches = [mb for r in records for mb in r.micro_batches]
    assert all(mb.measured_time_s > 0 and mb.measured_peak_bytes is None for mb in micro_batches), micro_batches
    assert [mb.one_off for mb in micro_batches] == ["warm-up", None, None, None]
    learned = re.search(r"paradyse: learned time factors \(option x\[bucket:factor\]\): (.*)\n", stdout[1])
    assert learned and learned.group(1) != "none", stdout[1][-3000:]
    # Megatron saves the loader's state from stage 0's rank alone: it holds stage 1's previous plan too (one
    # layer a stage), and the corrections stage 1's rank printed: the two ranks agreed on them
    (saved,) = (tmp_path / "ckpt" / "iter_0000002").rglob("train_dataloader_dprank000.pt")
    state = torch.load(saved, weights_only=False)["dataloader_state_dict"]
    assert [sum(planner["previous"]) for planner in state["planners"]] == [1, 1], state["planners"]
    corrections = TimeCorrections()
    corrections.load_state_dict(state["time_corrections"])
    assert corrections.summary() == learned.group(1)
    assert [out.count("paradyse: warning:") for out in stdout] == [0, 0]
    assert (
        "paradyse: PP=2: with 2 micro-batches per step under 1F1B, pipeline stages 0..1 hold activations of up to "
        "2, 1 micro-batches at once: each may hold what the step's longest micro-batch (at most --seq-length 4096 "
        "tokens) holds under the fastest plan that fits that many of it, and peak in what the others leave\n"
        in stdout[0]
    ), stdout[0][-3000:]

    # Megatron's interleaved schedule, two chunks of one layer a stage: five chunk forwards in flight on stage 0.
    # In 8 MiB no plan fits five chunks of even the shortest document beside what the stage keeps: every rank knows
    # (skipping would never end), rank 0 says so. In 16 MiB, where planning each whole micro-batch to a quarter of
    # the stage's room refused even the shortest, micro-batches of different lengths train.
    four_layers = [*flags, "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"]
    four_layers += ["--global-batch-size", "4"]
    config = small_job_config(tmp_path / "small" / "cfg.yaml", cache_p2, memory={"budget_gib": 1 / 128})
    result = _job(2, tmp_path / "small" / "ranks", "--paradyse-config", str(config), *four_layers)
    assert result.codes == [2, 2], result.output()
    refusal = "paradyse: error: no plan fits even the data's shortest sample on pipeline stage 0, so "
    assert result.stderr.count(refusal) == 1 == result.stderr.count("paradyse: error:"), result.stderr[-3000:]
    # told to stop on such a micro-batch, every rank stops before the step's schedule: the last stage is not
    # left waiting for the first one's activations
    stop = small_job_config(
        tmp_path / "stop" / "cfg.yaml", cache_p2, planner={"on_infeasible": "stop"}, memory={"budget_gib": 1 / 128}
    )
    result = _job(2, tmp_path / "stop" / "ranks", "--paradyse-config", str(stop), *four_layers)
    assert result.codes == [2, 2], result.output()
    refusal = "paradyse: error: pipeline stage 0: a sequence of "
    assert result.stderr.count(refusal) == 1 == result.stderr.count("paradyse: error:"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    # each micro-batch timed through both chunks of the stage, and learned from
    planner = {"on_infeasible": "skip", "learn_time": True}
    config = small_job_config(tmp_path / "roomy" / "cfg.yaml", cache_p2, planner=planner, log=log)
    result = _job(2, tmp_path / "roomy" / "ranks", "--paradyse-config", str(config), *four_layers)
    stdout = [rank.out for rank in result.ranks]
    assert result.ok, result.output()
    records = read_jsonl(tmp_path / "roomy" / "log.jsonl")
    assert [r.iteration for r in records] == [1, 2] and all(len(r.micro_batches) == 4 for r in records)
    assert len({mb.tokens for r in records for mb in r.micro_batches}) > 1
    micro_batches = [mb for r in records for mb in r.micro_batches]
    assert all(mb.measured_time_s > 0 and mb.measured_peak_bytes is None for mb in micro_batches), micro_batches
    learned = re.search(r"paradyse: learned time factors \(option x\[bucket:factor\]\): (.*)\n", stdout[1])
    assert learned and learned.group(1) != "none", stdout[1][-3000:]
    assert [out.count("paradyse: warning:") for out in stdout] == [0, 0]
    assert (
        "paradyse: PP=2: with 4 micro-batches per step under the interleaved schedule (2 chunks a stage), pipeline "
        "stages 0..1 hold activations of up to 5, 3 model chunks of micro-batches at once: each may hold what a "
        "micro-batch of --seq-length 4096 tokens holds under the fastest plan that fits that many of it, and peak "
        "in what the others leave\n" in stdout[0]
    ), stdout[0][-3000:]

    # Stage 1 keeps the input of one micro-batch of --seq-length tokens and its gradient (here data.max_len's
    # 256K: 128 MiB in fp32) into the next one: more than the 16 MiB budget. Refused on every rank before
    # start-up.
    data = {"dataset": "code", "cache_dir": str(cache_p2), "num_documents": 8, "min_len": 128, "max_len": 2**18}
    config = small_job_config(tmp_path / "long.yaml", cache_p2, data=data)
    _refused(
        config,
        flags,
        re.escape(
            "the memory budget (16.00 MiB per rank) cannot hold what every plan holds:\n  - pipeline stage 1: "
            "1.14 MiB of weights, gradients and optimizer state, and 128.00 MiB for a micro-batch's input and its "
            "gradient, of --seq-length 262144 tokens, that the pipeline schedule keeps into the next one (a shorter "
            "data.max_len or more tensor-parallel ranks make it smaller)\nwhat would fit: more tensor- or "
            "pipeline-parallel ranks, the distributed optimizer over data-parallel ranks "
            "(--use-distributed-optimizer), Transformer Engine or apex installed (a fused optimizer step needs no "
            "working set), or a larger memory.budget_gib\n"
        ),
    )
