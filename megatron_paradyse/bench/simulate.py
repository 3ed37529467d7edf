"""The paper's experiment, simulated: ``python -m megatron_paradyse.bench simulate [--gpus a100,h100,h200]``.

**Nothing here is measured.** The planner and the analytic cost model run on cost profiles built from
published GPU and NCCL figures (:mod:`megatron_paradyse.cost.hardware`), for the setting of the ParaDySe
paper (AAAI-26, section 7): one node of 8 GPUs, TP=8, one sequence per step in curriculum order (short
to long), the models of ``configs/paper-{bert,llama,gpt}.yaml`` (shape, layers on the node, mask, the
four strategy pairs, no recompute, gamma, memory margin), and sequence lengths drawn from the paper's
Table 3 histograms (GitHubCode, GRCh38).

For each GPU kind, model and dataset it plans every sequence under each of the paper's static
strategies (a uniform plan of one pair: MegatronTS ``tp_sp/tp_sp``, UlyssesZ ``ulysses/zero3``,
MegatronCZ ``ring/zero3``, METP ``lean/lean``), under ParaDySe's adaptive planner (the exact planner over
those four pairs, gamma = 5%), and under a planner that goes beyond the paper (any attention with any MLP
strategy, per-layer recompute). A curve is the predicted time per sequence summed over the sequences so
far; it ends at the first sequence no plan fits, as an out-of-memory error ended the paper's curves.

Prints, per (GPU, model, dataset), the longest trainable length and cumulative times beside the paper's
reported numbers, the paper's ordering claims as PASS/FAIL lines, and last a ``key=value`` line. Writes
one PNG per GPU kind in the layout of the paper's Figure 2 under ``--out-dir``.

Assumptions (the paper states none of them): bf16 weights with fp32 gradients, fp32 master weights and
two fp32 Adam moments, 18 bytes per parameter, not sharded (no data parallelism); only the transformer
layers on the node, no embedding or output layer (``--head`` adds them); memory budget = what the
caching allocator can hold (the GPU's memory less the node's assumed memory outside it) less the presets'
margin (10%), as a job sizes it; ``--sequences`` sequences per dataset (the paper does not say
how many, so cumulative times scale with this choice; lengths and orderings do not).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from megatron_paradyse.bench.frontier import frontier, print_frontier
from megatron_paradyse.config import MemorySection
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.analytic import AnalyticCostModel
from megatron_paradyse.cost.base import WHOLE_LOSS, CostModel, LayerCost, StageOptions
from megatron_paradyse.cost.hardware import BYTES_PER_PARAM, HARDWARE, NodeSpec, hardware_profile, stage_static_bytes
from megatron_paradyse.data.corpora import (
    GITHUBCODE_MAX_LEN,
    GITHUBCODE_SHARES,
    GRCH38_MAX_LEN,
    GRCH38_SHARES,
    binned_lengths,
)
from megatron_paradyse.planner import InfeasibleSequenceError, Planner, PlannerConfig
from megatron_paradyse.planner.buckets import LengthBuckets
from megatron_paradyse.strategies import ModelShape

__all__ = ["Curve", "DatasetSpec", "ModelSpec", "Run", "main", "simulate_curve"]

_GIB = 2**30
_K = 1024
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """One curve: a name, the paper's name for it, and the planner that plans its sequences."""

    name: str
    paper_name: str
    planner: PlannerConfig
    static: bool


@dataclasses.dataclass(kw_only=True)
class Curve:
    """What one run did over the length-sorted dataset."""

    run: Run
    lengths: list[int]
    """Sequences trained, in order."""
    cumulative_s: list[float]
    """Predicted time of the sequences so far, after each one."""
    stopped_at: int | None
    """The first sequence no plan fits (the curve ends before it), or None: the dataset finished."""
    max_feasible: int | None
    """Longest padded length some plan fits (a bucket edge: a multiple of 512, the paper's rounding);
    None when every sequence fit (the longest is beyond the dataset's longest and not searched)."""
    plans: dict[str, int]
    """Sequences per plan (compact form)."""

    @property
    def reached(self) -> int:
        return self.lengths[-1] if self.lengths else 0

    @property
    def longest(self) -> float:
        """:attr:`max_feasible`, infinite when every sequence fit: for comparisons."""
        return math.inf if self.max_feasible is None else self.max_feasible

    @property
    def total_s(self) -> float:
        return self.cumulative_s[-1] if self.cumulative_s else 0.0

    def cumulative_at(self, length: int) -> float | None:
        """Time up to the last sequence of at most ``length`` tokens; None if the curve ended before it."""
        if self.stopped_at is not None and self.stopped_at <= length:
            return None
        i = int(np.searchsorted(self.lengths, length, side="right"))
        return self.cumulative_s[i - 1] if i else 0.0


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


