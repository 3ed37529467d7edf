"""The static memory the planner budgets for is counted from the config; the count must be exactly the
parameters Megatron builds on each rank, for every pipeline stage, GPT- and LLaMA-style. The optimizer
step's working set, counted beside it, holds Megatron's optimizer step measured on gloo ranks."""

from __future__ import annotations

import pytest

from megatron_paradyse.core.multiprocess import run_on_ranks

LAYOUTS = ((2, 1), (1, 2))  # (TP, PP) on 2 ranks


def _held_and_counted(rank: int, world: int) -> list[tuple[str, int, int]]:
    from megatron_paradyse.mcore.compat import cuda_to_cpu
    from megatron_paradyse.mcore.static_memory import OptimizerSetup, pipeline_footprints
    from megatron_paradyse.spec import get_paradyse_layer_spec

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from helpers import megatron_harness as h

    rows = []
    for tp, pp in LAYOUTS:
        h.init_parallel(tp, pp)
        stage = parallel_state.get_pipeline_model_parallel_rank()
        for variant in ("gpt", "llama"):
            for tied in (True, False):
                config = h.make_config(variant, tp, pp)
                with cuda_to_cpu():  # tied embeddings across stages are synchronised "on the GPU"
                    model = GPTModel(
                        config,
                        get_paradyse_layer_spec(config),
                        vocab_size=h.VOCAB,
                        max_sequence_length=512,
                        position_embedding_type="rope" if variant == "llama" else "learned_absolute",
                        share_embeddings_and_output_weights=tied,
                        pre_process=parallel_state.is_pipeline_first_stage(),
                        post_process=parallel_state.is_pipeline_last_stage(),
                    )
                footprint = pipeline_footprints(
                    config,
                    vocab_size=h.VOCAB,
                    tied_embeddings=tied,
                    learned_positions=0 if variant == "llama" else 512,
                    optimizer=OptimizerSetup("fused"),
                    grads_in_fp32=True,
                )[stage]
                held = sum(p.numel() for p in model.parameters())
                rows.append((f"{variant} tied={tied} TP{tp} PP{pp} stage {stage}", held, footprint.parameters))
                assert footprint.static_bytes == footprint.parameters * (4 + 4 + 8)  # fp32 Adam
    return rows


@pytest.mark.timeout(300)
def test_counted_parameters_are_those_megatron_builds():
    for rows in run_on_ranks(_held_and_counted, 2, timeout_s=240):
        for what, held, counted in rows:
            assert held == counted, what


def test_bytes_per_parameter_follow_megatron_mixed_precision_adam():
    """bf16 weight, fp32 main gradient, fp32 master weight and two moments (sharded by the distributed
    optimizer over the data-parallel ranks)."""
    from megatron_paradyse.mcore import compat

    compat.install()
    import torch

    from megatron_paradyse.mcore.static_memory import OptimizerSetup, pipeline_footprints

    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, params_dtype=torch.bfloat16, bf16=True
    )

    def per_parameter(optimizer_shards: int) -> float:
        (stage,) = pipeline_footprints(
            config,
            vocab_size=128,
            tied_embeddings=True,
            learned_positions=0,
            optimizer=OptimizerSetup("fused", shards=optimizer_shards),
            grads_in_fp32=True,
        )
        return stage.static_bytes / stage.parameters

    assert per_parameter(8) == 2 + 4 + 12 / 8
    assert per_parameter(1) == 18


# -- the optimizer step --------------------------------------------------------------------------------
STEP_DTYPES = ("float32", "bfloat16", "float16")
STEP_CASES = (  # (TP, optimizer, implementation, distributed optimizer) on 2 ranks: TP=1 is DP=2
    (1, "adam", "for-loop", False),
    (1, "adam", "for-loop", True),
    (1, "adam", "foreach", False),
    (1, "adam", "foreach", True),
    (1, "sgd", "for-loop", False),
    (1, "sgd", "foreach", False),
    (2, "adam", "for-loop", False),
    (2, "adam", "foreach", False),
)
COUNTED_SHARE = {"for-loop": {"adam": 2 / 3, "sgd": 1.0}, "foreach": {"adam": 0.98, "sgd": 0.98}}
"""The least share of the counted working set the step must measure: the for-loop bound counts three of
the largest parameter where AdamW holds two and the previous parameter's quotient; foreach counts every
parameter where Megatron's weight-decay group leaves out the norms."""
SCALARS = 64
"""Bytes of the step's scalar tensors (the gradient norm, the loss scaler's flags), not counted."""


