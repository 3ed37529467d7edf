"""``paradyse`` sub-commands as a user runs them, in a fresh process: the answer, and no Python warning
before it (megatron-core warns at import, module by module, when Transformer Engine or apex is missing)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import entry_point
from helpers.paths import CONFIGS, ROOT


@pytest.mark.parametrize("name", ["plan", "check-config"])
def test_a_command_prints_its_answer_and_no_warning(name, tmp_path, cache_p2):
    if name == "plan":
        command = ["plan", str(CONFIGS / "llama3-8b.yaml"), "--gpu", "h100", "--lengths", "4096,131072"]
    else:  # its job's checks open the dataset and build the tokenizer, which log as they go
        config = entry_point.small_job_config(tmp_path / "cfg.yaml", cache_p2)
        command = ["check-config", str(config), "--", *entry_point.SMALL_GPT, "--tensor-model-parallel-size", "2"]
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # Python's defaults, a user's
    result = subprocess.run(
        [sys.executable, "-m", "megatron_paradyse.cli", *command],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() and result.stderr == ""