def longest_fitting(planner: Planner, p: int, *, causal: bool, fits: int, limit: int) -> int | None:
    """The longest bucket edge some plan of ``planner`` fits (as :meth:`Planner.max_feasible_length`),
    searched from the bucket of ``fits`` tokens (known to fit; 0: none known) up to that of ``limit``;
    None when that one fits too. Bounded, so that a model fitting millions of tokens is not searched
    beyond the dataset."""
    config = planner.config
    buckets = LengthBuckets(config.cache.bucket, config.cache.bucket_tokens, config.cache.bucket_ratio)

    def index(n: int) -> int:
        """Of the bucket holding ``n`` tokens: the first whose edge is at least ``n``."""
        if buckets.edge_at(0, 2 * p) >= n:
            return 0
        lo, hi = 0, 1  # edge(lo) < n; gallop until edge(hi) >= n, then bisect
        while buckets.edge_at(hi, 2 * p) < n:
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if buckets.edge_at(mid, 2 * p) < n else (lo, mid)
        return hi

    def fit(i: int) -> bool:
        return planner.fits(SequenceLayout.build(buckets.edge_at(i, 2 * p), p, causal=causal))

    top = index(limit)
    if fit(top):
        return None
    lo, hi = (index(fits), top) if fits else (-1, top)  # fit(lo) (or lo = -1), not fit(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fit(mid) else (lo, mid)
    return buckets.edge_at(lo, 2 * p) if lo >= 0 else 0


def simulate_curve(run: Run, planner: Planner, lengths: Sequence[int], p: int, *, causal: bool) -> Curve:
    """Plan ``lengths`` in order (the caller sorts them) until the first that no plan fits."""
    cumulative, trained, plans, stopped = 0.0, [], {}, None
    times = []
    for n in lengths:
        try:
            decision = planner.decide(SequenceLayout.build(int(n), p, causal=causal))
        except InfeasibleSequenceError:
            stopped = int(n)
            break
        cumulative += decision.plan.predicted_time_s
        trained.append(int(n))
        times.append(cumulative)
        plan = decision.plan.compact()
        plans[plan] = plans.get(plan, 0) + 1
    longest = longest_fitting(planner, p, causal=causal, fits=trained[-1] if trained else 0, limit=int(lengths[-1]))
    return Curve(run=run, lengths=trained, cumulative_s=times, stopped_at=stopped, max_feasible=longest, plans=plans)


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


# -- what the paper reports (paper.md section 8) ------------------------------------------------------
PAPER_MAX_GPT_GRCH38 = 329_728
TABLE5 = {  # variant -> (max sequence length, cumulative time s): GPT on GRCh38, A100 node
    "ParaDySe": (329_728, 3117.76),
    "w/o MegatronTS": (300_032, 3173.80),
    "w/o MegatronCZ": (300_032, 2795.91),
    "w/o UlyssesZ": (300_032, 2813.13),
    "w/o METP": (112_128, 1741.99),
    "w/o Smoothing": (300_032, 2800.49),
}
PAPER_CLAIMS = {
    ("gpt", "grch38"): "ParaDySe trains 181.22% longer sequences than the shortest-reaching baseline (2.81x)",
    ("gpt", "githubcode"): "ParaDySe extends the trainable length by up to 144.16% beyond baselines (2.44x)",
    ("bert", "githubcode"): "every baseline finishes the dataset; up to 89.29% less time on the longest sequences",
    ("bert", "grch38"): "ParaDySe reaches the end (624K); 58.01% faster training",
    ("llama", "grch38"): "ParaDySe reaches the end (624K); its longest length slightly trails the best baseline",
    ("llama", "githubcode"): "ParaDySe keeps METP's long-sequence support",
}
PAPER_THRESHOLD_SLACK = 512 * 2**20
"""The authors' code plans against the largest peak seen while profiling minus 512 MB
(reference_code_lessons.md section 5); at most the GPU's memory minus that."""
_LONGER = {("gpt", "grch38"): 2.8122, ("gpt", "githubcode"): 2.4416}


