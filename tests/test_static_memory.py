"""The static memory the planner budgets for is counted from the config; the count must be exactly the
parameters Megatron builds on each rank, for every pipeline stage, GPT- and LLaMA-style."""

from __future__ import annotations

import pytest

from megatron_paradyse.core.multiprocess import run_on_ranks

LAYOUTS = ((2, 1), (1, 2))  # (TP, PP) on 2 ranks


def _held_and_counted(rank: int, world: int) -> list[tuple[str, int, int]]:
    import megatron_harness as h
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_paradyse.core.compat import cuda_to_cpu
    from megatron_paradyse.mcore.static_memory import pipeline_footprints
    from megatron_paradyse.spec import get_paradyse_layer_spec

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
                    optimizer_states=2,
                    grads_in_fp32=True,
                    optimizer_shards=1,
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
    from megatron_paradyse.core import compat

    compat.install()
    import torch
    from megatron.core.transformer import TransformerConfig

    from megatron_paradyse.mcore.static_memory import pipeline_footprints

    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, params_dtype=torch.bfloat16, bf16=True
    )

    def per_parameter(optimizer_shards: int) -> float:
        (stage,) = pipeline_footprints(
            config,
            vocab_size=128,
            tied_embeddings=True,
            learned_positions=0,
            optimizer_states=2,
            grads_in_fp32=True,
            optimizer_shards=optimizer_shards,
        )
        return stage.static_bytes / stage.parameters

    assert per_parameter(8) == 2 + 4 + 12 / 8
    assert per_parameter(1) == 18
