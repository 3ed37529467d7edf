"""The baseline a tuned Megatron user runs: one static configuration of the node for the whole run, the
one a careful user picks for the dataset, priced by the cost model that prices the adaptive plans.
**Simulated**: the rates are published figures (:mod:`megatron_paradyse.cost.hardware`).

The layouts of ``gpus`` GPUs, ``TP x CP x DP = gpus``, that the strategies price as Megatron runs them:

- ``TP=t, CP=1, DP=gpus/t`` for ``t`` in 1, 2, 4, 8 up to ``gpus``: Megatron's tensor + sequence parallelism (``tp_sp``
  on ``t`` GPUs), its distributed optimizer sharding the optimizer state over the ``DP`` replicas.
- ``TP=1, CP=gpus``, all-to-all (``cp_comm_type a2a``: ``ulysses``) or ring (``p2p``: ``ring``): context
  parallelism under Megatron-FSDP sharding weights, gradients and optimizer state over the DP x CP
  group (here the CP group), gathered per layer (``zero3``).

Each recomputes the fewest layers under which the dataset's longest sequence fits the budget (Megatron's
``--recompute-granularity full --recompute-method block --recompute-num-layers N``: a recomputed layer
keeps only its input; fewer recomputed layers are faster on every sequence), or every layer where none
does. A careful user runs the fastest of them over the dataset among those under which its longest
sequence fits (where none does, the one that reaches furthest). A step of ``DP`` replicas runs ``DP``
sequences of the curriculum, one each: it takes the longest of theirs, and the gradients'
reduce-scatter and the parameters' all-gather across the replicas run beside it (Megatron's
``--overlap-grad-reduce``, ``--overlap-param-gather``), exposed as the cost model exposes streamed
collectives. What is not priced is said (:data:`NOT_PRICED`), never guessed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.base import CostModel
from megatron_paradyse.cost.hardware import GROUP_SIZES, hardware_profile, node_group, stage_params_per_rank
from megatron_paradyse.cost.pricing import TermPrices
from megatron_paradyse.planner import Decision, Planner
from megatron_paradyse.simulation.curves import Curve, Run, simulate_curve
from megatron_paradyse.simulation.node import NodeModel
from megatron_paradyse.strategies import unsupported_reason
from megatron_paradyse.strategies.terms import Collective

__all__ = [
    "NOT_PRICED",
    "MegatronConfig",
    "TunedBaseline",
    "adaptive_curve",
    "describe",
    "last_step_s",
    "megatron_configs",
    "times_in_common",
    "tuned_megatron",
]

_CP_ATTENTION = {"a2a": "ulysses", "p2p": "ring"}
"""Megatron's ``--cp-comm-type`` and the attention strategy that runs it."""

NOT_PRICED = (
    "TP and CP both above 1 (the strategies run one group sharing one set of TP shards, "
    "not TP groups inside CP groups)",
    "CP with whole weights (the distributed optimizer: the strategies gather them) or beside DP "
    "(Megatron-FSDP then shards over DP x CP, not over the CP group the strategies gather from)",
    "CP's all_gather and a2a+p2p exchanges (no strategy runs them)",
    "selective recompute (no cost term recomputes the attention core alone)",
)
"""Megatron configurations the cost model has no faithful terms for."""


@dataclasses.dataclass(frozen=True, order=True)
class MegatronConfig:
    """One static Megatron configuration of a node: every step alike."""

    tp: int
    cp: int
    dp: int
    cp_comm: str = ""
    """``a2a`` or ``p2p`` where ``cp > 1``."""
    recomputed: int = 0
    """Layers recomputed in backward (Megatron's block method), of :attr:`layers`."""
    layers: int = 0

    @property
    def group(self) -> int:
        """GPUs of one replica."""
        return self.tp * self.cp

    @property
    def pair(self) -> LayerOption:
        """What a layer runs, not recomputed."""
        if self.cp == 1:
            return LayerOption("tp_sp", "tp_sp")
        return LayerOption(_CP_ATTENTION[self.cp_comm], "zero3")

    @property
    def layout(self) -> str:
        """Its parallel layout, as Megatron's flags set it."""
        return f"TP={self.tp} CP={self.cp}{f' {self.cp_comm}' if self.cp > 1 else ''} DP={self.dp}"

    def __str__(self) -> str:
        if not self.recomputed:
            return f"{self.layout} no recompute"
        if self.recomputed == self.layers:
            return f"{self.layout} full recompute"
        return f"{self.layout} recompute {self.recomputed} of {self.layers} layers"


