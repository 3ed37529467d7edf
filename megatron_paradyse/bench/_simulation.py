"""The simulation behind ``bench simulate`` (:mod:`megatron_paradyse.bench.simulate`): the paper's setting
(its datasets, models and static strategy pairs), the runs planned on it, and each run's curve over a
length-sorted dataset. **Nothing here is measured**: the planner and the analytic cost model run on cost
profiles built from published figures (:mod:`megatron_paradyse.cost.hardware`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from megatron_paradyse.config import MemorySection, load_config
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.base import WHOLE_LOSS, CostModel, LayerCost, StageOptions
from megatron_paradyse.cost.hardware import NodeSpec
from megatron_paradyse.data.corpora import (
    GITHUBCODE_MAX_LEN,
    GITHUBCODE_SHARES,
    GRCH38_MAX_LEN,
    GRCH38_SHARES,
)
from megatron_paradyse.planner import Planner, PlannerConfig
from megatron_paradyse.run.config_cli import model_shape_from_args
from megatron_paradyse.run.megatron_flags import parse_megatron_args
from megatron_paradyse.simulation.curves import Curve, Run, longest_fitting, simulate_curve
from megatron_paradyse.simulation.node import NodeModel
from megatron_paradyse.simulation.tuned import TunedBaseline, tuned_megatron
from megatron_paradyse.strategies import ModelShape

__all__ = [
    "CONFIGS",
    "Curve",
    "DATASETS",
    "DatasetSpec",
    "MODELS",
    "MemoCostModel",
    "ModelSpec",
    "Run",
    "STATIC_PAIRS",
    "Setting",
    "load_paper_model",
    "paper_node",
    "simulate_curve",
    "simulate_setting",
]

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    name: str
    shares: tuple[float, ...]
    """Percent of sequences per length bin (paper, Table 3)."""
    max_len: int
    vocab_size: int
    """Of its tokenizer: GPT-2 for GitHubCode, 3-mers for GRCh38; used only with ``--head``."""


DATASETS = {
    "githubcode": DatasetSpec(
        name="GitHubCode", shares=GITHUBCODE_SHARES, max_len=GITHUBCODE_MAX_LEN, vocab_size=50257
    ),
    # 4^3 3-mers and DNABERT's five special tokens
    "grch38": DatasetSpec(name="GRCh38", shares=GRCH38_SHARES, max_len=GRCH38_MAX_LEN, vocab_size=69),
}
MODELS = {"bert": "BERT", "llama": "LLaMA", "gpt": "GPT"}
"""The paper's models (``configs/paper-<key>.yaml``), by key."""
STATIC_PAIRS = {
    "tp_sp/tp_sp": "MegatronTS",
    "ulysses/zero3": "UlyssesZ",
    "ring/zero3": "MegatronCZ",
    "lean/lean": "METP",
}
"""The paper's static strategies: each a uniform plan of one (attention, MLP) pair."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    shape: ModelShape
    num_layers: int
    """Transformer layers on the node."""
    causal: bool
    planner: PlannerConfig
    """The adaptive planner of the paper's setting (its pairs, no recompute, gamma)."""
    memory: MemorySection
    """The preset's memory section: its margin sizes the budget."""


class MemoCostModel:
    """A cost model whose layer costs are computed once per (option, padded length, mask, batch): the
    runs of one setting share them (ring and lean price every rank's ring hops, which is the slow part)."""

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self._costs: dict[tuple, LayerCost] = {}

    def layer_cost(self, option: LayerOption, layout: SequenceLayout, micro_batch_size: int) -> LayerCost:
        key = (option, layout.padded_len, layout.causal, layout.doc_lengths, micro_batch_size)
        if key not in self._costs:
            self._costs[key] = self.model.layer_cost(option, layout, micro_batch_size)
        return self._costs[key]

    def peak_bytes(self, layout, micro_batch_size, saved_bytes, transient_bytes, stage=WHOLE_LOSS) -> float:
        return self.model.peak_bytes(layout, micro_batch_size, saved_bytes, transient_bytes, stage)

    def stage_options(self, loss_chunk_tokens: int) -> tuple[StageOptions, ...]:
        return self.model.stage_options(loss_chunk_tokens)

    def stage_time_s(self, layout, micro_batch_size, stage) -> float:
        return self.model.stage_time_s(layout, micro_batch_size, stage)


# -- the setting ------------------------------------------------------------------------------------
def paper_runs(adaptive: PlannerConfig) -> list[Run]:
    """The paper's four static strategies, its adaptive planner, and one beyond it."""
    stop = dataclasses.replace(adaptive, on_infeasible="stop")
    runs = [
        Run(name=pair, paper_name=paper, planner=dataclasses.replace(stop, pairs=(pair,)), static=True)
        for pair, paper in STATIC_PAIRS.items()
    ]
    runs.append(Run(name="adaptive", paper_name="ParaDySe", planner=stop, static=False))
    beyond = PlannerConfig(recompute=True, hysteresis=adaptive.cache.hysteresis, on_infeasible="stop")
    runs.append(Run(name="beyond", paper_name="(not in the paper)", planner=beyond, static=False))
    return runs