def load_paper_model(name: str, configs: Path = CONFIGS) -> ModelSpec:
    """The model, layers, mask, planner and margin of ``configs/paper-<name>.yaml``."""
    from megatron_paradyse.config import load_config
    from megatron_paradyse.run.config_cli import model_shape_from_args, parse_megatron_args

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


def simulate_setting(
    gpu: NodeSpec, model: ModelSpec, dataset_key: str, lengths: np.ndarray, *, head: bool, ablations: bool
) -> Setting:
    dataset = DATASETS[dataset_key]
    vocab = dataset.vocab_size if head else 0
    static = stage_static_bytes(model.shape, model.num_layers, gpu.p, vocab_size=vocab)
    analytic = AnalyticCostModel(
        hardware_profile(gpu),
        model.shape,
        gpu.p,
        dtype=torch.bfloat16,
        static_bytes=static,
        vocab_size=vocab,
        bias=False,  # the paper's models have no linear biases
    )
    cost = MemoCostModel(analytic)
    budget = model.memory.budget_bytes(gpu.allocator_bytes)
    ordered = np.sort(lengths)

    def curve(run: Run) -> Curve:
        planner = Planner.for_model(
            run.planner, cost, shape=model.shape, p=gpu.p, num_layers=model.num_layers, budget_bytes=budget
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
    )
    return Setting(
        gpu=gpu,
        model=model,
        dataset_key=dataset_key,
        dataset=dataset,
        num_sequences=len(lengths),
        budget_bytes=budget,
        static_bytes=static,
        curves=curves,
        ablations=extra,
        paper_threshold_max=longest_fitting(
            paper_rule, gpu.p, causal=model.causal, fits=adaptive_reached, limit=int(ordered[-1])
        ),
    )


# -- checks -----------------------------------------------------------------------------------------
def ordering_checks(setting: Setting) -> list[tuple[str, bool, str]]:
    """The paper's qualitative claims on this setting: (claim, passed, detail)."""
    static = [c for c in setting.curves if c.run.static]
    adaptive = next(c for c in setting.curves if c.run.name == "adaptive")
    by_name = {c.run.name: c for c in static}
    checks = []
    # fastest on short sequences, the paper's first bin (< 4K): MegatronTS (CPC slows the lean ones there)
    first = min(int(np.searchsorted(c.lengths, SHORT)) for c in static)
    if first:
        short = {c.run.name: c.cumulative_s[first - 1] for c in static}
        fastest = min(short, key=short.get)
        checks.append(
            (
                "MegatronTS is the fastest static strategy on short sequences",
                fastest == "tp_sp/tp_sp",
                f"the {first} sequences < {SHORT // _K}K: fastest {STATIC_PAIRS[fastest]} {short[fastest]:.3g} s, "
                f"METP {short['lean/lean']:.3g} s",
            )
        )
    furthest = max(static, key=lambda c: c.longest)
    lean = by_name["lean/lean"]
    checks.append(
        (
            "METP reaches furthest of the static strategies",
            lean.longest >= furthest.longest,
            f"METP {_fmt_longest(lean)}, furthest {STATIC_PAIRS[furthest.run.name]} {_fmt_longest(furthest)}",
        )
    )
    checks.append(
        (
            "ParaDySe reaches at least METP's length",
            adaptive.longest >= lean.longest,
            f"ParaDySe {_fmt_longest(adaptive)}, METP {_fmt_longest(lean)}",
        )
    )
    # never slower than a static strategy over the sequences both trained (gamma of slack: hysteresis)
    gamma = setting.model.planner.cache.hysteresis
    worst = max((adaptive.cumulative_s[len(c.lengths) - 1] / c.total_s, c.run.name) for c in static if c.lengths)
    checks.append(
        (
            "ParaDySe is no slower than any static strategy over the sequences it trains",
            worst[0] <= 1 + gamma + 1e-9,
            f"largest ratio {worst[0]:.3f} vs {STATIC_PAIRS[worst[1]]} (gamma = {gamma:g})",
        )
    )
    return checks


