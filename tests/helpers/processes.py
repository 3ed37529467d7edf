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


def marked(variable: str, value: str, held: Path | None = None) -> list[int]:
    """The running processes whose environment sets ``variable`` to ``value``, or that hold the file ``held``
    open: a launch's marks, which every process its ranks start inherits (an executed one the environment,
    a forked one the open file), wherever it was reparented to."""
    entry = f"{variable}={value}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environment = (proc / "environ").read_bytes().split(b"\0")
            holds = held is not None and any(_points_to(fd, held) for fd in (proc / "fd").iterdir())
        except (FileNotFoundError, PermissionError, ProcessLookupError):  # gone, or not ours
            continue
        if (entry in environment or holds) and running(int(proc.name)):
            found.append(int(proc.name))
    return found


def _points_to(fd: Path, path: Path) -> bool:
    try:
        return Path(fd.readlink()) == path
    except (FileNotFoundError, OSError):  # closed meanwhile
        return False
