"""patches/ and scripts/apply_patch.sh: stock pretrain_gpt.py (tag core_v0.19.0) with --paradyse-config.

No Megatron-LM text is committed, so most tests build a fake checkout whose pretrain_gpt.py is the
patch's own context lines. The real file is patched and run when ``MEGATRON_LM_DIR`` points at a
core_v0.19.0 checkout (skipped otherwise).
"""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from helpers.paths import ROOT

APPLY = ROOT / "scripts" / "apply_patch.sh"
PATCH = ROOT / "patches" / "pretrain_gpt_core_v0.19.0.patch"
CHECKOUT = os.environ.get("MEGATRON_LM_DIR")


def _hunks() -> list[tuple[str, str]]:
    """(the text the patch expects, the text it leaves) of each of its hunks."""
    lines = PATCH.read_text().splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith("@@")]
    hunks = []
    for start, end in zip(starts, [*starts[1:], len(lines)]):
        body = lines[start + 1 : end]
        hunks.append(("".join(x[1:] for x in body if x[0] in " -"), "".join(x[1:] for x in body if x[0] in " +")))
    return hunks


def _hunk() -> tuple[str, str]:
    """The text the patch expects and the text it leaves, all hunks one after the other."""
    hunks = _hunks()
    return "".join(before for before, _ in hunks), "".join(after for _, after in hunks)


def _checkout(tmp_path: Path, version: str | None = "0.19.1", script: str | None = None) -> Path:
    if version is not None:
        info = tmp_path / "megatron" / "core" / "package_info.py"
        info.parent.mkdir(parents=True)
        major, minor, patch = version.split(".")
        info.write_text(f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = ''\n")
    if script is not None:
        (tmp_path / "pretrain_gpt.py").write_text(script)
    return tmp_path


def _apply(checkout: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(APPLY), str(checkout)], capture_output=True, text=True, timeout=60)


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_the_patch_applies_once_then_says_already_applied(tmp_path):
    before, after = _hunk()
    checkout = _checkout(tmp_path, script=f"import time\n\n{before}")
    target = checkout / "pretrain_gpt.py"
    first = _apply(checkout)
    assert (first.returncode, first.stderr) == (0, "")
    assert first.stdout == f"patched: {target} (--paradyse-config runs megatron_paradyse.pretrain_gpt)\n"
    assert target.read_text() == f"import time\n\n{after}"
    again = _apply(checkout)
    assert (again.returncode, again.stdout) == (0, f"already applied: {checkout}/pretrain_gpt.py\n")
    assert target.read_text() == f"import time\n\n{after}"
    assert _files(checkout) == ["megatron", "megatron/core", "megatron/core/package_info.py", "pretrain_gpt.py"]


def test_a_checkout_of_another_version_is_refused(tmp_path):
    before, _ = _hunk()
    checkout = _checkout(tmp_path, version="0.20.0", script=before)
    result = _apply(checkout)
    assert result.returncode == 1
    assert result.stderr == (
        f"apply_patch.sh: error: {checkout} is megatron-core 0.20.0 (from {checkout}/megatron/core/package_info.py), "
        f"but this patch is for tag core_v0.19.0 (megatron-core 0.19.1); check out that tag: "
        f"git -C {checkout} checkout core_v0.19.0\n"
    )
    assert (checkout / "pretrain_gpt.py").read_text() == before


