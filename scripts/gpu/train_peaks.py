"""One rank of ``megatron_paradyse.pretrain_gpt`` on a GPU, then the whole run's allocator figures.

    torchrun --standalone --nproc-per-node 1 scripts/gpu/train_peaks.py --paradyse-config scripts/gpu/<config>.yaml

The per-micro-batch meter (``log.measure: true``) resets the allocator's peak statistics before each
micro-batch; this script keeps the largest values seen before every reset, so that its last line gives
the run's: the most allocated and reserved, what the device had in use at the end (the CUDA context
and libraries' workspaces outside the caching allocator included), the device's size, and whether the
allocator's segments are expandable (the entry point turns them on: ``core/allocator.py``). Its runs are in
benchmarks/results/ (``train-peaks_*``).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from megatron_paradyse import pretrain_gpt

_peaks = {"allocated": 0, "reserved": 0}
_reset_peaks = torch.cuda.reset_peak_memory_stats


def _keep_peaks_then_reset(device=None) -> None:
    _peaks["allocated"] = max(_peaks["allocated"], torch.cuda.max_memory_allocated(device))
    _peaks["reserved"] = max(_peaks["reserved"], torch.cuda.max_memory_reserved(device))
    _reset_peaks(device)


def main() -> int:
    torch.cuda.reset_peak_memory_stats = _keep_peaks_then_reset
    status = pretrain_gpt.main(sys.argv[1:])
    if not torch.cuda.is_initialized():
        return status
    _keep_peaks_then_reset()
    free, total = torch.cuda.mem_get_info()
    segments = torch.cuda.memory._snapshot()["segments"]
    figures = {
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "expandable": sorted({str(segment["is_expandable"]) for segment in segments}),
        "max_allocated": _peaks["allocated"],
        "max_reserved": _peaks["reserved"],
        "reserved_at_end": torch.cuda.memory_reserved(),
        "device_used_at_end": total - free,
        "device_total": total,
    }
    print("RUN_ALLOCATOR " + json.dumps(figures), flush=True)
    return status


if __name__ == "__main__":  # the start-up calibration spawns processes that import this module
    sys.exit(main())
