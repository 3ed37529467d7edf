"""``scripts/gpu/step_breakdown.py`` on a Chrome trace made here: the kernels by kind, overlapping streams
counted once, the device's idle time inside the span, and its refusal of a trace without GPU work."""

from __future__ import annotations

import gzip
import json
import pathlib
import subprocess
import sys

from helpers.paths import ROOT


def _kernel(name: str, ts: float, dur: float, cat: str = "kernel", stream: int = 7) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": stream}


def _run(path: pathlib.Path) -> subprocess.CompletedProcess:
    script = ROOT / "scripts" / "gpu" / "step_breakdown.py"
    return subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=60)


def test_a_traced_step_is_split_into_kernel_kinds_and_idle_time(tmp_path):
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 5000.0},  # host work: not counted
        _kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 1000.0, 400.0),
        _kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 1500.0, 600.0),
        _kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 2100.0, 300.0),
        _kernel("ncclDevKernel_AllGather_RING_LL", 2200.0, 500.0, stream=20),  # beside the attention kernel
        _kernel("Memcpy HtoD (Pinned -> Device)", 3000.0, 50.0, cat="gpu_memcpy"),
        _kernel("vectorized_elementwise_kernel<4, CUDAFunctor_add>", 3950.0, 50.0),
    ]
    path = tmp_path / "rank-0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    result = _run(path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # span 1000..4000 us; busy: 1000-1400, 1500-2700 (attention and the gather overlap), 3000-3050, 3950-4000
    assert lines[-1] == (
        "span_ms=3.00 busy_ms=1.70 idle_ms=1.30 gemm_ms=1.00 attention_ms=0.30 communication_ms=0.50 "
        "copy_ms=0.05 other_ms=0.05"
    )
    assert lines[0].split() == ["1.00", "ms", "2x", "gemm", "sm90_xmma_gemm_bf16bf16_bf16f32"]
    assert lines[1].split()[2:4] == ["1x", "communication"]


def test_a_trace_without_gpu_work_is_refused(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}]}))
    result = _run(path)
    assert result.returncode == 2
    assert f"{path}: the trace holds no GPU kernels: profile a CUDA run (--use-pytorch-profiler)" in result.stderr
