"""What measuring memory on CPU changes in the run it measures: autograd's gradient sums.

    python scripts/dispatch_mode_peaks.py          # one process on the CPU, about 85 s

The CPU storage tracker (``core.memory``) and the fake traces (``FakeTensorMode``) are dispatch modes.
While one is on, autograd adds the gradients of a tensor used twice out of place (a new tensor, then
the two die: ATen's ``isTensorSubclassLike`` holds for every tensor while a mode is on); a run without
one, as CUDA training is, adds in place where its buffer holds the last reference. The memory model
counts what the tracker measures. This script runs one micro-batch of a two-layer GPTModel (the
Paradyse spec, TP=1) under several plans, fp32 and bf16, GPT- and LLaMA-style, and prints the CPU
allocator's own peak (the profiler's memory events: every allocation, no mode) with and without a
pass-through mode around the step: the difference is what the mode alone changes. The allocator also
counts what kernels allocate inside themselves, which the tracker cannot see (a case far above its
neighbours in both columns is worth a look: that is how 316d33a's per-token GEMM was found). The
last line is ``mode_changed=<cases> cases=<n> mode_over_plain_max=<percent>``; its runs are in benchmarks/results/
(``dispatch-mode-peaks_*``).
"""

from __future__ import annotations

import gc
import itertools

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.mcore import compat

PLANS = ("tp_sp/tp_sp", "tp_sp/tp_sp+rc", "lean/lean", "tp_sp/tp_sp+tile256")
VARIANTS = {
    "gpt": dict(normalization="LayerNorm"),
    "llama": dict(
        normalization="RMSNorm",
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        num_query_groups=2,
    ),
}
TOKENS = 2000


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing but being on."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def cpu_allocator_peak_bytes(work) -> int:
    """The CPU allocator's own high-water mark during ``work()`` above its start, from the profiler's
    allocation records (each carries the allocator's running total; ``torch.profiler._memory_profiler``
    reads the same). Unlike the storage tracker it sees what kernels allocate inside themselves, and it
    turns no dispatch mode on."""
    gc.collect()
    gc.disable()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            work()
    finally:
        gc.enable()
    records = []
    nodes = list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if isinstance(node.extra_fields, torch._C._profiler._ExtraFields_Allocation):
            records.append((node.start_time_ns, node.extra_fields.total_allocated, node.extra_fields.alloc_size))
    records.sort()
    _, first_total, first_size = records[0]
    return max(total for _, total, _ in records) - (first_total - first_size)


def _peaks(rank: int, world_size: int) -> list[tuple[str, str, str, int, int]]:
    """``(dtype, model, plan, plain peak, peak under a mode)`` per case, in one gloo process (TP=1)."""
    compat.install()
    from megatron_paradyse.core.micro_batch import MicroBatch
    from megatron_paradyse.core.plan import Plan
    from megatron_paradyse.data import make_micro_batch
    from megatron_paradyse.mcore.chunked_loss import micro_batch_loss
    from megatron_paradyse.mcore.spec import get_paradyse_layer_spec
    from megatron_paradyse.mcore.step_buffers import release_step_buffers

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1)
    cases = []
    for dtype, variant in itertools.product((torch.float32, torch.bfloat16), VARIANTS):
        config = TransformerConfig(
            num_layers=2,
            hidden_size=256,
            num_attention_heads=4,
            ffn_hidden_size=1024,
            use_cpu_initialization=True,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **VARIANTS[variant],
        )
        torch.manual_seed(0)
        model = GPTModel(
            config,
            get_paradyse_layer_spec(config),
            vocab_size=512,
            max_sequence_length=TOKENS,
            position_embedding_type="rope",
        )
        for param in model.parameters():
            param.grad = torch.zeros_like(param)  # Megatron's gradient buffer: there before the step
        batch = make_micro_batch(
            [np.random.default_rng(0).integers(0, 512, TOKENS)], [False], p=1, causal=True, pad_id=0
        )
        for plan_name in PLANS:
            micro_batch = MicroBatch(layout=batch["layout"], plan=Plan.from_options([plan_name] * config.num_layers))

            def step(model=model, batch=batch, micro_batch=micro_batch) -> None:
                release_step_buffers()
                micro_batch_loss(model, batch, micro_batch).backward()

            def step_under_a_mode(step=step) -> None:
                with _PassThrough():
                    step()

            step()  # nothing lazily made is counted
            plain = min(cpu_allocator_peak_bytes(step) for _ in range(3))
            moded = min(cpu_allocator_peak_bytes(step_under_a_mode) for _ in range(3))
            cases.append((str(dtype).removeprefix("torch."), variant, plan_name, plain, moded))
    return cases


def main() -> int:
    print(f"{'dtype':9} {'model':5} {'plan':20} {'plain B':>12} {'with a mode B':>14} {'mode/plain':>10}")
    excess = []
    for dtype_name, variant, plan_name, plain, moded in run_on_ranks(_peaks, 1, timeout_s=1200)[0]:
        excess.append(moded / plain - 1)
        print(f"{dtype_name:9} {variant:5} {plan_name:20} {plain:>12,} {moded:>14,} {moded / plain:>10.4f}")
    changed = sum(e != 0 for e in excess)
    print(f"mode_changed={changed} cases={len(excess)} mode_over_plain_max={100 * max(excess):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
