"""The plan cache: a micro-batch is planned as if it filled its length bucket (costs at the bucket's
upper edge, which over-estimates memory, never under-estimates it), so the micro-batches of a bucket
share one plan; the plans of the buckets used last are kept (``planner.cache_size``), and the previous
micro-batch's plan is kept instead of a new optimum while it fits and is predicted at most
``planner.hysteresis`` slower (the paper's gamma)."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import Plan
from megatron_paradyse.cost.base import StageOptions
from megatron_paradyse.planner.buckets import LengthBuckets
from megatron_paradyse.planner.config import PlanCacheConfig
from megatron_paradyse.planner.problem import Solution, StageProblem

__all__ = ["BucketKey", "PlanCache", "PlannedBucket", "Previous"]

BucketKey = tuple
"""(bucket edge, micro-batch size, p, causal, token order, document lengths or None, the step's longest
micro-batch at its bucket's edge or None): what a bucket's plan depends on."""

Previous = tuple[StageOptions, tuple[int, ...]]
"""A plan as the planner remembers the previous one: its stage option and its layer counts."""


@dataclasses.dataclass(frozen=True, slots=True)
class PlannedBucket:
    """A bucket's problems and the best plan of them, or none."""

    problems: dict[StageOptions, StageProblem]
    """The problems posed, one per stage option priced."""
    problem: StageProblem
    """The chosen stage option's (the leanest one's when no plan fits)."""
    solution: Solution | None
    plan: Plan | None


class PlanCache:
    """Planned buckets by :data:`BucketKey`, the least recently used dropped first beyond
    ``config.cache_size``, with the length buckets (none past ``bucket_cap`` tokens,
    :class:`~megatron_paradyse.planner.buckets.LengthBuckets`) and the hysteresis of ``config``."""

    def __init__(self, config: PlanCacheConfig, bucket_cap: int | None = None) -> None:
        self.config = config
        self.buckets = LengthBuckets(config.bucket, config.bucket_tokens, config.bucket_ratio, bucket_cap)
        self._planned: collections.OrderedDict[BucketKey, PlannedBucket] = collections.OrderedDict()

    def key(self, layout: SequenceLayout, micro_batch_size: int, step_edge: int | None) -> BucketKey:
        """The bucket ``layout`` falls in; its document lengths only where packings are costed as their
        documents (``planner.packed_as``)."""
        edge = self.buckets.edge(layout.padded_len, 2 * layout.p)
        docs = layout.doc_lengths if self.config.packed_as == "documents" else None
        return (edge, micro_batch_size, layout.p, layout.causal, layout.order, docs, step_edge)

    @staticmethod
    def layout(key: BucketKey) -> SequenceLayout:
        """What a bucket is planned as: its upper edge (its documents, where the key holds them)."""
        edge, _, p, causal, order, docs, _ = key
        return SequenceLayout(docs or (edge,), p, causal, edge, order)

    def get_or_plan(self, key: BucketKey, plan: Callable[[BucketKey], PlannedBucket]) -> tuple[PlannedBucket, bool]:
        """The bucket's plan, and whether it was cached; planned by ``plan`` and kept where it was not."""
        planned = self._planned.get(key)
        if planned is not None:
            self._planned.move_to_end(key)
            return planned, True
        planned = self._planned[key] = plan(key)
        if len(self._planned) > self.config.cache_size:
            self._planned.popitem(last=False)
        return planned, False

    def clear(self) -> None:
        self._planned.clear()

    def previous_kept(self, planned: PlannedBucket, previous: Previous | None) -> tuple[StageProblem, Solution] | None:
        """``previous`` in ``planned``'s bucket where hysteresis keeps it instead of the bucket's optimum:
        it is another plan, it fits, and it is predicted at most ``hysteresis`` slower; else None."""
        optimum = planned.solution
        if previous is None or previous == (planned.problem.stage, optimum.counts):
            return None
        stage, counts = previous
        problem = planned.problems.get(stage)
        old = None if problem is None else problem.evaluate(counts)
        if old is not None and problem.fits(old) and old.time_s <= (1 + self.config.hysteresis) * optimum.time_s:
            return problem, old
        return None
