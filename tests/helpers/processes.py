"""Processes a test started, or that the code under test started."""

from __future__ import annotations

from pathlib import Path


def running(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie, dead but not yet reaped by its parent, does not."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def marked(variable: str, value: str) -> list[int]:
    """The running processes whose environment sets ``variable`` to ``value``: a launch's marker, which every
    process its ranks start inherits, wherever it was reparented to."""
    entry = f"{variable}={value}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environment = (proc / "environ").read_bytes().split(b"\0")
        except (FileNotFoundError, PermissionError, ProcessLookupError):  # gone, or not ours
            continue
        if entry in environment and running(int(proc.name)):
            found.append(int(proc.name))
    return found
