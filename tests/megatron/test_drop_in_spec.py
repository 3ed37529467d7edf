"""The drop-in layer spec in Megatron's unmodified training loop: ``megatron.training.pretrain`` with the stock
script's ``forward_step`` and Megatron's own datasets (``tests/helpers/scripts/stock_pretrain_gpt.py``), ``--spec
megatron_paradyse.spec get_paradyse_layer_spec``, no paradyse loop code. Each run's per-iteration losses
(Megatron's ``lm loss`` log) equal those of Megatron's stock local spec on the same batches within 1e-5.

The Paradyse runs plan every micro-batch themselves (the config ``PARADYSE_CONFIG`` names gives the
budget; no cost profile: the layers calibrate one at their first call); their budget makes the plans stream
weights (``lean``) or recompute.
"""

from __future__ import annotations

import argparse
import re
import types
from pathlib import Path

import pytest
import yaml

from helpers.job_ranks import launch
from helpers.paths import HELPERS

SCRIPT = HELPERS / "scripts" / "stock_pretrain_gpt.py"
GPT = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--seed", "1234",
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--num-layers", "2", "--hidden-size", "64",
    "--num-attention-heads", "4", "--ffn-hidden-size", "256", "--position-embedding-type", "rope",
    "--seq-length", "512", "--max-position-embeddings", "512", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-3", "--log-interval", "1",
    "--eval-iters", "0", "--eval-interval", "1000", "--transformer-impl", "local", "--distributed-backend", "gloo",
    "--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--no-rope-fusion",
]  # fmt: skip
STOCK = ["--spec", "megatron_paradyse.mcore.stock_spec", "stock_block_spec"]
PARADYSE = ["--spec", "megatron_paradyse.spec", "get_paradyse_layer_spec"]
TOLERANCE = 1e-5


def _train(folder: Path, *flags: str, config: Path | None = None) -> tuple[list[float], str]:
    """(Megatron's lm loss per iteration, stdout) of the stock-style script on 2 ranks."""
    env = None if config is None else {"PARADYSE_CONFIG": str(config)}
    result = launch(2, [str(SCRIPT), *GPT, *flags], folder, env=env)
    assert result.ok, result.output()
    losses = [float(x) for x in re.findall(r"\blm loss: ([-+.\dE]+)", result.stdout)]
    assert len(losses) == 4, result.stdout[-3000:]
    return losses, result.stdout


def test_the_drop_in_spec_trains_in_megatrons_own_loop_like_the_stock_spec(tmp_path):
    """No cost profile in the config: each tensor-parallel group calibrates on itself when its first layer
    runs, inside the forward (the loop leaves the job's random state and losses as the stock run's)."""
    config = tmp_path / "paradyse.yaml"
    config.write_text(yaml.safe_dump({"memory": {"budget_gib": 0.0052}, "data": {"cache_dir": str(tmp_path)}}))
    stock, _ = _train(tmp_path / "stock", *STOCK)
    paradyse, stdout = _train(tmp_path / "paradyse", *PARADYSE, config=config)
    assert paradyse == pytest.approx(stock, rel=TOLERANCE)
    assert "paradyse: no cost.profile: calibrating a quick profile for p=2 on the job's ranks" in stdout
    assert len(list(tmp_path.glob("cost-profile-quick-corrected-cpu-p2-float32-model*.json"))) == 1
    plans = re.findall(r"paradyse: stage 0: 512 tokens \(1 documents\) x 2: plan (.*) \(predicted", stdout)
    assert plans and all("lean" in plan or "+rc" in plan for plan in plans), stdout[-3000:]


def test_a_config_that_asks_the_drop_in_spec_to_learn_the_time_model_is_refused(tmp_path, monkeypatch):
    """The drop-in planner has no measured micro-batches to learn from: a config that asks for it is an error
    (raised on every rank, which all read the same file), not a setting silently ignored."""
    from megatron_paradyse.run import drop_in

    config = tmp_path / "paradyse.yaml"
    config.write_text(yaml.safe_dump({"memory": {"budget_gib": 1.0}, "planner": {"learn_time": True}}))
    monkeypatch.setenv(drop_in.CONFIG_ENV, str(config))
    with pytest.raises(ValueError) as error:
        drop_in._paradyse_config()
    assert str(error.value) == (
        f"{config}: planner.learn_time: the drop-in spec cannot learn the time model (it plans inside the layers, "
        "and Megatron's own loop gives the ranks no iteration boundary to agree on what they measured); set "
        "planner.learn_time: false, or train with "
        f"`python -m megatron_paradyse.pretrain_gpt --paradyse-config {config}`"
    )
    config.write_text(yaml.safe_dump({"memory": {"budget_gib": 1.0}, "planner": {"learn_time": False}}))
    assert drop_in._paradyse_config().memory.budget_gib == 1.0


