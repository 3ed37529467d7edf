"""The CUDA caching allocator's setting that the memory budget relies on: expandable segments.

The cost model predicts what tensors allocate: on an H200, within 0.07% of ``max_memory_allocated``
(``bench allocator``). The device must also hold what the caching allocator reserves around them.
With its defaults, a run switching plans across 65K, 4K and 16K tokens reserved 1.38x the most it
allocated: blocks cached at one length's sizes that the next length cannot reuse, far more than
``memory.margin`` (3%) keeps free. With expandable segments it reserved 1.03x. So the entry point turns them
on unless the job configures the allocator itself, and a job on CUDA whose own settings leave them off is
told so. Torch reads the variables once, when CUDA initialises; on a CPU they do nothing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping

__all__ = ["EXPANDABLE_SEGMENTS", "expandable_segments_off", "prefer_expandable_segments"]

EXPANDABLE_SEGMENTS = "expandable_segments:True"
_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch's name, and the older one it still reads
_EXPANDABLE = re.compile(r"(?:^|,)\s*expandable_segments\s*:\s*(\w+)", re.IGNORECASE)


def prefer_expandable_segments(environ: MutableMapping[str, str] = os.environ) -> None:
    """Expandable segments for this process, unless the job configures the allocator (either variable
    set). Call before CUDA initialises."""
    if not any(environ.get(name) for name in _VARIABLES):
        environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS


def expandable_segments_off(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why the allocator may reserve more than the budget allows, where this process's settings leave
    expandable segments off (the allocator's default); None where they are on."""
    settings = {name: environ[name] for name in _VARIABLES if environ.get(name)}
    values = [m.group(1).lower() for v in settings.values() for m in _EXPANDABLE.finditer(v)]
    if values and all(value == "true" for value in values):
        return None
    where = " and ".join(f"{name}={value}" for name, value in settings.items()) or "the defaults"
    where += " leaves" if len(settings) == 1 else " leave"
    return (
        f"{where} the CUDA caching allocator's expandable segments off: a run switching plans across lengths "
        f"can then reserve well over what it allocates (1.38x on an H200, bench allocator), more than "
        f"memory.margin keeps free; set PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE_SEGMENTS} (or add it to the "
        f"settings) before the job starts"
    )