def ablation_runs(adaptive: PlannerConfig) -> list[Run]:
    """Table 5's variants that a cost model of this kind can have: without each strategy, without smoothing."""
    stop = dataclasses.replace(adaptive, on_infeasible="stop")
    runs = [
        Run(
            name=f"adaptive w/o {pair}",
            paper_name=f"w/o {paper}",
            planner=dataclasses.replace(stop, pairs=tuple(q for q in adaptive.space.pairs if q != pair)),
            static=False,
        )
        for pair, paper in STATIC_PAIRS.items()
    ]
    runs.append(
        Run(
            name="adaptive gamma=0",
            paper_name="w/o Smoothing",
            planner=dataclasses.replace(stop, hysteresis=0.0),
            static=False,
        )
    )
    return runs


PAPER_THRESHOLD_SLACK = 512 * 2**20
"""The authors' code plans against the largest peak seen while profiling minus 512 MB
(reference_code_lessons.md section 5); at most the GPU's memory minus that."""


def load_paper_model(name: str, configs: Path = CONFIGS) -> ModelSpec:
    """The model, layers, mask, planner and margin of ``configs/paper-<name>.yaml``."""
    path = configs / f"paper-{name}.yaml"
    config = load_config(path)
    args = parse_megatron_args(config.megatron_args)
    shape = model_shape_from_args(args)
    if args.tensor_model_parallel_size != 8 or not args.bf16:
        raise ValueError(f"{path}: the simulation models 8 bf16 GPUs, the preset asks otherwise")
    return ModelSpec(
        name=name,
        shape=shape,
        num_layers=args.num_layers,
        causal=config.attention_mask == "causal",
        planner=config.planner,
        memory=config.memory,
    )


@dataclasses.dataclass(kw_only=True)
class Setting:
    """One (GPU, model, dataset) and its curves."""

    gpu: NodeSpec
    model: ModelSpec
    dataset_key: str
    dataset: DatasetSpec
    num_sequences: int
    budget_bytes: float
    static_bytes: float
    curves: list[Curve]
    ablations: list[Curve]
    paper_threshold_max: int | None
    """ParaDySe's longest length under the authors' memory threshold instead of the margin."""
    tuned: TunedBaseline
    """The static Megatron configuration a careful user runs on the node for this dataset."""


def paper_node(gpu: NodeSpec, model: ModelSpec, dataset: DatasetSpec, *, head: bool) -> NodeModel:
    """``model``'s layers on a node of ``gpu``: with ``head``, the embedding and output layer of the
    dataset's vocabulary too."""
    return NodeModel(
        gpu=gpu.name,
        shape=model.shape,
        num_layers=model.num_layers,
        causal=model.causal,
        budget_bytes=model.memory.budget_bytes(gpu.allocator_bytes),
        planner=model.planner,
        vocab_size=dataset.vocab_size if head else 0,
        bias=False,  # the paper's models have no linear biases
    )


def simulate_setting(
    gpu: NodeSpec, model: ModelSpec, dataset_key: str, lengths: np.ndarray, *, head: bool, ablations: bool
) -> Setting:
    dataset = DATASETS[dataset_key]
    node = paper_node(gpu, model, dataset, head=head)
    analytic = node.cost_model(gpu.p)
    cost = MemoCostModel(analytic)
    budget = node.budget_bytes
    ordered = np.sort(lengths)

    longest = int(ordered[-1])  # the dataset's longest: no bucket ends past it, as in a job of these lengths

    def curve(run: Run) -> Curve:
        planner = Planner.for_model(
            run.planner,
            cost,
            shape=model.shape,
            p=gpu.p,
            num_layers=model.num_layers,
            budget_bytes=budget,
            bucket_cap=longest,
        )
        return simulate_curve(run, planner, ordered, gpu.p, causal=model.causal)

    curves = [curve(run) for run in paper_runs(model.planner)]
    extra = [curve(run) for run in ablation_runs(model.planner)] if ablations else []
    adaptive_reached = next(c for c in curves if c.run.name == "adaptive").reached
    paper_rule = Planner.for_model(
        model.planner,
        cost,
        shape=model.shape,
        p=gpu.p,
        num_layers=model.num_layers,
        budget_bytes=gpu.memory_bytes - PAPER_THRESHOLD_SLACK,
        bucket_cap=longest,
    )
    return Setting(
        gpu=gpu,
        model=model,
        dataset_key=dataset_key,
        dataset=dataset,
        num_sequences=len(lengths),
        budget_bytes=budget,
        static_bytes=analytic.static_bytes,
        curves=curves,
        ablations=extra,
        paper_threshold_max=longest_fitting(
            paper_rule, gpu.p, causal=model.causal, fits=adaptive_reached, limit=longest
        ),
        tuned=tuned_megatron(node, ordered, gpu.p, priced=cost),
    )
