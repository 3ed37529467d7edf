"""``paradyse check-config`` and docs/configs.md: the documented schema and messages are the real ones."""

from __future__ import annotations

import platform
import re
from pathlib import Path

import pytest
import yaml

from megatron_paradyse.cli import main as paradyse
from megatron_paradyse.config import ConfigError, ParadyseConfig, load_config, section_keys
from megatron_paradyse.run.config_cli import calibration_argv, calibration_target, format_config
from megatron_paradyse.strategies import ModelShape

from helpers.paths import CONFIGS, ROOT

README = ROOT / "docs" / "configs.md"


def _readme_rows() -> dict[str, list[str]]:
    """``{key: [type, default, meaning]}`` of the schema tables."""
    rows = {}
    for line in README.read_text().splitlines():
        match = re.match(r"\| `([a-z_.]+)` \| (.*) \|$", line)
        if match:
            rows[match[1]] = [cell.strip() for cell in re.split(r"(?<!\\)\|", match[2])]
    return rows


def _fields(keys: dict | None = None, prefix: str = ""):
    """(key, default) of every key of the config, sections' keys after the section's."""
    for name, default in (section_keys(ParadyseConfig()) if keys is None else keys).items():
        yield f"{prefix}{name}", default
        if isinstance(default, dict):
            yield from _fields(default, f"{prefix}{name}.")


def test_the_readme_documents_every_key_with_its_default():
    rows = _readme_rows()
    keys = dict(_fields())
    assert sorted(rows) == sorted(keys), "docs/configs.md's schema tables and the config dataclasses differ"
    for key, default in keys.items():
        type_, shown, meaning = rows[key]
        assert type_ and meaning, key
        if isinstance(default, dict):
            assert (type_, shown) == ("section", ""), key
        else:
            as_yaml = yaml.safe_dump(list(default) if isinstance(default, tuple) else default, default_flow_style=True)
            assert shown == f"`{as_yaml.removesuffix('...' + chr(10)).strip()}`", key


def _readme_examples() -> list[tuple[str, str, str]]:
    """(file name, YAML, expected output) of the README's check-config examples."""
    text = README.read_text()
    found = re.findall(r"```yaml\n(.*?)```\n\n```console\n\$ paradyse check-config (\S+)\n(.*?)```", text, re.S)
    return [(name, config, output) for config, name, output in found]


def test_bad_configs_give_the_documented_messages(tmp_path, monkeypatch, capsys):
    examples = _readme_examples()
    assert [name for name, _, _ in examples] == ["bad.yaml", "flags.yaml"]
    monkeypatch.chdir(tmp_path)
    for name, config, output in examples:
        Path(name).write_text(config)
        with pytest.raises(SystemExit) as exit_status:
            paradyse(["check-config", name])
        assert exit_status.value.code == 2
        assert capsys.readouterr() == ("", output)


def test_a_valid_config_is_printed_resolved_and_reads_back_the_same(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "planner: {pairs: [tp_sp/tp_sp, lean/lean]}\ncost: {profile: ~/prof.json}\nattention_mask: bidirectional\n"
        'megatron_args: [--num-layers, "2", --sequence-parallel]\n'
    )
    assert paradyse(["check-config", str(path)]) == 0
    assert capsys.readouterr().out == (
        f"{path}: valid (Megatron's parser takes its flags; they name no model (--num-layers, --hidden-size, "
        f"--num-attention-heads), so the job's start-up checks did not run: give the job's flags after '--')\n"
    )
    assert paradyse(["check-config", str(path), "--print-config"]) == 0
    printed = tmp_path / "elsewhere" / "printed.yaml"
    printed.parent.mkdir()
    printed.write_text(capsys.readouterr().out)
    config = load_config(path)
    assert load_config(printed) == config
    assert config.cost.profile == str(Path.home() / "prof.json")
    assert config.attention_mask == "bidirectional"
    assert format_config(config).startswith("planner:\n  method: exact\n  attention: null\n")


def test_check_config_and_plan_refuse_a_megatron_flag_in_the_jobs_one_line(tmp_path, capsys):
    """The line a job's rank 0 prints for a flag Megatron's parser refuses, not the parser's usage."""
    path = tmp_path / "cfg.yaml"
    path.write_text('megatron_args: [--num-layers, "2"]\n')
    refusals = {
        ("--num-layer", "2"): "--num-layer: not a Megatron flag; did you mean --num-layers?",
        ("--lr", "abc"): "argument --lr: invalid float value: 'abc'",
    }
    for command in (["check-config", str(path)], ["plan", str(path), "--lengths", "1024"]):
        for flags, error in refusals.items():
            with pytest.raises(SystemExit) as exit_status:
                paradyse([*command, "--", *flags])
            assert exit_status.value.code == 2
            assert capsys.readouterr() == ("", f"paradyse: error: {error}\n")


