"""A stand-in for the ``wandb`` package, which cannot reach its service from the test machines.

Megatron's ``--wandb-project`` imports ``wandb`` on the last rank and uses the module as its W&B writer;
a test puts this folder's parent first on ``PYTHONPATH`` and names a file in ``WANDB_STAND_IN_LOG``:
every call is appended there as one JSON line (``{"call": "log", "data": {...}, "step": 3}``).
"""

import json
import os


class _Config:
    def update(self, values, *args, **kwargs) -> None:
        _record("config.update", values=values)


config = _Config()


def init(**kwargs) -> None:
    _record("init", project=kwargs.get("project"), name=kwargs.get("name"))


def log(data, step=None, **kwargs) -> None:
    _record("log", data=data, step=step)


def finish(*args, **kwargs) -> None:
    _record("finish")


def _record(call: str, **fields) -> None:
    with open(os.environ["WANDB_STAND_IN_LOG"], "a") as f:
        f.write(json.dumps({"call": call, **fields}, default=_plain) + "\n")


def _plain(value):
    """Tensors and numbers as floats, anything else as its text."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)