def test_what_is_not_a_checkout_is_named(tmp_path):
    result = _apply(_checkout(tmp_path, version=None))
    assert result.stderr == (
        f"apply_patch.sh: error: {tmp_path}/megatron/core/package_info.py not found: {tmp_path} is not a "
        "Megatron-LM checkout\n"
    )
    result = _apply(_checkout(tmp_path))
    assert result.stderr == (
        f"apply_patch.sh: error: {tmp_path}/pretrain_gpt.py not found: {tmp_path} is not a Megatron-LM checkout\n"
    )
    usage = subprocess.run(["bash", str(APPLY)], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2
    assert usage.stderr == "usage: scripts/apply_patch.sh <Megatron-LM checkout at tag core_v0.19.0>\n"


def test_a_changed_script_is_refused_and_left_whole(tmp_path):
    before, _ = _hunk()
    changed = before.replace("# Timestamp", "# A local change: timestamp")
    checkout = _checkout(tmp_path, script=changed)
    result = _apply(checkout)
    assert result.returncode == 1
    assert result.stderr.startswith(f"apply_patch.sh: error: the patch does not fit {checkout}/pretrain_gpt.py")
    assert result.stderr.endswith(f"git -C {checkout} checkout core_v0.19.0 -- pretrain_gpt.py\n")
    assert (checkout / "pretrain_gpt.py").read_text() == changed
    assert _files(checkout) == ["megatron", "megatron/core", "megatron/core/package_info.py", "pretrain_gpt.py"]


def _run_as_main(script: Path, argv: list[str], monkeypatch) -> tuple[list | None, int | None]:
    """Run ``script`` as ``__main__`` with a stand-in ``megatron_paradyse.pretrain_gpt.main`` that
    records its argument and returns 3; returns (what main got or None, the exit status or None)."""
    called = []
    stand_in = types.ModuleType("megatron_paradyse.pretrain_gpt")
    stand_in.main = lambda argv: called.append(argv) or 3
    monkeypatch.setitem(sys.modules, stand_in.__name__, stand_in)
    monkeypatch.setattr(sys, "argv", [str(script), *argv])
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return (called[0] if called else None), e.code
    return (called[0] if called else None), None


def test_the_patched_lines_hand_the_command_line_to_paradyse_main(tmp_path, monkeypatch):
    """The patched ``__main__`` block of the fake checkout (only the patch's lines) is real Python."""
    _, after = _hunks()[-1]
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(f"import time\n{after}")
    for argv in (["--num-layers", "2", "--paradyse-config", "cfg.yaml"], ["--paradyse-config=cfg.yaml"], ["-h"]):
        assert _run_as_main(script, argv, monkeypatch) == (argv, 3)
    for argv in ([], ["--paradyse-configs", "x"], ["--num-layers", "2"]):
        assert _run_as_main(script, argv, monkeypatch) == (None, None)


_DRIVER = """
import runpy, sys, types
checkout, script, *argv = sys.argv[1:]
sys.path.insert(0, checkout)  # as `python pretrain_gpt.py` in the checkout: its megatron, gpt_builders, ...
stand_in = types.ModuleType("megatron_paradyse.pretrain_gpt")
stand_in.main = lambda argv: print("stand-in main got", argv) or 3
sys.modules[stand_in.__name__] = stand_in
sys.argv = [script, *argv]
runpy.run_path(script, run_name="__main__")
"""


@pytest.mark.skipif(CHECKOUT is None, reason="MEGATRON_LM_DIR is not set (a Megatron-LM checkout at core_v0.19.0)")
def test_the_patched_stock_script_reaches_paradyse(tmp_path):
    checkout = Path(CHECKOUT)
    copy = tmp_path / "megatron-lm"
    (copy / "megatron" / "core").mkdir(parents=True)
    shutil.copy(checkout / "megatron" / "core" / "package_info.py", copy / "megatron" / "core")
    shutil.copy(checkout / "pretrain_gpt.py", copy)  # the checkout itself stays as it is
    applied = _apply(copy)
    assert applied.returncode == 0, applied.stderr
    assert applied.stdout.startswith(("patched:", "already applied:"))

    def run(*argv: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", _DRIVER, str(checkout), str(copy / "pretrain_gpt.py"), *argv]
        return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)

    ours = run("--num-layers", "2", "--paradyse-config", "cfg.yaml")
    assert ours.returncode == 3, ours.stderr[-3000:]
    assert ours.stdout.endswith("stand-in main got ['--num-layers', '2', '--paradyse-config', 'cfg.yaml']\n")
    stock = run("--num-layers", "2", "--not-a-megatron-flag")  # Megatron's own parser, as before the patch
    assert stock.returncode == 2, stock.stderr[-3000:]
    assert stock.stderr.endswith("pretrain_gpt.py: error: unrecognized arguments: --not-a-megatron-flag\n")
    assert "stand-in" not in stock.stdout