def test_a_config_that_asks_the_drop_in_spec_to_skip_micro_batches_is_refused(tmp_path, monkeypatch):
    """Megatron's loop cannot leave a micro-batch out: ``on_infeasible: skip`` is refused when the config is
    read, instead of the layers failing on the missing plan at the first sequence no plan fits."""
    from megatron_paradyse.run import drop_in

    config = tmp_path / "paradyse.yaml"
    config.write_text(yaml.safe_dump({"memory": {"budget_gib": 1.0}, "planner": {"on_infeasible": "skip"}}))
    monkeypatch.setenv(drop_in.CONFIG_ENV, str(config))
    with pytest.raises(ValueError) as error:
        drop_in._paradyse_config()
    assert str(error.value) == (
        f"{config}: planner.on_infeasible: skip: the drop-in spec cannot skip a micro-batch (Megatron's own loop "
        "runs every one it is given); set planner.on_infeasible: stop, or train with "
        f"`python -m megatron_paradyse.pretrain_gpt --paradyse-config {config}`, which skips"
    )


def test_the_drop_in_planner_on_a_cpu_needs_the_configs_budget():
    """No device memory to size the budget by: the layers' first build says which setting to give."""
    import torch

    from megatron_paradyse.config import ParadyseConfig
    from megatron_paradyse.run import drop_in

    with pytest.raises(ValueError) as error:
        drop_in._budget_bytes(ParadyseConfig(), torch.device("cpu"), group=None)
    assert str(error.value) == (
        "the Paradyse layers need a memory budget on a machine without CUDA: set memory.budget_gib in the "
        "paradyse config PARADYSE_CONFIG names"
    )


def test_the_drop_in_planner_connects_its_tensor_parallel_group_before_it_measures(monkeypatch):
    """Every transfer the strategies make on the tensor-parallel group (collectives, and point-to-point to
    every rank of it) runs once before the budget is measured, so NCCL's buffers for them count in it."""
    import torch

    from megatron_paradyse.config import MemorySection, ParadyseConfig
    from megatron_paradyse.core.comm import StepGroup
    from megatron_paradyse.run import drop_in

    events = []
    monkeypatch.setattr(drop_in, "warm_communicators", lambda groups, device: events.append(("warmed", groups)))
    monkeypatch.setattr(drop_in, "allocator_capacity_bytes", lambda device, group: events.append("measured") or 2**30)
    config = ParadyseConfig(memory=MemorySection(margin=0.5))
    assert drop_in._budget_bytes(config, torch.device("cpu"), group="tp") == 2**29
    assert events == [("warmed", [StepGroup("tp", "all")]), "measured"]


def test_a_fused_cross_entropy_is_refused_by_the_drop_in_planner():
    """The cost model counts Megatron's unfused cross-entropy: a job with the fused one gets no planner
    that would count the wrong working set."""
    from megatron_paradyse.mcore import compat

    compat.install()  # before megatron.core is imported
    from megatron_paradyse.run.stage_planning import stage_cost_models

    fused = types.SimpleNamespace(cross_entropy_loss_fusion=True)
    with pytest.raises(ValueError) as error:
        stage_cost_models(argparse.Namespace(), fused, {}, [])
    assert str(error.value) == (
        "--cross-entropy-loss-fusion: the planner counts the memory of Megatron's unfused vocab-parallel "
        "cross-entropy; leave it out"
    )


def test_layers_outside_any_scope_without_the_drop_in_planner_say_how_to_get_one(monkeypatch):
    """A model built from ``mcore.spec`` (not ``megatron_paradyse.spec``, which installs the drop-in planner)
    and called outside any micro-batch scope: the layer refuses before any collective and says what to do."""
    import torch

    from megatron_paradyse.mcore import drop_in

    monkeypatch.setattr(drop_in, "_factory", None)
    layer = types.SimpleNamespace(tp_group=types.SimpleNamespace(size=lambda: 2), stage_layers=(0, 4))
    with pytest.raises(ValueError) as error:
        drop_in.implicit_micro_batch(layer, torch.zeros(4, 1, 8), None)
    assert str(error.value) == (
        "the Paradyse layers ran outside micro_batch_scope with no planner installed: build the spec with "
        "megatron_paradyse.spec.get_paradyse_layer_spec (which installs the drop-in planner), or plan the model's "
        "inputs yourself under `with micro_batch_scope(MicroBatch(layout=..., plan=...)):`"
    )
