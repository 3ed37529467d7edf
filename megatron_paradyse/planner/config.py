"""What the planner may choose from and how it behaves: the ``planner`` section of a paradyse config.

The section's keys fall into three groups, each a frozen dataclass that checks its own keys: what the
planner searches (:class:`SearchSpace`), which micro-batches share a plan and how long plans are kept
(:class:`PlanCacheConfig`), and what it learns from the run (:class:`LearningConfig`).
:class:`PlannerConfig` composes them with what to do about a micro-batch no plan fits. The keys stay flat,
in the YAML section and in the constructor: ``PlannerConfig(pairs=("tp_sp/tp_sp",), hysteresis=0.1)``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import types
from collections.abc import Sequence
from typing import Literal

from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.strategies import ModelShape, available_strategies, strategy_names

__all__ = ["LearningConfig", "PlanCacheConfig", "PlannerConfig", "SearchSpace", "layer_options"]

_FLAT = types.MappingProxyType({"flat": True})
"""Metadata of a :class:`PlannerConfig` field that holds a group: the section lists the group's keys in
the field's place (:mod:`megatron_paradyse.config` reads and writes them so)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SearchSpace:
    """What a layer and its stage may run, and how the best plan of them is found."""

    method: Literal["exact", "heuristic"] = "exact"
    """``exact``: the optimal plan (count enumeration by branch and bound); ``heuristic``: the paper's
    Algorithm 1, for comparison."""
    attention: tuple[str, ...] | None = None
    """Attention strategies a layer may use; None: every registered one the model supports."""
    mlp: tuple[str, ...] | None = None
    """MLP strategies a layer may use; None: every registered one the model supports."""
    pairs: tuple[str, ...] | None = None
    """``"attention/mlp"`` pairs a layer may use (the paper's per-layer strategies, e.g.
    ``tp_sp/tp_sp``, ``ulysses/zero3``). None: any allowed attention with any allowed MLP (a
    per-sublayer plan). Excludes ``attention`` and ``mlp``."""
    recompute: bool = True
    """Let the planner recompute a layer in backward (less saved memory, one more forward), its attention
    core with it (``+rc``) or kept from the forward (``+rc+keepcore``)."""
    host_memory_gib: float = 0.0
    """Host memory (GiB per rank) that recomputed layers may keep their inputs in until their backward
    (:mod:`megatron_paradyse.core.offload`): the planner then also weighs each recomputed option offloaded
    ('+rc+off'), priced with the profile's host link. 0: never offload."""
    mlp_tile_tokens: int = 0
    """Let the planner also run a layer's MLP over sequence tiles of this many gathered tokens, each
    recomputed in backward (``+tile<tokens>``, :mod:`megatron_paradyse.strategies.tiling`): its
    intermediate activations bounded by the tile, for one more MLP forward. 0: never."""
    loss_chunk_tokens: int = 8192
    """On the stage that holds the output layer: where it saves memory a plan needs, run the output layer
    and loss over chunks of this many gathered tokens, recomputed in backward
    (:mod:`megatron_paradyse.mcore.chunked_loss`); 0: never."""

    def __post_init__(self) -> None:
        for name in ("attention", "mlp", "pairs"):
            object.__setattr__(self, name, _names(name, getattr(self, name)))
        _check_choice("method", self.method, ("exact", "heuristic"))
        self._check_strategies()
        if not (isinstance(self.host_memory_gib, (int, float)) and 0.0 <= self.host_memory_gib < math.inf):
            raise ValueError(
                f"planner.host_memory_gib must be a non-negative number of GiB per rank (0: never offload), "
                f"got {self.host_memory_gib!r}"
            )
        if self.host_memory_gib and not self.recompute:
            raise ValueError(
                "planner.host_memory_gib lets recomputed layers keep their inputs in host memory; it needs "
                "planner.recompute: true (or set host_memory_gib: 0)"
            )
        _check_count("mlp_tile_tokens", self.mlp_tile_tokens, least=0, zero="never tile")
        _check_count("loss_chunk_tokens", self.loss_chunk_tokens, least=0, zero="never chunk")

    def _check_strategies(self) -> None:
        """Pairs exclude per-sublayer lists and name strategies only; every name is a registered strategy."""
        if self.pairs is not None and (self.attention is not None or self.mlp is not None):
            raise ValueError("planner.pairs lists whole-layer pairs; leave planner.attention and planner.mlp unset")
        for pair in self.pairs or ():
            option = LayerOption.parse(pair)
            if option != LayerOption(option.attention, option.mlp):
                raise ValueError(
                    f"planner.pairs names strategies only ({pair!r}); recompute, offload and MLP tiles are "
                    f"planner.recompute, planner.host_memory_gib and planner.mlp_tile_tokens"
                )
        unknown = [
            f"planner.{field}: unknown {sublayer} strategy {name!r}; known: {', '.join(strategy_names(sublayer))}"
            for field, sublayer, name in self._named_strategies()
            if name not in strategy_names(sublayer)
        ]
        if unknown:
            raise ValueError("; ".join(unknown))

    def _named_strategies(self) -> list[tuple[str, str, str]]:
        """(field, sublayer, name) of every strategy the space names."""
        named = [("attention", "attention", n) for n in self.attention or ()]
        named += [("mlp", "mlp", n) for n in self.mlp or ()]
        for pair in self.pairs or ():
            option = LayerOption.parse(pair)
            named += [("pairs", "attention", option.attention), ("pairs", "mlp", option.mlp)]
        return named


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlanCacheConfig:
    """Which micro-batches share a plan, how many plans are kept, and when the previous one stays."""

    hysteresis: float = 0.05
    """Keep the previous plan while it fits and is predicted at most this fraction slower than the
    new optimum (the paper's gamma)."""
    bucket: Literal["linear", "geometric"] = "linear"
    """Plan-cache buckets of padded length: multiples of ``bucket_tokens``, or a geometric series
    from ``bucket_tokens`` with ratio ``bucket_ratio``. Costs are evaluated at a bucket's upper edge."""
    bucket_tokens: int = 512
    bucket_ratio: float = 1.05
    packed_as: Literal["one_document", "documents"] = "one_document"
    """How packed micro-batches are costed. ``one_document``: as one document of the bucket's length
    (a packing's attention work and working set never exceed that; saved activations depend on the
    token count only), so packing does not enter the cache key. ``documents``: with their own
    document lengths, which become part of the cache key."""
    cache_size: int = 4096
    """Plans kept (least recently used dropped first)."""

    def __post_init__(self) -> None:
        _check_choice("bucket", self.bucket, ("linear", "geometric"))
        _check_choice("packed_as", self.packed_as, ("one_document", "documents"))
        _check_fraction("hysteresis", self.hysteresis)
        _check_count("bucket_tokens", self.bucket_tokens, least=1)
        if not 1.0 < self.bucket_ratio < math.inf:
            raise ValueError(f"planner.bucket_ratio must be a finite number > 1, got {self.bucket_ratio}")
        _check_count("cache_size", self.cache_size, least=1)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LearningConfig:
    """What the planner learns from the run's measured micro-batches, and how it explores to learn it."""

    learn_time: bool = False
    """Correct the predicted time of each option and length bucket from the measured micro-batches of
    the run (:mod:`megatron_paradyse.cost.correction`); the ranks agree on the corrections at each
    iteration's end. The entry point only (the drop-in spec has no iteration boundary to agree at)."""
    learn_prior: float = 1.0
    """Weight, in micro-batches, of the current correction against the new measurements."""
    explore_share: float = 0.05
    """Where the time model learns: the most decisions (a fraction) that may run, instead of the optimum,
    an option not yet measured at that length whose predicted time is within ``explore_margin`` of it;
    0: never."""
    explore_margin: float = 0.25
    """How much slower than the optimum an option may be predicted and still be tried: wider than the
    model's errors between options at short lengths, where ``bench costmodel`` measured options predicted
    up to 28% slow, and ``bench e2e`` two MLPs predicted 22% apart that run within 5% of each other."""

    def __post_init__(self) -> None:
        _check_fraction("explore_share", self.explore_share)
        _check_fraction("explore_margin", self.explore_margin)
        if not (isinstance(self.learn_prior, (int, float)) and 0 < self.learn_prior < math.inf):
            raise ValueError(f"planner.learn_prior must be a positive number (micro-batches), got {self.learn_prior!r}")


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class PlannerConfig:
    """The ``planner`` section: its groups of keys, and what to do about a micro-batch no plan fits.

    Built from the section's flat keys, each set in its group (``PlannerConfig(hysteresis=0.1)``), or
    from whole groups (``PlannerConfig(space=SearchSpace(...))``); keys given beside a group change it.
    So ``dataclasses.replace(config, hysteresis=0.1)`` works as on a flat config.
    """

    space: SearchSpace = dataclasses.field(metadata=_FLAT)
    cache: PlanCacheConfig = dataclasses.field(metadata=_FLAT)
    learning: LearningConfig = dataclasses.field(metadata=_FLAT)
    on_infeasible: Literal["skip", "stop"]
    """A micro-batch no plan fits: ``skip`` logs it and returns None (the caller skips it);
    ``stop`` raises :class:`~megatron_paradyse.planner.InfeasibleSequenceError`."""

    def __init__(
        self,
        *,
        space: SearchSpace | None = None,
        cache: PlanCacheConfig | None = None,
        learning: LearningConfig | None = None,
        on_infeasible: Literal["skip", "stop"] = "stop",
        **keys: object,
    ) -> None:
        groups = (
            ("space", space, SearchSpace),
            ("cache", cache, PlanCacheConfig),
            ("learning", learning, LearningConfig),
        )
        for name, group, group_type in groups:
            changes = {f.name: keys.pop(f.name) for f in dataclasses.fields(group_type) if f.name in keys}
            if group is None:
                group = group_type(**changes)
            elif changes:
                group = dataclasses.replace(group, **changes)
            object.__setattr__(self, name, group)
        if keys:
            raise TypeError(f"PlannerConfig got unknown planner keys: {', '.join(sorted(keys))}")
        _check_choice("on_infeasible", on_infeasible, ("skip", "stop"))
        object.__setattr__(self, "on_infeasible", on_infeasible)

    def forward_only(self) -> PlannerConfig:
        """This config for passes without a backward (validation, test): nothing is recomputed, so
        nothing is offloaded either."""
        return dataclasses.replace(self, recompute=False, host_memory_gib=0.0)