def megatron_configs(gpus: int) -> tuple[MegatronConfig, ...]:
    """The layouts of ``gpus`` GPUs of one node the cost model prices (module docstring), none recomputed."""
    if gpus not in GROUP_SIZES:
        raise ValueError(
            f"a tuned Megatron configuration is priced on {', '.join(map(str, GROUP_SIZES))} GPUs, not {gpus}"
        )
    configs = [MegatronConfig(tp, 1, gpus // tp) for tp in GROUP_SIZES if tp <= gpus]
    if gpus > 1:
        configs += [MegatronConfig(1, gpus, 1, comm) for comm in _CP_ATTENTION]
    return tuple(configs)


class _BlockRecompute:
    """A planner that runs one plan on every sequence: ``recomputed`` of ``planner``'s layers run its second
    option (its first, recomputed), the others its first; as :func:`simulate_curve` and
    :func:`longest_fitting` take a planner (None where the plan does not fit)."""

    def __init__(self, planner: Planner, recomputed: int) -> None:
        self.planner = planner
        self.counts = (planner.num_layers - recomputed, recomputed)
        # a bucket per padded length: what :meth:`fits` prices a layout at, as it is (as Planner.fits)
        self._as_is = planner.with_config(dataclasses.replace(planner.config, bucket="linear", bucket_tokens=1))

    @property
    def buckets(self):
        return self.planner.buckets

    def decide(self, layout: SequenceLayout) -> Decision | None:
        """The plan, priced at ``layout``'s bucket's edge; None where it does not fit there."""
        return self._decide(self.planner, layout)

    def fits(self, layout: SequenceLayout) -> bool:
        return self._decide(self._as_is, layout) is not None

    def _decide(self, planner: Planner, layout: SequenceLayout) -> Decision | None:
        problem = planner.stage_problem(layout)
        solution = problem.evaluate(self.counts)
        if not problem.fits(solution):
            return None
        bucket = planner.bucket_layout(layout).padded_len
        return Decision(problem.to_plan(solution), False, False, bucket, solution.time_s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TunedBaseline:
    """The configuration a careful user runs and its curve; every configuration's curve; those that
    cannot run the model, with the reason."""

    chosen: MegatronConfig | None
    """None when none can run the model."""
    curves: dict[MegatronConfig, Curve]
    cannot_run: dict[MegatronConfig, str]

    @property
    def curve(self) -> Curve | None:
        return None if self.chosen is None else self.curves[self.chosen]

    @property
    def fitting(self) -> int:
        """Configurations that train every sequence."""
        return sum(c.stopped_at is None for c in self.curves.values())


def tuned_megatron(
    node: NodeModel, lengths: Sequence[int], gpus: int = 8, *, priced: CostModel | None = None
) -> TunedBaseline:
    """Every layout of :func:`megatron_configs` with the recompute it needs over ``lengths`` (sorted: the
    curriculum), and the one a careful user runs: the fastest that trains them all, else the one that
    reaches furthest. ``priced``: ``node``'s cost model on all ``gpus`` GPUs where the caller has one, to
    share what it has priced (the layouts of one group of them all)."""
    curves, cannot_run = {}, {}
    for layout in megatron_configs(gpus):
        pair = layout.pair
        reasons = [
            f"{sublayer} {name}: {why}"
            for sublayer, name in (("attention", pair.attention), ("mlp", pair.mlp))
            if (why := unsupported_reason(sublayer, name, node.shape, layout.group)) is not None
        ]
        if reasons:
            cannot_run[layout] = "; ".join(reasons)
            continue
        whole = priced is not None and layout.group == gpus
        cost = priced if whole else node.cost_model(layout.group, dp=layout.dp)
        config, planner = _recomputing_to_fit(node, layout, cost, int(lengths[-1]))
        curves[config] = _curve(node, config, planner, lengths)
    chosen = min(
        curves, key=lambda c: (curves[c].stopped_at is not None, -curves[c].longest, curves[c].total_s), default=None
    )
    return TunedBaseline(chosen=chosen, curves=curves, cannot_run=cannot_run)


def _recomputing_to_fit(
    node: NodeModel, layout: MegatronConfig, cost: CostModel, longest: int
) -> tuple[MegatronConfig, _BlockRecompute]:
    """``layout`` recomputing the fewest layers under which ``longest`` tokens fit (every layer where none
    do), and its planner."""
    pair = layout.pair
    planner = Planner(
        dataclasses.replace(node.planner, hysteresis=0.0, loss_chunk_tokens=0, on_infeasible="stop"),
        cost,
        options=(pair, dataclasses.replace(pair, recompute=True)),
        num_layers=node.num_layers,
        budget_bytes=node.budget_bytes,
        bucket_cap=longest,
    )
    sequence = SequenceLayout.build(longest, layout.group, causal=node.causal)
    recomputed = next(
        (n for n in range(node.num_layers) if _BlockRecompute(planner, n).fits(sequence)), node.num_layers
    )
    config = dataclasses.replace(layout, recomputed=recomputed, layers=node.num_layers)
    return config, _BlockRecompute(planner, recomputed)


def _curve(node: NodeModel, config: MegatronConfig, planner: _BlockRecompute, lengths: Sequence[int]) -> Curve:
    """``config``'s curve: one replica's times of each sequence, run ``DP`` at a time."""
    run = Run(name="tuned", paper_name=f"Megatron {config}", planner=planner.planner.config, static=True)
    curve = simulate_curve(run, planner, lengths, config.group, causal=node.causal)
    if config.dp == 1:
        return curve
    times = np.diff([0.0, *curve.cumulative_s])
    prices = TermPrices(hardware_profile(node_group(node.gpu, config.dp)), config.dp, 2)
    sync_s = prices.comms(_gradient_sync(node, config))
    cumulative, total = [], 0.0
    for start in range(0, len(times), config.dp):
        step = times[start : start + config.dp]
        total += max(step) + prices.exposed(max(step), sync_s)
        cumulative += [total] * len(step)
    return dataclasses.replace(curve, cumulative_s=cumulative)


def _gradient_sync(node: NodeModel, config: MegatronConfig) -> tuple[Collective, ...]:
    """A step's collectives across the ``DP`` replicas, as Megatron's distributed optimizer runs them:
    the fp32 gradients reduce-scattered, the bf16 parameters all-gathered after the update."""
    params = stage_params_per_rank(node.shape, node.num_layers, config.group, vocab_size=node.vocab_size)
    return Collective("reduce_scatter", int(4 * params)), Collective("all_gather", int(2 * params))


def adaptive_curve(node: NodeModel, lengths: Sequence[int], gpus: int = 8) -> Curve:
    """``node``'s planner over ``lengths`` (sorted) on ``gpus`` GPUs, as the adaptive runs plan them."""
    planner = Planner.for_model(
        node.planner,
        node.cost_model(gpus),
        shape=node.shape,
        p=gpus,
        num_layers=node.num_layers,
        budget_bytes=node.budget_bytes,
        bucket_cap=int(lengths[-1]),
    )
    run = Run(name="adaptive", paper_name="ParaDySe", planner=node.planner, static=False)
    return simulate_curve(run, planner, lengths, gpus, causal=node.causal)


def times_in_common(adaptive: Curve, tuned: Curve) -> tuple[float, float]:
    """The adaptive run's time and the tuned one's over the sequences both train (the first ones)."""
    both = min(len(adaptive.lengths), len(tuned.lengths))
    if not both:
        raise ValueError("the two runs train no sequence in common: no time to compare")
    return adaptive.cumulative_s[both - 1], tuned.cumulative_s[both - 1]


def last_step_s(curve: Curve) -> float:
    """The time of the curve's last step (its longest sequences'; ``DP`` of them at once)."""
    before = [t for t in curve.cumulative_s if t < curve.total_s]
    return curve.total_s - (before[-1] if before else 0.0)


def describe(tuned: TunedBaseline, adaptive: Curve) -> str:
    """One line: the configuration a careful user runs, why, and its last step beside the adaptive run's;
    the layouts that cannot run the model, with the reason."""
    priced = len(tuned.curves) + len(tuned.cannot_run)
    cannot = "".join(f"; {config.layout} cannot run this model: {why}" for config, why in tuned.cannot_run.items())
    curve = tuned.curve
    if curve is None:
        return f"tuned Megatron: none of the {priced} layouts can run this model{cannot}"
    if tuned.fitting:
        why = (
            f"the fastest of the {tuned.fitting} of {priced} layouts that train every sequence, each recomputing "
            f"the fewest layers it needs"
        )
    else:
        why = f"none of the {priced} layouts trains every sequence, even recomputing every layer; this reaches furthest"
    return (
        f"tuned Megatron: {tuned.chosen}, {why}; last step {last_step_s(curve):,.2f} s "
        f"(adaptive {last_step_s(adaptive):,.2f} s){cannot}"
    )
