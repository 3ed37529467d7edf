"""A run of Megatron's own ``pretrain_gpt`` continues under the entry point: ``--load`` of its checkpoint, no
``--finetune``.

Megatron's stock script (``helpers/scripts/stock_pretrain_gpt.py``: its local spec, Megatron's mock dataset) trains
two of three iterations and saves (its default distributed checkpoint); ``python -m
megatron_paradyse.pretrain_gpt --load`` of that folder runs the third: the iteration count goes on, the
optimizer state is the saved one (its Adam moments go on from the saved ones), and the data starts from
the beginning of the paradyse dataset, with one line saying why. Both runs are 2 gloo ranks (TP=2); the
cost profile is calibrated once for the whole run (``quick_profile_p2``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from megatron_paradyse.data import ByteTokenizer, DocumentDataset
from megatron_paradyse.data.corpora import build_code_corpus
from megatron_paradyse.data.subset import spread_by_length
from megatron_paradyse.run.log import read_jsonl

from helpers.job_ranks import Job, launch
from helpers.paths import HELPERS

STOCK_SCRIPT = HELPERS / "scripts" / "stock_pretrain_gpt.py"
DOCS = {"num_documents": 6, "min_len": 128, "max_len": 1024}
# Both runs: the same model, layout, batch and schedule (Megatron checks the schedule against the
# checkpoint's).
SHARED = [
    "--seed", "1234", "--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "64",
    "--num-attention-heads", "4", "--ffn-hidden-size", "256", "--position-embedding-type", "rope",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--global-batch-size", "2", "--lr", "1e-3",
    "--log-interval", "1", "--train-iters", "3", "--save-interval", "2",
]  # fmt: skip
# What the entry point sets itself (megatron_paradyse.run.job.entry_defaults), for the stock script on Megatron's
# mock data; the vocabulary is the code corpus's, the one the entry point gives NullTokenizer.
STOCK = [
    "--spec", "megatron_paradyse.mcore.stock_spec", "stock_block_spec", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", str(ByteTokenizer().vocab_size), "--sequence-parallel",
    "--seq-length", "256",
    "--max-position-embeddings", "256", "--micro-batch-size", "1", "--eval-iters", "0", "--eval-interval", "1000",
    "--transformer-impl", "local", "--distributed-backend", "gloo", "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-rope-fusion",
]  # fmt: skip
BETA1, BETA2, WEIGHT_DECAY = 0.9, 0.999, 0.01  # Megatron's Adam defaults


def _job(folder: Path, *program: str) -> Job:
    result = launch(2, program, folder)
    assert result.ok, result.output()
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory, quick_profile_p2) -> dict:
    folder = tmp_path_factory.mktemp("stock")
    cache = folder / "cache"
    build_code_corpus(cache)
    config = folder / "cfg.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "memory": {"budget_gib": 0.25},
                "cost": {"profile": str(quick_profile_p2), "check_machine": False},
                "data": {"dataset": "code", "cache_dir": str(cache), **DOCS},
                "log": {"jsonl": "log.jsonl"},
            }
        )
    )
    stock = folder / "stock-ckpt"
    _job(folder / "stock-ranks", str(STOCK_SCRIPT), *SHARED, *STOCK, "--save", str(stock), "--exit-interval", "2")
    assert (stock / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    saved = folder / "ckpt"
    result = _job(
        folder / "ranks", "-m", "megatron_paradyse.pretrain_gpt", "--paradyse-config", str(config), *SHARED,
        "--load", str(stock), "--save", str(saved),
    )  # fmt: skip
    return {
        "stdout": result.stdout,
        "log": read_jsonl(folder / "log.jsonl"),
        "cache": cache,
        "stock": _read_checkpoint(stock / "iter_0000002", folder / "2.pt"),
        "continued": _read_checkpoint(saved / "iter_0000003", folder / "3.pt"),
    }


def _read_checkpoint(folder: Path, into: Path) -> dict:
    """A distributed checkpoint's tensors and common state, whole (no process group needed)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from megatron_paradyse.mcore import compat

    compat.install()  # the common state holds Megatron's argument namespace
    dcp_to_torch_save(folder, into)
    return torch.load(into, weights_only=False)


def _common(checkpoint: dict) -> dict:
    (state,) = (value[0] for key, value in checkpoint.items() if key.startswith("common_state/"))
    return state


def test_the_iteration_count_continues_and_the_data_restarts_with_one_line(runs):
    lines = [line for line in runs["stdout"].splitlines() if "data-loader position" in line]
    assert len(lines) == 1, lines  # one line, from the last rank
    assert re.fullmatch(
        r"paradyse: the checkpoint of iteration 2 in \S+stock-ckpt has no data-loader position of this entry point "
        r"\(Megatron's own pretrain_gpt saves none\): the model, optimizer state and iteration count continue, the "
        r"data starts from its beginning \(the checkpoint's 4 consumed samples count another dataset's order\)",
        lines[0],
    ), lines[0]
    assert [r.iteration for r in runs["log"]] == [3]
    assert _common(runs["continued"])["iteration"] == 3
    lengths = DocumentDataset(build_code_corpus(runs["cache"])).lengths
    shortest = sorted(lengths[spread_by_length(lengths, *DOCS.values())])[:2]
    assert [mb.tokens for mb in runs["log"][0].micro_batches] == shortest  # a fresh run's first step


def test_the_model_and_the_optimizer_state_are_the_saved_ones(runs):
    """Step 3 (torch's AdamW, Megatron's fallback without apex) goes on from the saved weights w2 and moments
    (m2, v2): with the gradient g its first moment implies, m3 = b1 m2 + (1 - b1) g, its second moment is
    v3 = b2 v2 + (1 - b2) g^2 and its weights w3 = w2 (1 - lr wd) - lr m3 / (1 - b1^3) / (sqrt(v3 / (1 - b2^3)) + eps).
    From a fresh optimizer (zero moments, step 1) or freshly initialised weights neither would hold."""
    stock, continued = runs["stock"], runs["continued"]
    saved = _common(stock)["optimizer"]
    assert saved["state"]["common_step"] == 2
    assert _common(continued)["optimizer"]["state"]["common_step"] == 3
    lr, eps = saved["param_groups"][0]["lr"], saved["param_groups"][0]["eps"]  # the rate step 3 runs at
    names = [k.removeprefix("optimizer.state.exp_avg.") for k in stock if k.startswith("optimizer.state.exp_avg.")]
    assert len(names) > 10
    for name in names:
        m2, v2 = stock[f"optimizer.state.exp_avg.{name}"], stock[f"optimizer.state.exp_avg_sq.{name}"]
        m3, v3 = continued[f"optimizer.state.exp_avg.{name}"], continued[f"optimizer.state.exp_avg_sq.{name}"]
        g = (m3 - BETA1 * m2) / (1 - BETA1)
        torch.testing.assert_close(v3, BETA2 * v2 + (1 - BETA2) * g * g, rtol=1e-4, atol=1e-6 * float(v3.abs().max()))
        weight_decay = 0.0 if name.endswith("bias") or "norm" in name else WEIGHT_DECAY  # Megatron's no-decay rule
        step = lr / (1 - BETA1**3) * m3 / ((v3 / (1 - BETA2**3)).sqrt() + eps)
        torch.testing.assert_close(continued[name], stock[name] * (1 - lr * weight_decay) - step, msg=name)
