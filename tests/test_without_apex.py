"""A model builds without apex: Megatron's default ``gradient_accumulation_fusion=True`` needs apex's
``fused_weight_gradient_mlp_cuda``, and its ``ColumnParallelLinear`` refuses to be built without it
(GPTModel's output layer too, whatever the layer spec). The Paradyse layers turn the fusion off, with a
warning, before any linear module is built. Neither this machine nor CI has apex, nor do GPU machines
that have only a CUDA build of torch.
"""

from __future__ import annotations

import logging

import pytest

from megatron_paradyse.core import compat
from megatron_paradyse.mcore.trace import fake_world

compat.install()

import megatron_harness as harness  # noqa: E402
from megatron.core.tensor_parallel import layers  # noqa: E402


@pytest.mark.parametrize("spec", ["paradyse_layer_spec", "get_paradyse_layer_spec"])
def test_the_model_builds_without_apex_with_the_fusion_turned_off(spec, caplog):
    assert not layers._grad_accum_fusion_available, "apex is installed here: this test needs a machine without it"
    config = harness.make_config("llama", tp=1, gradient_accumulation_fusion=True)  # Megatron's argument default
    with fake_world(0, 1):
        harness.parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
        harness.model_parallel_cuda_manual_seed(1234)
        try:
            with caplog.at_level(logging.WARNING, logger="megatron_paradyse.core.compat"):
                model = harness.build_gpt_from_spec_flag(config, spec)
        finally:
            harness.parallel_state.destroy_model_parallel()
    assert not config.gradient_accumulation_fusion
    assert not model.output_layer.gradient_accumulation_fusion
    warnings = [r.getMessage() for r in caplog.records if "gradient_accumulation_fusion" in r.getMessage()]
    assert warnings == [
        "paradyse: gradient_accumulation_fusion turned off: its kernel, apex's fused_weight_gradient_mlp_cuda, is "
        "not installed (pass --no-gradient-accumulation-fusion to say so yourself)"
    ]
