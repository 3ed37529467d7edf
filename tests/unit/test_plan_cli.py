"""``paradyse plan``: the plans, predicted time and peak per length, each static strategy's limit and the
planner's, from a config and published figures, in seconds, without a device."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
import yaml

from megatron_paradyse.cli import main as paradyse
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.data import write_documents

from helpers.paths import CONFIGS


def test_plan_answers_will_it_fit_for_llama3_8b_on_h100(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", str(CONFIGS / "llama3-8b.yaml"), "--gpu", "h100", "--lengths", "4096,4112,131072,8000000"]
    assert paradyse([*argv, "--json", str(out), "--plot", str(tmp_path / "plan.png")]) == 0
    printed = capsys.readouterr().out
    answer = json.loads(out.read_text())
    rows = {row["tokens"]: row["stage0"] for row in answer["lengths"]}
    assert rows[4096]["plan"] == "32x tp_sp/tp_sp"  # short: Megatron's own TP+SP is fastest
    # a length's own time, not its bucket's edge (4112 is planned at 4608, a bound for memory)
    assert rows[4112]["plan"] == rows[4096]["plan"] and 1 < rows[4112]["time_s"] / rows[4096]["time_s"] < 1.01
    assert rows[131072]["plan"] is not None and rows[131072]["peak_gib"] <= answer["budget_gib"]
    assert rows[8000000] == {"plan": None, "longest": answer["longest"]}  # past the longest that fits: said at once
    static = answer["static_longest"]
    assert static["tp_sp/tp_sp"] < 131072 < answer["longest"] < 8000000
    assert answer["longest"] >= max(static.values())
    assert re.search(r"^\s+131072\s+0\s+\S.*\d$", printed, re.MULTILINE)
    assert f"longest sequence the planner fits: {answer['longest']} tokens" in printed
    assert "Megatron TP+SP (stock)" in printed
    assert f"  8000000      0  does not fit: longer than {answer['longest']} tokens, the longest that fits\n" in printed
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"
    # planned with the job's own arguments: Megatron accumulates bf16 gradients in fp32, so a parameter holds
    # 18 bytes (its bf16 weight, fp32 gradient, fp32 master weight and two Adam moments); a rank's share of
    # Llama 3 8B at TP=8: the layers' shards and norms, the embedding and output layer (the code corpus's
    # byte vocabulary, padded to 128 x 8), the final norm
    h, heads, groups, kv, ffn = 4096, 32, 8, 128, 14336
    layer = (h * (heads + 2 * groups) * kv + heads * kv * h + h * 2 * ffn + ffn * h) // 8 + 2 * h
    parameters = 32 * layer + 2 * (1024 // 8) * h + h
    assert answer["static_gib"] == [parameters * 18 / 2**30]
    assert f"budget {answer['budget_gib']:.2f} GiB per rank, of which the weights, gradients and optimizer state " in (
        printed
    )
    # the budget: what an H100's caching allocator can hold (its 81,559 MiB less the 3 GiB the node's figures
    # assume in use outside it) less the config's 3% margin
    assert answer["budget_gib"] == pytest.approx((81559 / 1024 - 3) * 0.97)
    # at the job's world size, the distributed optimizer's master weights and moments are split over its
    # data-parallel ranks: 2 + 4 + 12 / 4 bytes a parameter at 32 ranks
    argv = ["plan", str(CONFIGS / "llama3-8b.yaml"), "--gpu", "h100", "--lengths", "4096", "--json", str(out)]
    assert paradyse([*argv, "--world-size", "32", "--", "--use-distributed-optimizer"]) == 0
    assert "TP=8 PP=1 DP=4; budget" in capsys.readouterr().out
    assert json.loads(out.read_text())["static_gib"] == [parameters * 9 / 2**30]


@pytest.mark.parametrize(("precision", "bytes_per_parameter"), [("--bf16", 18), ("--fp16", 16), (None, 16)])
def test_the_static_memory_plan_counts_is_the_jobs_in_every_precision(tmp_path, precision, bytes_per_parameter):
    """``plan``'s static memory (:meth:`_Job.footprints`) from the job's validated arguments: Megatron
    accumulates bf16 gradients in fp32 (2 + 4 bytes, then the fp32 master weight and two Adam moments),
    keeps fp16 ones in fp16 (2 + 2 + 12), and an fp32 model has no master copy (4 + 4 + 8). Llama 3 8B at
    TP=8: 873,730,048 parameters a rank (counted in the test above)."""
    from megatron_paradyse.config import load_config
    from megatron_paradyse.run.plan_cli import _Job

    config = yaml.safe_load((CONFIGS / "llama3-8b.yaml").read_text())
    config["megatron_args"].remove("--bf16")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    job = _Job.from_config(
        load_config(path), [precision] if precision else [], world_size=None, gpu="h100", profile=None
    )
    assert [f.static_bytes for f in job.footprints()] == [873_730_048 * bytes_per_parameter]


def test_plan_of_an_interleaved_pipeline_says_what_its_stages_hold(tmp_path, capsys):
    """Llama 3 8B on PP=2 with 4 model chunks a stage and 8 micro-batches a step: stages hold 9 and 7 chunk
    forwards at once (Megatron's warm-up plus one), each planned by chunk: every chunk of a stage runs the
    same plan."""
    config = yaml.safe_load((CONFIGS / "llama3-8b.yaml").read_text())
    config["cost"]["profile"] = None
    path = tmp_path / "pp2.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "plan.json"
    argv = ["plan", str(path), "--gpu", "h100", "--lengths", "131072", "--json", str(out)]
    # the job's command-line flags, after the config's
    flags = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "4"]
    assert paradyse([*argv, "--", *flags, "--global-batch-size", "8"]) == 0
    printed = capsys.readouterr().out
    assert (
        "pipeline stages 0..1 hold up to 9, 7 forwards at once, each planned to hold what one of --seq-length "
        "131072 tokens would; peak: one forward's\n"
    ) in printed
    answer = json.loads(out.read_text())
    assert answer["forwards_in_flight"] == [9, 7]
    for stage in ("stage0", "stage1"):
        runs = [run.split("x ", 1) for run in answer["lengths"][0][stage]["plan"].split("; ")[0].split(", ")]
        layers = [option for count, option in runs for _ in range(int(count))]
        assert len(layers) == 16 and layers == layers[:4] * 4, layers


def test_plan_prices_a_group_of_a_nodes_gpus_and_refuses_what_it_cannot_price(tmp_path, capsys):
    llama = str(CONFIGS / "llama3-8b.yaml")
    half = ["--", "--tensor-model-parallel-size", "4"]
    assert paradyse(["plan", llama, "--gpu", "h100", "--lengths", "4096", *half]) == 0  # half the node
    out = capsys.readouterr().out
    assert out.startswith("cost model: h100 node (4 of its GPUs), simulated from its figures")
    assert "TP=4 PP=1 DP=1" in out
    with pytest.raises(SystemExit) as exit_status:
        sixteen = ["--tensor-model-parallel-size", "16", "--num-query-groups", "16"]  # a model 16 ranks can split
        paradyse(["plan", llama, "--gpu", "h100", "--lengths", "4096", "--", *sixteen])
    assert exit_status.value.code == 2
    assert capsys.readouterr().err.endswith(
        "paradyse: error: --gpu h100: the published figures are for groups of 1, 2, 4, 8 GPUs of one node, not "
        "p=16 (TP=16)\n"
    )


def test_plan_without_a_budget_or_a_gpu_says_which_to_give(tmp_path, capsys):
    config = yaml.safe_load((CONFIGS / "llama3-8b.yaml").read_text())
    assert config["memory"].get("budget_gib") is None  # sized by the GPU's memory
    path = tmp_path / "no-gpu.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_status:  # before any profile is read: this one does not exist
        paradyse(["plan", str(path), "--profile", str(tmp_path / "none.json"), "--lengths", "4096"])
    assert exit_status.value.code == 2
    assert capsys.readouterr().err.endswith(
        "paradyse: error: set memory.budget_gib, or pass --gpu for a GPU's memory\n"
    )


def test_plan_answers_a_length_past_the_longest_that_fits_at_once(tmp_path, capsys):
    """99,999,999,999 tokens of Llama 3 8B: past the longest length any plan fits, said so without pricing
    it, in seconds (it once gave no answer in 300 s: a tiled MLP was priced tile by tile)."""
    llama = str(CONFIGS / "llama3-8b.yaml")
    out = tmp_path / "plan.json"
    assert paradyse(["plan", llama, "--gpu", "h100", "--lengths", "4096"]) == 0  # megatron-core imported
    capsys.readouterr()
    start = time.perf_counter()
    assert paradyse(["plan", llama, "--gpu", "h100", "--lengths", "99999999999", "--json", str(out)]) == 0
    seconds = time.perf_counter() - start
    answer = json.loads(out.read_text())
    assert answer["lengths"] == [{"tokens": 99999999999, "stage0": {"plan": None, "longest": answer["longest"]}}]
    assert (
        f"99999999999      0  does not fit: longer than {answer['longest']} tokens, the longest that fits\n"
        in capsys.readouterr().out
    )
    assert seconds < 20, seconds


@pytest.mark.parametrize(
    ("lengths", "wrong"),
    [("0", "'0'"), ("-5", "'-5'"), ("1.5", "'1.5'"), ("abc", "'abc'"), ("1e9", "'1e9'"), ("", "''"), ("4096,,8", "''")],
)
def test_plan_refuses_lengths_that_are_not_token_counts_before_anything_else(capsys, lengths, wrong):
    """Refused before the config is read (this one does not exist)."""
    with pytest.raises(SystemExit) as exit_status:
        paradyse(["plan", "no-such-config.yaml", "--gpu", "h100", f"--lengths={lengths}"])
    assert exit_status.value.code == 2
    assert capsys.readouterr().err == (
        "paradyse: error: --lengths takes whole numbers of tokens above 0, separated by commas (like 4096,32768): "
        f"{wrong} in {lengths!r} is not one\n"
    )


def test_plan_refuses_what_is_not_an_indexed_dataset_in_one_line(tmp_path, capsys):
    """Missing files, a text file of lengths, a truncated index, an empty dataset: one line naming the path."""
    (tmp_path / "lengths.txt").write_text("4096\n32768\n")
    write_documents(tmp_path / "short", [np.arange(100)], vocab_size=256)
    index = (tmp_path / "short.idx").read_bytes()
    (tmp_path / "short.idx").write_bytes(index[:40])
    write_documents(tmp_path / "empty", [np.zeros(0, dtype=np.int64)], vocab_size=256)
    expected = {
        "lengths.txt": f"no dataset at {tmp_path}/lengths.txt: neither {tmp_path}/lengths.txt.bin nor "
        f"{tmp_path}/lengths.txt.idx exists (a dataset is named by the path of its .bin and .idx files without the "
        f"suffix)",
        "short": f"{tmp_path}/short.idx has 40 bytes, but its header (1 sequences, 2 document indices) needs exactly "
        f"62 (truncated)",
        "empty": f"the dataset {tmp_path}/empty has no tokens (1 documents, every one empty): prepare it again from "
        f"texts that are not empty, or name another dataset",
    }
    for name, message in expected.items():
        with pytest.raises(SystemExit) as exit_status:
            paradyse(["plan", str(CONFIGS / "llama3-8b.yaml"), "--gpu", "h100", "--dataset", str(tmp_path / name)])
        assert exit_status.value.code == 2
        assert capsys.readouterr().err == f"paradyse: error: --dataset: {message}\n"


def _short_llama(path, **planner) -> str:
    """Llama 3 8B, the job's --seq-length 1,024 (data.max_len and data.token_budget), with ``planner``."""
    config = yaml.safe_load((CONFIGS / "llama3-8b.yaml").read_text())
    flags = config["megatron_args"]
    for flag in ("--seq-length", "--max-position-embeddings"):
        del flags[flags.index(flag) : flags.index(flag) + 2]
    config["data"].update(max_len=1024, token_budget=1024)
    config["planner"].update(planner)
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize("ratio", [3, 1e300])
def test_a_jobs_planners_price_no_micro_batch_past_its_seq_length(tmp_path, ratio):
    """The last length bucket of a job's planners (:func:`stage_planners`: the entry point's, the drop-in
    spec's, ``plan``'s) ends at --seq-length: with geometric buckets of ratio 3 a micro-batch of 1,024 tokens
    was priced at 1,536, and with ratio 1e300 at 5e302 tokens, an OverflowError in the cost model."""
    from megatron_paradyse.config import load_config
    from megatron_paradyse.run.plan_cli import _Job

    config = load_config(_short_llama(tmp_path / "short.yaml", bucket="geometric", bucket_ratio=ratio))
    job = _Job.from_config(config, [], world_size=None, gpu="h100", profile=None)
    (planner,) = job.planners()
    for tokens in (600, 1000, 1024):
        assert planner.decide(SequenceLayout.build(tokens, 8, causal=True)).bucket_length == 1024, tokens


def test_plan_prices_no_length_past_the_longest_asked(tmp_path):
    """``plan`` plans as a job whose longest micro-batch is the longest length asked: 1,000 tokens (padded to
    1,008) at 1,008, not at the 1,536-token edge of its bucket of ratio 3."""
    config = _short_llama(tmp_path / "short.yaml", bucket="geometric", bucket_ratio=3)
    out = tmp_path / "plan.json"
    assert paradyse(["plan", config, "--gpu", "h100", "--lengths", "600,1000", "--json", str(out)]) == 0
    rows = {row["tokens"]: row["stage0"] for row in json.loads(out.read_text())["lengths"]}
    assert (rows[600]["bucket_tokens"], rows[1000]["bucket_tokens"]) == (1008, 1008)


def test_plan_prices_the_tuned_megatron_configuration_beside_the_planner(tmp_path, capsys):
    from megatron_paradyse.simulation.tuned import megatron_configs

    llama = str(CONFIGS / "llama3-8b.yaml")
    out = tmp_path / "plan.json"
    assert (
        paradyse(["plan", llama, "--gpu", "h100", "--lengths", "4096,131072", "--vs-megatron", "--json", str(out)]) == 0
    )
    printed = capsys.readouterr().out
    versus = json.loads(out.read_text())["vs_megatron"]
    assert versus["tuned"].startswith(tuple(c.layout + " " for c in megatron_configs(8)))
    assert versus["ratio"] == pytest.approx(versus["adaptive_s"] / versus["tuned_s"])
    lines = printed.splitlines()
    assert lines[-2] == versus["line"] and versus["line"].startswith(f"tuned Megatron: {versus['tuned']}, the fastest")
    assert lines[-1] == (
        f"these lengths, one sequence each: the planner {versus['adaptive_s']:.4g} s, tuned Megatron "
        f"{versus['tuned_s']:.4g} s (adaptive_vs_tuned_megatron={versus['ratio']:.2f}, over the lengths both fit)"
    )


def test_plan_refuses_a_megatron_comparison_it_cannot_price(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_status:  # before the config is read: this one does not exist
        paradyse(["plan", "no-such-config.yaml", "--profile", "p.json", "--lengths", "4096", "--vs-megatron"])
    assert exit_status.value.code == 2
    assert capsys.readouterr().err.endswith(
        "paradyse: error: --vs-megatron prices Megatron's configurations on a node's published figures: add --gpu\n"
    )
    llama = str(CONFIGS / "llama3-8b.yaml")
    two_stages = ["--", "--pipeline-model-parallel-size", "2"]
    with pytest.raises(SystemExit) as exit_status:
        paradyse(["plan", llama, "--gpu", "h100", "--lengths", "4096", "--vs-megatron", *two_stages])
    assert exit_status.value.code == 2
    assert capsys.readouterr().err.endswith(
        "paradyse: error: --vs-megatron compares the plans of one pipeline stage; the job runs PP=2: plan it with "
        "--pipeline-model-parallel-size 1\n"
    )
