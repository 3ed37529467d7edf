"""The paradyse YAML config: every problem reported at once, by key; paths relative to the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_paradyse.config import ConfigError, DataSection, ParadyseConfig, load_config

from helpers.paths import CONFIGS


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_every_problem_is_reported_with_its_key(tmp_path):
    path = _write(
        tmp_path,
        "planner:\n  hysterisis: 0.1\n  bucket_tokens: '512'\nmemory:\n  budget_gib: -1\ndata:\n  sampler: sorted\n"
        "loggin: {}\n",
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"{path}:\n"
        "  loggin: unknown key; did you mean 'log'?\n"
        "  planner.hysterisis: unknown key; did you mean 'hysteresis'?\n"
        "  planner.bucket_tokens: must be int, got '512'\n"
        "  memory.budget_gib must be a finite number > 0, got -1.0\n"
        "  data.sampler: must be one of 'curriculum', 'bucketed', 'random'; got 'sorted'"
    )


def test_a_strategy_the_library_does_not_have_is_refused(tmp_path):
    path = _write(tmp_path, "planner:\n  pairs: [tp_sp/tp_sp, ringg/zero3]\n")
    with pytest.raises(ConfigError, match=r"planner.pairs: unknown attention strategy 'ringg'; known: tp_sp, "):
        load_config(path)


def test_unreadable_and_malformed_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read the paradyse config .*missing.yaml: No such file"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"cfg.yaml is not valid YAML"):
        load_config(_write(tmp_path, "planner: [\n"))
    with pytest.raises(ConfigError, match=r"the top level must be a mapping of sections, got list"):
        load_config(_write(tmp_path, "- planner\n"))


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    """YAML would keep the second section and drop the first's keys silently."""
    path = _write(tmp_path, "memory:\n  budget_gib: 1\ndata: {max_len: 512}\nmemory:\n  margin: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: key 'memory' appears twice (lines 1 and 4); merge the two"
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, "planner: {space: {host_memory_gib: 1, host_memory_gib: 2}}\n"))
    assert str(err.value).endswith(": key 'host_memory_gib' appears twice (both on line 1); merge the two")
    # a key after a merge ("<<: *anchor") overrides the merged one: not a repeat (validation goes on)
    merged = "memory: &base {budget_gib: 1, margin: 0.1}\ndata: {<<: *base, margin: 0.2}\n"
    with pytest.raises(ConfigError, match=r"\n  data.margin: unknown key"):
        load_config(_write(tmp_path, merged))


def test_paths_resolve_relative_to_the_config_file(tmp_path):
    cfg = load_config(_write(tmp_path, "cost: {profile: prof/cpu.json}\ndata: {dataset: corpora/mine}\n"))
    assert cfg.cost.profile == str(tmp_path / "prof/cpu.json")
    assert cfg.data.dataset == str(tmp_path / "corpora/mine")
    assert load_config(_write(tmp_path, "")) == ParadyseConfig(data=DataSection(cache_dir=str(tmp_path / "data")))


@pytest.mark.parametrize("preset", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_preset_is_valid(preset):
    load_config(preset)


def test_values_that_make_no_sense_are_refused_and_numbers_in_exponent_form_are_numbers(tmp_path):
    path = _write(
        tmp_path,
        "planner:\n  bucket_ratio: .inf\n  hysteresis: .nan\nmemory:\n  budget_gib: .inf\n  margin: 1e-2\n"
        "data:\n  seed: -1\n",
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"{path}:\n"
        "  planner.hysteresis: must be a finite number, got nan\n"
        "  planner.bucket_ratio: must be a finite number, got inf\n"
        "  memory.budget_gib: must be a finite number, got inf\n"
        "  data.seed must be >= 0, got -1"
    )
    config = load_config(_write(tmp_path, "memory:\n  budget_gib: 1e-30\n  margin: 5E-2\n"))
    assert (config.memory.budget_gib, config.memory.margin) == (1e-30, 0.05)
    with pytest.raises(ConfigError, match=r"memory.budget_gib: must be float, got '1e-30'"):
        load_config(_write(tmp_path, "memory:\n  budget_gib: '1e-30'\n"))  # quoted: a string, as YAML says


def test_numbers_in_megatron_args_are_their_text(tmp_path):
    config = load_config(_write(tmp_path, "megatron_args: [--lr, 3e-3, --num-layers, 4, --clip-grad, 1.0]\n"))
    assert config.megatron_args == ("--lr", "0.003", "--num-layers", "4", "--clip-grad", "1.0")
    with pytest.raises(ConfigError, match=r"megatron_args\[1\]: must be str, got True"):
        load_config(_write(tmp_path, "megatron_args: [--use-flash-attn, true]\n"))


def test_a_planner_config_built_in_code_refuses_an_infinite_bucket_ratio():
    from megatron_paradyse.planner import PlannerConfig

    with pytest.raises(ValueError, match=r"planner.bucket_ratio must be a finite number > 1, got inf"):
        PlannerConfig(bucket_ratio=float("inf"))


def test_the_budget_is_the_configs_else_what_the_caching_allocator_can_hold_less_the_margin():
    """One rule for the entry point, the drop-in spec and ``paradyse plan``."""
    from megatron_paradyse.config import MemorySection

    assert MemorySection(budget_gib=1.5, margin=0.2).budget_bytes(80 * 2**30) == 1.5 * 2**30
    assert MemorySection(margin=0.03).budget_bytes(100 * 2**30) == pytest.approx(97 * 2**30)
    assert MemorySection().budget_bytes(None) is None


def test_start_up_sizes_the_budget_by_what_the_allocator_can_hold_and_keeps_a_shrunk_one(monkeypatch):
    """The entry point plans from the device's whole memory until start-up measures what the caching
    allocator can hold (the least over the ranks); then the budget is that less the margin, or the
    smaller one a run shrank to after an out-of-memory error, and the static memory is checked again. The
    step's communicators are warmed before the measurement, so that it sees what NCCL holds."""
    from megatron_paradyse.config import MemorySection, ParadyseConfig
    from megatron_paradyse.run import job as job_module
    from megatron_paradyse.run.fault import BudgetState

    gib = 2**30
    events = []
    monkeypatch.setattr(job_module, "step_groups", lambda args: ["the step's groups"])
    monkeypatch.setattr(job_module, "warm_communicators", lambda groups, device: events.append(("warmed", groups)))
    monkeypatch.setattr(
        job_module, "allocator_capacity_bytes", lambda device, group: events.append("measured") or 100 * gib
    )
    checked = []
    monkeypatch.setattr(job_module.Job, "check_static_memory", lambda self: checked.append(self.budget_bytes))
    config = ParadyseConfig(memory=MemorySection(margin=0.03))
    fields = dict(config=config, args=None, model_config=None, profile=None, device=None)
    job = job_module.Job(budget_bytes=0.97 * 120 * gib, **fields)
    assert (job.measure_budget(), job.budget_bytes, checked) == (100 * gib, 97 * gib, [97 * gib])
    assert events == [("warmed", ["the step's groups"]), "measured"]
    shrunk = job_module.Job(budget_bytes=90 * gib, budget_state=BudgetState(budget_bytes=90 * gib), **fields)
    assert (shrunk.measure_budget(), shrunk.budget_bytes) == (100 * gib, 90 * gib)
    configured = job_module.Job(
        budget_bytes=40 * gib, **{**fields, "config": ParadyseConfig(memory=MemorySection(budget_gib=40))}
    )
    assert (configured.measure_budget(), configured.budget_bytes) == (100 * gib, 40 * gib)