def test_a_config_whose_job_would_stop_at_start_up_is_refused_with_the_jobs_own_message(tmp_path, capsys):
    """``check-config`` runs the checks every rank of the job runs before its first step (Megatron's argument
    validation, the entry point's and the Paradyse layers' refusals, the budget, the cost profile, the
    dataset) on this machine, or on one of ``--device``'s kind, at one data-parallel replica or
    ``--world-size``; the job's command-line flags come after ``--``."""
    settings = yaml.safe_load((CONFIGS / "llama-7b.yaml").read_text())
    del settings["cost"]  # the job then calibrates at start-up
    config = tmp_path / "llama-7b.yaml"
    config.write_text(yaml.safe_dump(settings))

    def refused(*argv: str, device: str | None = "cuda") -> str:
        with pytest.raises(SystemExit) as exit_status:
            paradyse(["check-config", str(config), *(["--device", device] if device else []), *argv])
        assert exit_status.value.code == 2
        out, err = capsys.readouterr()
        machine = "on a GPU" if device == "cuda" else "on a machine without CUDA"
        stopped = f"paradyse: error: {config}: its job would stop at start-up ({machine}): "
        assert out == "" and err.startswith(stopped)
        return err.removeprefix(stopped)

    # on this machine, without CUDA, as its job would run here: the budget is the configured one
    assert refused(device=None) == (
        "the Megatron arguments do not fit this entry point:\n"
        "  - memory.budget_gib is required on a machine without CUDA (the config's memory section)\n"
    )
    assert paradyse(["check-config", str(config), "--device", "cuda"]) == 0
    assert capsys.readouterr().out == (
        f"{config}: valid (checked as its job's ranks check it on a GPU, at 8 ranks; static memory not checked: the "
        f"budget is the GPU's memory, measured at start-up; dataset not checked: its job builds the code corpus into "
        f"{tmp_path / 'data' / 'code'}-python{platform.python_version()}-byte at start-up)\n"
    )
    assert paradyse(["check-config", str(config), "--device", "cuda", "--world-size", "32"]) == 0
    assert ", at 32 ranks;" in capsys.readouterr().out
    # Megatron's own checks: the world size, the model's heads over the tensor-parallel ranks
    assert refused("--world-size", "12") == (
        "Megatron's argument check failed: world size (12) is not divisible by total_model_size (total_model_size=8)\n"
    )
    assert refused("--", "--hidden-size", "4100").startswith(  # an assert without a message: its line
        "Megatron's argument check failed: assert args.hidden_size % args.num_attention_heads == 0 (arguments.py:"
    )
    # the entry point's, every one at once
    assert refused("--world-size", "8", "--", "--micro-batch-size", "2", "--eval-interval", "5") == (
        "the Megatron arguments do not fit this entry point:\n"
        "  - --micro-batch-size: a micro-batch is one row (one document or a packing); got 2, leave it out or set 1\n"
        "  - --eval-interval 5 without --eval-iters: no validation would run; add --eval-iters N (validation steps "
        "per evaluation, N > 0), or leave --eval-interval out\n"
    )
    # the Paradyse layers'
    assert refused("--", "--ffn-hidden-size", "11004", "--attention-dropout", "0.1", "--rotary-interleaved") == (
        "the Paradyse layers cannot run this model:\n"
        "  - attention_dropout=0.1: the attention kernels have no dropout; set 0\n"
        "  - rotary_interleaved=True is not supported: the layers rotate the halves of each head\n"
        "  - no strategy can split this model over tensor_model_parallel_size=8: ffn_hidden_size=11004 is not "
        "divisible by p=8\n"
    )


def test_calibration_covers_the_jobs_group_size_dtype_and_model(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "cost: {profile: prof/p4.json}\ndata: {max_len: 8192}\n"
        'megatron_args: [--tensor-model-parallel-size, "4", --hidden-size, "256", --num-attention-heads, "8"]\n'
    )
    output = str(tmp_path / "prof/p4.json")
    expected = ["calibrate", "--output", output, "--p", "4", "--dtype", "float32", "--device", "cuda", "--grid", "full"]
    assert calibration_argv(path) == [*expected, "--config", str(path)]
    assert calibration_argv(path, ["--bf16"])[5:7] == ["--dtype", "bfloat16"]
    assert calibration_argv(path, ["--fp16"])[5:7] == ["--dtype", "float16"]
    # flags after the config's win, as on the command line, and go on to the model; or the group sizes are given
    assert calibration_argv(path, ["--tensor-model-parallel-size", "2"])[3:5] == ["--p", "2"]
    assert calibration_argv(path, ["--bf16"])[-3:] == [str(path), "--", "--bf16"]
    assert calibration_argv(path, p="2,4")[3:5] == ["--p", "2,4"]
    target = calibration_target(path, ["--ffn-hidden-size", "640"])
    assert (target.p, target.dtype, target.longest) == (4, "float32", 8192)
    assert target.shape == ModelShape(
        hidden_size=256, num_attention_heads=8, num_query_groups=8, kv_channels=32, ffn_hidden_size=640
    )
    assert calibration_target(path, ["--seq-length", "16384"]).longest == 16384  # the job's --seq-length
    bare = tmp_path / "bare.yaml"
    bare.write_text('megatron_args: [--num-layers, "2"]\n')
    with pytest.raises(ConfigError, match=r"^cost.profile is not set: name the file that calibration writes"):
        calibration_argv(bare)
    with pytest.raises(ConfigError, match=r"bare.yaml: calibration measures the model's own work, and the config's "):
        calibration_target(bare)