def _optimizer_step_peaks(rank: int, world: int) -> list[tuple[str, float, float]]:
    """(case, measured, counted) of one step of Megatron's optimizer after its state exists, per case."""
    import contextlib
    import functools
    import itertools

    import torch

    from megatron_paradyse.core.memory import peak_bytes_of
    from megatron_paradyse.mcore.compat import cuda_to_cpu
    from megatron_paradyse.mcore.static_memory import OptimizerSetup, pipeline_footprints

    from megatron.core import optimizer as megatron_optimizer
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from helpers import megatron_harness as h  # first: megatron-core's CPU patches

    h.freeze_what_lives_now()

    @contextlib.contextmanager
    def foreach_optimizers():
        """torch's optimizers as they default on CUDA, for Megatron to build."""
        saved = torch.optim.AdamW, megatron_optimizer.SGD
        torch.optim.AdamW = functools.partial(saved[0], foreach=True)
        megatron_optimizer.SGD = functools.partial(saved[1], foreach=True)
        try:
            yield
        finally:
            torch.optim.AdamW, megatron_optimizer.SGD = saved

    rows = []
    for (tp, name, implementation, distributed), dtype_name in itertools.product(STEP_CASES, STEP_DTYPES):
        h.init_parallel(tp)
        dtype = getattr(torch, dtype_name)
        half = dict(bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
        config = h.make_config("llama", tp, params_dtype=dtype, pipeline_dtype=dtype, **half)
        model = h.build_gpt(config, h.stock_block_spec(config), seed=1)
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=distributed, grad_reduce_in_fp32=dtype != torch.float32
        )
        ddp = DistributedDataParallel(config, ddp_config, model)
        optimizer_config = OptimizerConfig(
            optimizer=name,
            lr=1e-3,
            clip_grad=1.0,
            params_dtype=dtype,
            use_distributed_optimizer=distributed,
            loss_scale=1.0 if half["fp16"] else None,
            **half,
        )
        built = foreach_optimizers() if implementation == "foreach" else contextlib.nullcontext()
        with built, cuda_to_cpu():
            optimizer = get_megatron_optimizer(optimizer_config, [ddp])
        batch = h.Batch.make((40,), tp, seed=rank)
        for _ in range(2):  # the first step makes the optimizer's state: the step measured is the next
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            h.stock_loss(ddp, batch).backward()
            with cuda_to_cpu():
                finalize_model_grads([ddp])
                measured = peak_bytes_of(optimizer.step)
        setup = OptimizerSetup(implementation, name=name, shards=world // tp if distributed else 1)
        (footprint,) = pipeline_footprints(
            config, vocab_size=h.VOCAB, tied_embeddings=False, learned_positions=0, optimizer=setup, grads_in_fp32=True
        )
        case = f"TP{tp} {name} {implementation}{' distributed' if distributed else ''} {dtype_name}"
        rows.append((case, measured, footprint.optimizer_step_bytes))
    return rows


@pytest.mark.timeout(300)
def test_the_optimizer_step_holds_what_is_counted_for_it():
    """Megatron's optimizer (Adam, SGD with momentum; weight decay, gradient clipping, the distributed
    optimizer over two data-parallel ranks), torch's for-loop and foreach implementations, fp32, bf16 and
    fp16 (fp32 main parameters): one step's working set is within what the footprint counts for it, and
    more than :data:`COUNTED_SHARE` of it."""
    for rows in run_on_ranks(_optimizer_step_peaks, 2, timeout_s=240):
        for case, measured, counted in rows:
            implementation, name = case.split()[2], case.split()[1]
            assert COUNTED_SHARE[implementation][name] * counted <= measured <= counted + SCALARS, (case, measured)


def test_the_optimizer_implementation_is_the_one_megatron_imported():
    """Without Transformer Engine or apex, Megatron steps with torch's optimizers: foreach on CUDA,
    for-loop on CPU; the working set of a fused step is nothing."""
    from megatron_paradyse.mcore import compat

    compat.install()
    from megatron_paradyse.mcore.static_memory import OptimizerSetup, megatron_optimizer_implementation

    import megatron.core.optimizer as megatron_optimizer

    assert megatron_optimizer.USING_PYTORCH_OPTIMIZER
    assert [megatron_optimizer_implementation(device) for device in ("cuda", "cpu")] == ["foreach", "for-loop"]
    assert OptimizerSetup("fused").step_bytes(10**6, 10**5) == 0
    assert OptimizerSetup("foreach", shards=4).step_bytes(10**6, 10**5) == 4 * 250_000
    assert OptimizerSetup("for-loop", name="sgd", weight_decay=False).step_bytes(10**6, 10**5) == 0
    with pytest.raises(ValueError, match=r"^--optimizer lion: the planner counts the memory of adam and sgd only"):
        OptimizerSetup("fused", name="lion")