# -- output -----------------------------------------------------------------------------------------
_CHECKPOINTS = (16 * _K, 64 * _K, 128 * _K, 256 * _K)
SHORT = 4 * _K
"""The paper's first length bin ends here: "short sequences"."""


def _fmt_len(n: int | None) -> str:
    return "" if n is None else f"{n:,}"


def _fmt_longest(c: Curve) -> str:
    return "all fit" if c.max_feasible is None else f"{c.max_feasible:,}"


def _fmt_s(t: float | None) -> str:
    return "OOM" if t is None else f"{t:,.1f}"


def print_setting(setting: Setting) -> list[tuple[str, bool, str]]:
    gpu, model, ds = setting.gpu, setting.model, setting.dataset
    shape = model.shape
    print(
        f"\n== {gpu.device_name} x{gpu.p} (SIMULATED) | {MODELS[model.name]} h={shape.hidden_size} "
        f"n={shape.num_attention_heads}, {model.num_layers} layers, {'causal' if model.causal else 'bidirectional'} "
        f"| {ds.name}: {setting.num_sequences} sequences, "
        f"max {ds.max_len:,} ==",
    )
    print(
        f"budget {setting.budget_bytes / _GIB:.1f} GiB per GPU ({gpu.memory_bytes / _GIB:.1f} GiB less "
        f"{gpu.outside_allocator_bytes / _GIB:.1f} outside the caching allocator, less {model.memory.margin:.0%}); "
        f"static {setting.static_bytes / _GIB:.1f} GiB (weights, grads, Adam: "
        f"{BYTES_PER_PARAM} B/param)",
    )
    head = ["strategy", "paper", "max len", "reached", "total s"] + [f"cum@{c // _K}K s" for c in _CHECKPOINTS]
    rows = []
    for c in setting.curves:
        row = [c.run.name, c.run.paper_name, _fmt_longest(c), _fmt_len(c.reached), _fmt_s(c.total_s)]
        row += [_fmt_s(c.cumulative_at(n)) if n <= ds.max_len else "" for n in _CHECKPOINTS]
        rows.append(row)
    _print_table(head, rows)
    for c in setting.curves:
        if not c.run.static:
            mix = "; ".join(f"{plan}: {n}" for plan, n in sorted(c.plans.items(), key=lambda kv: -kv[1])[:4])
            print(f"  {c.run.name}, sequences per plan (most used): {mix}")
    print(
        f"  memory rule: under the authors' threshold (GPU memory - 512 MiB) instead of a {model.memory.margin:.0%} "
        f"margin, ParaDySe's longest would be {_fmt_len(setting.paper_threshold_max) or 'beyond the dataset'}",
    )
    key = (model.name, setting.dataset_key)
    if key in PAPER_CLAIMS:
        print(f"paper: {PAPER_CLAIMS[key]}")
        adaptive = next(c for c in setting.curves if c.run.name == "adaptive")
        static = [c for c in setting.curves if c.run.static]
        shortest = min(static, key=lambda c: c.longest)
        paper_ratio = f" (paper {_LONGER[key]:.2f}x)" if key in _LONGER else ""
        if shortest.max_feasible is None:
            print("simulated: every static strategy trains the whole dataset")
        else:
            # a run that trains every sequence is credited with the dataset's longest: a lower bound
            at_least = "" if adaptive.max_feasible else "trains every sequence: >= "
            ratio = min(adaptive.longest, ds.max_len) / shortest.max_feasible
            print(
                f"simulated: ParaDySe {at_least}{ratio:.2f}x the length of the shortest-reaching baseline "
                f"({STATIC_PAIRS[shortest.run.name]} {shortest.max_feasible:,}){paper_ratio}"
            )
        finished = [c for c in static if c.stopped_at is None]
        if finished and adaptive.stopped_at is None:
            slowest = max(finished, key=lambda c: c.total_s)
            last = [c.cumulative_s[-1] - c.cumulative_s[-2] for c in (adaptive, slowest)]
            print(
                f"simulated: vs the slowest baseline that finishes ({STATIC_PAIRS[slowest.run.name]}): "
                f"{1 - adaptive.total_s / slowest.total_s:.2%} less time in all, "
                f"{1 - last[0] / last[1]:.2%} less on the longest sequence",
            )
    if setting.ablations:
        print("ablation (paper Table 5: GPT on GRCh38, A100; its times depend on its unstated dataset size)")
        adaptive = next(c for c in setting.curves if c.run.name == "adaptive")
        rows = []
        for c in [adaptive, *setting.ablations]:
            paper = TABLE5.get(c.run.paper_name, (None, None))
            full_same = adaptive.cumulative_at(c.reached)
            rows.append(
                [c.run.name, c.run.paper_name, _fmt_longest(c), _fmt_s(c.total_s), _fmt_s(full_same)]
                + [_fmt_len(paper[0]) or "-", _fmt_s(paper[1]) if paper[1] else "-"]
            )
        _print_table(["variant", "paper", "max len", "total s", "full to same s", "paper max", "paper s"], rows)
    checks = ordering_checks(setting)
    for claim, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {claim} ({detail})")
    return checks


