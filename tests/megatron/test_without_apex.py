"""A model builds without apex and without Transformer Engine.

- Megatron's default ``gradient_accumulation_fusion=True`` needs apex's ``fused_weight_gradient_mlp_cuda``,
  and its ``ColumnParallelLinear`` refuses to be built without it (GPTModel's output layer too, whatever
  the layer spec). The Paradyse layers turn the fusion off, with a warning, before any linear module is
  built.
- Megatron's default ``apply_rope_fusion=True`` needs Transformer Engine's fused RoPE: without TE its
  ``TransformerConfig`` refuses a RoPE model. The entry point passes ``--no-rope-fusion`` where TE is
  missing, on CUDA too.

Neither this machine nor CI has apex or TE, nor do GPU machines that have only a CUDA build of torch.
"""

from __future__ import annotations

import importlib.util
import logging
import sys

import pytest

from megatron_paradyse.config import load_config
from megatron_paradyse.mcore import compat
from megatron_paradyse.mcore.trace import fake_world
from megatron_paradyse.run.job import add_paradyse_args, entry_defaults

from helpers.paths import CONFIGS

compat.install()

from megatron.core.tensor_parallel import layers  # noqa: E402

from helpers import megatron_harness as harness  # noqa: E402


@pytest.mark.parametrize("spec", ["paradyse_layer_spec", "get_paradyse_layer_spec"])
def test_the_model_builds_without_apex_with_the_fusion_turned_off(spec, caplog):
    assert not layers._grad_accum_fusion_available, "apex is installed here: this test needs a machine without it"
    config = harness.make_config("llama", tp=1, gradient_accumulation_fusion=True)  # Megatron's argument default
    with fake_world(0, 1):
        harness.parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
        harness.model_parallel_cuda_manual_seed(1234)
        try:
            with caplog.at_level(logging.WARNING, logger="megatron_paradyse.mcore.compat"):
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


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "cuda"])
def test_the_entry_points_flags_build_a_rope_models_config_without_transformer_engine(cuda, monkeypatch):
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_args, validate_args

    assert importlib.util.find_spec("transformer_engine") is None, "this test needs a machine without TE"
    config = load_config(CONFIGS / "llama3-8b.yaml")
    flags = [*entry_defaults(config, cuda=cuda), *config.megatron_args, "--tensor-model-parallel-size", "1"]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt", *flags])
    args = parse_args(extra_args_provider=add_paradyse_args)
    validate_args(args)  # as the job does, without setting Megatron's global arguments
    # without the entry point's --no-rope-fusion: "apply_rope_fusion is not available. Please install TE >= 1.4."
    assert gpt_config_from_args(args).transformer.apply_rope_fusion is False