def _names(name: str, value: Sequence[str] | None) -> tuple[str, ...] | None:
    """A list of strategy (or pair) names as a tuple; None stays None."""
    if value is None:
        return None
    if isinstance(value, str) or not all(isinstance(v, str) and v for v in value) or not value:
        raise ValueError(f"planner.{name} must be a non-empty list of names, got {value!r}")
    return tuple(value)


def _check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"planner.{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_count(name: str, value: object, *, least: int, zero: str = "") -> None:
    """An int of at least ``least`` (0 or 1); ``zero``: what 0 means, where it is allowed."""
    if not isinstance(value, int) or value < least:
        kind = f"non-negative int (0: {zero})" if least == 0 else "positive int"
        raise ValueError(f"planner.{name} must be a {kind}, got {value!r}")


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"planner.{name} must be in [0, 1), got {value}")


def layer_options(config: PlannerConfig, shape: ModelShape, p: int) -> tuple[tuple[LayerOption, ...], dict[str, str]]:
    """The options a layer may take, and the strategies (or pairs) left out with the reason.

    Strategies whose preconditions fail for ``shape`` on ``p`` ranks are left out, whether listed
    in the config or not (unknown names never get this far: the config refuses them). Options come in
    the library's order (fastest first), each without then with recompute, rerunning its attention core
    or keeping it (then both offloaded, where host memory is given), then the same with the MLP in tiles
    (where a tile size is given).
    """
    space = config.space
    allowed, excluded = {}, {}
    for sublayer, wanted in (("attention", space.attention), ("mlp", space.mlp)):
        usable, skipped = available_strategies(sublayer, shape, p)
        allowed[sublayer] = [n for n in usable if wanted is None or n in wanted]
        excluded.update({f"{sublayer} {n}": why for n, why in skipped.items() if wanted is None or n in wanted})
    if space.pairs is None:
        pairs = list(itertools.product(allowed["attention"], allowed["mlp"]))
    else:
        pairs = []
        for text in space.pairs:
            option = LayerOption.parse(text)
            missing = [
                f"{sublayer} {name}"
                for sublayer, name in (("attention", option.attention), ("mlp", option.mlp))
                if name not in allowed[sublayer]
            ]
            if missing:
                excluded[f"pair {text}"] = f"{' and '.join(missing)} cannot run this model"
            else:
                pairs.append((option.attention, option.mlp))
    recomputes = [(True, False, False), (True, False, True)] * space.recompute  # the core rerun or kept
    offloaded = [(True, True, False), (True, True, True)] * bool(space.host_memory_gib)
    kinds = [(False, False, False), *recomputes, *offloaded]
    tiles = (0, space.mlp_tile_tokens) if space.mlp_tile_tokens else (0,)
    options = tuple(
        LayerOption(a, m, rc, off, tile, keep) for a, m in pairs for tile in tiles for rc, off, keep in kinds
    )
    if not options:
        reasons = "; ".join(f"{what}: {why}" for what, why in excluded.items()) or "none enabled"
        raise ValueError(f"no layer option is left for this model on p={p} ranks ({reasons})")
    return options, excluded