def _print_table(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print(
            "  " + "  ".join(v.rjust(w) if i > 1 else v.ljust(w) for i, (v, w) in enumerate(zip(map(str, r), widths))),
        )


def plot_gpu(settings: list[Setting], path: Path) -> None:
    """Cumulative time against sequence length, one panel per (dataset, model), as the paper's Figure 2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({s.dataset_key for s in settings}, key=list(DATASETS).index)
    models = sorted({s.model.name for s in settings}, key=list(MODELS).index)
    fig, axes = plt.subplots(
        len(datasets), len(models), figsize=(4.6 * len(models), 3.6 * len(datasets)), squeeze=False
    )
    styles = {
        "tp_sp/tp_sp": ("tab:blue", "-"),
        "ulysses/zero3": ("tab:orange", "-"),
        "ring/zero3": ("tab:green", "-"),
        "lean/lean": ("tab:purple", "-"),
        "adaptive": ("tab:red", "-"),
        "beyond": ("black", ":"),
    }
    for s in settings:
        ax = axes[datasets.index(s.dataset_key)][models.index(s.model.name)]
        for c in s.curves:
            if not c.lengths:
                continue
            color, style = styles[c.run.name]
            label = c.run.paper_name if c.run.name != "beyond" else "beyond the paper (all + recompute)"
            x = np.array(c.lengths) / _K
            ax.plot(x, c.cumulative_s, style, color=color, lw=2.2 if c.run.name == "adaptive" else 1.4, label=label)
            if c.stopped_at is not None:
                ax.plot(x[-1], c.cumulative_s[-1], "x", color=color, ms=8, mew=2)
        ax.set_title(f"{s.dataset.name} - {MODELS[s.model.name]}")
        ax.set_xlabel("sequence length (K tokens)")
        ax.set_ylabel("cumulative time (s)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper left")
    gpu = settings[0].gpu
    fig.suptitle(f"SIMULATED on {gpu.device_name} x{gpu.p} from published figures (x: out of memory)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_paradyse.bench simulate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--gpus", default="a100,h100,h200", help=f"of {','.join(HARDWARE)}")
    parser.add_argument("--models", default=",".join(MODELS), help=f"of {','.join(MODELS)}")
    parser.add_argument("--datasets", default=",".join(DATASETS), help=f"of {','.join(DATASETS)}")
    parser.add_argument("--sequences", type=int, default=1000, help="sequences drawn per dataset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--head", action="store_true", help="put the embedding and output layer on the node")
    parser.add_argument("--configs", type=Path, default=CONFIGS, help="folder of the paper-*.yaml presets")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/simulate"))
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--json", type=Path, help="write every curve to this file")
    args = parser.parse_args(argv)
    gpus = _choices("--gpus", args.gpus, HARDWARE)
    models = _choices("--models", args.models, MODELS)
    datasets = _choices("--datasets", args.datasets, DATASETS)
    if not args.no_plots and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("the plots need matplotlib (pip install matplotlib==3.11.2); or pass --no-plots")

    print("SIMULATED, NOT MEASURED: the planner and the analytic cost model on cost profiles built from published")
    print("GPU datasheets, FlashAttention-2 and nccl-tests figures (megatron_paradyse/cost/hardware.py).")
    specs = {name: load_paper_model(name, args.configs) for name in models}
    lengths = {
        key: binned_lengths(ds.shares, args.sequences, ds.max_len, args.seed, reference_max=ds.max_len)
        for key, ds in DATASETS.items()
        if key in datasets
    }
    results, checks, summary = [], [], {}
    for gpu_name in gpus:
        gpu = HARDWARE[gpu_name]
        settings = []
        for model_name in models:
            for key in datasets:
                ablate = (model_name, key) == ("gpt", "grch38")
                setting = simulate_setting(gpu, specs[model_name], key, lengths[key], head=args.head, ablations=ablate)
                checks += [(gpu_name, model_name, key, *c) for c in print_setting(setting)]
                summary.update(_summary(setting))
                settings.append(setting)
        if not args.no_plots:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            path = args.out_dir / f"figure2_{gpu_name}.png"
            plot_gpu(settings, path)
            print(f"\nplot: {path}")
        results += settings
    frontiers = [frontier(HARDWARE[gpu_name], args.configs) for gpu_name in gpus]
    print_frontier(frontiers)
    summary.update({f"llama3_8b_{f.gpu}_max_len": f.max_len for f in frontiers})
    if args.json:
        args.json.write_text(json.dumps(_as_json(results), indent=1))
    failed = [c for c in checks if not c[4]]
    print(f"\nordering checks: {len(checks) - len(failed)}/{len(checks)} pass")
    for gpu_name, model_name, key, claim, _, detail in failed:
        print(f"  FAIL {gpu_name} {model_name} {key}: {claim} ({detail})")
    for run, what in (("adaptive", "ParaDySe in the paper's setting"), ("beyond", "beyond the paper")):
        longest = summary.get(f"{run}_max_len_gpt_grch38_a100")
        if longest is not None:
            verdict = "PASS" if longest >= PAPER_MAX_GPT_GRCH38 else "FAIL"
            print(f"{verdict}: {what}: longest GPT sequence on GRCh38 (A100) {longest:,} >= {PAPER_MAX_GPT_GRCH38:,}")
    first = sorted(summary, key=lambda k: ("_gpt_grch38_" not in k, k.startswith("llama3_8b")))  # the paper's first
    fields = [f"{k}={summary[k]}" for k in first]
    print(" ".join([*fields, f"paper={PAPER_MAX_GPT_GRCH38}", f"ordering_ok={int(not failed)}"]))
    return 0


def _summary(setting: Setting) -> dict[str, int]:
    """``adaptive_max_len_<model>_<dataset>_<gpu>`` (the dataset's longest where every sequence fit); for
    GPT on GRCh38 also under the authors' memory threshold, and beyond the paper."""
    where = f"{setting.model.name}_{setting.dataset_key}_{setting.gpu.name}"
    runs = {c.run.name: c for c in setting.curves}
    out = {f"adaptive_max_len_{where}": runs["adaptive"].max_feasible or runs["adaptive"].reached}
    if (setting.model.name, setting.dataset_key) == ("gpt", "grch38"):
        out[f"adaptive_max_len_{where}_authors_threshold"] = setting.paper_threshold_max or setting.dataset.max_len
        out[f"beyond_max_len_{where}"] = runs["beyond"].max_feasible or runs["beyond"].reached
    return out


def _choices(flag: str, text: str, known) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"{flag}: unknown {', '.join(unknown) or '(empty)'}; known: {', '.join(known)}")
    return names


def _as_json(settings: list[Setting]) -> list[dict]:
    out = []
    for s in settings:
        for c in [*s.curves, *s.ablations]:
            out.append(
                {
                    "gpu": s.gpu.name,
                    "model": s.model.name,
                    "dataset": s.dataset_key,
                    "run": c.run.name,
                    "paper_name": c.run.paper_name,
                    "max_feasible": c.max_feasible,
                    "stopped_at": c.stopped_at,
                    "lengths": c.lengths,
                    "cumulative_s": c.cumulative_s,
                    "plans": c.plans,
                }
            )
    return out


if __name__ == "__main__":
    sys.exit(main())
