"""``bench e2e``'s report: per corpus, the documents, the arms' table (trained, longest, time per length
bin, peaks against the budget and the cost model, last loss), the adaptive arms' plans and ratios; and
the last line over every corpus (:mod:`megatron_paradyse.bench.e2e`)."""

from __future__ import annotations

import math

from megatron_paradyse.bench._e2e_results import (
    ADAPTIVE,
    INFEASIBLE,
    LEARNING,
    MIB,
    OOM,
    ArmResult,
    Corpus,
    CorpusResult,
    SequenceResult,
    time_ratio,
)

__all__ = ["format_length", "print_corpus", "summary_line"]


def format_length(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def print_corpus(result: CorpusResult, corpus: Corpus) -> None:
    lengths = [len(d) for d in corpus.documents]
    bins = result.bins()
    arms = result.arms
    print(
        f"\n== {result.corpus} corpus: {len(lengths)} documents of {min(lengths)}..{max(lengths)} tokens; "
        f"budget {result.budget_bytes / MIB:.1f} MiB per rank ({result.budget_rule}); the planner counts "
        f"{result.planner_static_bytes / MIB:.2f} MiB of weights, gradients and Adam state, the ranks hold "
        f"{max(a.resident_bytes for a in arms.values()) / MIB:.2f} MiB"
    )
    _print_steps(result, corpus)
    head = ["arm", "trained", "longest", "total s (range)"]
    head += [f"[{format_length(a)},{format_length(b)})" for a, b in bins]
    head += ["peak MiB", "over budget", "peak vs model", "last loss"]
    _print_table(head, [_arm_row(arm, bins) for arm in arms.values()])
    _print_adaptive(result)
    _print_ranks(result)
    if result.dp > 1:
        print(
            "weights after training, largest relative difference of a rank's parameter checksum from its TP "
            "rank's on DP rank 0 (0: the DP replicas agree): "
            + ", ".join(f"{name} {arm.replica_difference(result.tp):.1e}" for name, arm in arms.items())
        )
    print(" ".join(f"{k}={v:.3f}" for k, v in result.ratios().items()) + f" ({result.corpus})")


def _arm_row(arm: ArmResult, bins: list[tuple[int, int]]) -> list[str]:
    """One arm's row of the corpus table."""
    trained = arm.trained()
    totals = arm.total_by_repeat()
    cells = [
        arm.name,
        f"{len(trained)}/{len(arm.sequences)}",
        str(arm.longest()),
        f"{arm.time_on(trained):.2f} ({min(totals):.2f}-{max(totals):.2f})" if totals else "-",
    ]
    for low, high in bins:
        inside = [i for i, s in enumerate(arm.sequences) if low <= s.tokens < high]
        done = [i for i in inside if i in trained]
        text = f"{arm.time_on(done):.2f}" if done else "-"
        if len(done) < len(inside):
            text += f" ({len(inside) - len(done)} not)"
        cells.append(text)
    run = [s for s in arm.sequences if s.peak_bytes]
    peak = max((max(s.peak_bytes) for s in trained.values()), default=0)
    over = [s for s in run if s.status == OOM]
    return [
        *cells,
        f"{peak / MIB:.1f}",
        f"{len(over)}" + (f" (worst {max(max(s.peak_bytes) for s in over) / MIB:.1f})" if over else ""),
        _model_error(run),
        f"{trained[max(trained)].loss:.4f}" if trained else "-",
    ]


def _print_adaptive(result: CorpusResult) -> None:
    """What the adaptive arms skipped, planned and learned, and their time against every other arm's."""
    arms = result.arms
    adaptive = arms[ADAPTIVE]
    skipped = [s.tokens for s in adaptive.sequences if s.status == INFEASIBLE]
    if skipped:
        print(f"adaptive: no plan fits the budget for {len(skipped)} sequence(s): {skipped} tokens (skipped)")
    _print_predictions(adaptive)
    print("adaptive plans: " + _plan_counts(s.plans for s in adaptive.trained().values()))
    print(
        f"adaptive: the planner's first decision of each length bucket took {adaptive.first_decisions_s:.3f} s "
        f"in all (memory pass); timed passes reuse its cached plans (decisions included in their times)"
    )
    learning = arms.get(LEARNING)
    if learning is not None:
        done = learning.trained().values()
        print(
            f"{LEARNING} plans, last repeat: {_plan_counts(s.plans_run[-1] for s in done)}; every pass: "
            f"{_plan_counts(plans for s in done for plans in s.plans_run)}; explored in "
            f"{sum(s.explored for s in done)} of {sum(len(s.plans_run) for s in done)} steps"
        )
        print(f"{LEARNING}: time corrections learned (option x[bucket: factor]): {learning.time_corrections}")
    for name in (n for n in (ADAPTIVE, LEARNING) if n in arms):
        print(
            f"{name} / the fastest static arm of each length bin: "
            + "; ".join(
                f"[{format_length(low)},{format_length(high)}) " + (f"{ratio:.3f} vs {best}" if best else "-")
                for low, high, best, ratio in result.per_bucket(name)
            )
        )
    for name, arm in arms.items():
        if name != ADAPTIVE:
            both = adaptive.trained().keys() & arm.trained().keys()
            print(f"adaptive / {name}: {time_ratio(adaptive, arm):.3f} over the {len(both)} sequences both trained")


def _print_ranks(result: CorpusResult) -> None:
    """Every rank's predicted and measured peak and forward + backward time under each arm the cost model
    predicts; each arm's throughput, MFU and host synchronisations."""
    rows = [
        [
            arm.name,
            str(f.rank),
            f"{f.predicted_peak_bytes / MIB:.1f}",
            f"{f.peak_bytes / MIB:.1f}",
            f"{f.predicted_peak_bytes / f.peak_bytes:.3f}",
            f"{f.predicted_s:.3f}",
            f"{f.measured_s:.3f}",
            f"{f.predicted_s / f.measured_s:.3f}",
        ]
        for arm in result.arms.values()
        for f in arm.per_rank()
    ]
    print(
        "per rank: the peak of the step of the rank's largest measured peak (after the arm's first), and "
        "forward + backward (as the training loop measures a micro-batch) summed over the steps trained, "
        "medians over the repeats; predicted by the cost model (no prediction for Megatron's layers)"
    )
    _print_table(["arm", "rank", "pred peak MiB", "peak MiB", "pred/meas", "pred f+b s", "f+b s", "pred/meas"], rows)
    rows = []
    for name, arm in result.arms.items():
        syncs = "-" if arm.host_syncs is None else str(len(arm.host_syncs))
        first = f" (first: {arm.host_syncs[0]})" if arm.host_syncs else ""
        done = bool(arm.trained())
        speed = f"{arm.tokens_per_s():.0f}" if done else "-"
        rows.append([name, speed, f"{result.mfu(name):.1%}" if done else "-", syncs + first])
    print(
        "throughput: tokens of the steps trained over their times; MFU: their model FLOPs (transformer layers, "
        "forward and backward) over their times at the GPU's dense bf16 peak on every rank (nan: no known "
        "peak); host syncs: in forward + backward, every step of the memory pass after the first"
    )
    _print_table(["arm", "tokens/s", "MFU", "host syncs"], rows)


def _plan_counts(plans_per_step) -> str:
    """``"3x [plan]; 1x [other plan]"`` over the DP ranks' plans of each step, in order of first use."""
    counts: dict[str, int] = {}
    for plans in plans_per_step:
        for plan in plans:
            counts[plan] = counts.get(plan, 0) + 1
    return "; ".join(f"{n}x [{plan}]" for plan, n in counts.items())


def _print_steps(result: CorpusResult, corpus: Corpus) -> None:
    """How the documents became micro-batches and the micro-batches steps (nothing to say for the default)."""
    count = len(corpus.micro_batches)
    if result.pack_tokens is not None:
        totals = [sum(corpus.micro_batch_tokens(m)) for m in corpus.micro_batches]
        sizes = [len(m) for m in corpus.micro_batches]
        print(
            f"packed into {count} micro-batches of {min(totals)}..{max(totals)} tokens and {min(sizes)}..{max(sizes)} "
            f"documents (at most {result.pack_tokens} tokens each, a longer document alone); a sequence's "
            f"length is its micro-batch's total tokens"
        )
    if result.dp > 1:
        steps = count // result.dp
        print(
            f"DP={result.dp}: micro-batch i on DP rank i % {result.dp}; {steps} steps of {result.dp} micro-batches, "
            f"the last {count - steps * result.dp} micro-batch(es) dropped; a sequence below is one step (its "
            f"length: its longest micro-batch's tokens; its time: between barriers of all {result.tp * result.dp} "
            f"ranks; its peaks: of every rank)"
        )


def _model_error(sequences: list[SequenceResult]) -> str:
    """The range of (measured peak / the cost model's) - 1 over the micro-batches of ``sequences`` after
    the step that creates the optimizer's state."""
    errors = [
        measured / predicted - 1
        for s in sequences
        if not s.creates_optimizer_state
        for _, _, predicted, measured in s.peaks_vs_predicted()
    ]
    return f"{min(errors):+.1%}..{max(errors):+.1%}" if errors else "-"


def _print_predictions(adaptive: ArmResult) -> None:
    """How the planner's predicted peaks compare with the measured ones (the worst under-prediction)."""
    rows = [row for s in adaptive.sequences if s.peak_bytes for row in s.peaks_vs_predicted()]
    if not rows:
        return
    tokens, plan, predicted, measured = max(rows, key=lambda row: row[3] - row[2])
    print(
        f"adaptive: predicted vs measured peak: worst at {tokens} tokens [{plan}]: predicted "
        f"{predicted / MIB:.2f} MiB, measured {measured / MIB:.2f} MiB ({(measured - predicted) / predicted:+.1%})"
    )


def _print_table(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for row in [head, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))


def summary_line(results: list[CorpusResult]) -> str:
    ratios = [r.ratios() for r in results]

    def worst(key: str, pick) -> float:
        values = [r[key] for r in ratios]
        return math.nan if any(math.isnan(v) for v in values) else pick(values)

    errors = [abs(e) for r in results for e in r.arms[ADAPTIVE].peak_errors()]
    peaks = [ratio for r in results for arm in r.arms.values() for ratio in arm.peak_ratios()]
    times = [f.predicted_s / f.measured_s for r in results for arm in r.arms.values() for f in arm.per_rank()]
    adaptive = [r.arms[ADAPTIVE] for r in results]
    syncs = [len(arm.host_syncs) for arm in adaptive]
    throughput = [arm.tokens_per_s() if arm.trained() else math.nan for arm in adaptive]
    mfu = [r.mfu(ADAPTIVE) for r in results]
    return (
        f"adaptive_vs_best_static={worst('adaptive_vs_best_static', max):.3f} "
        f"adaptive_vs_megatron={worst('adaptive_vs_megatron', max):.3f} "
        f"max_len_ratio={worst('max_len_ratio', min):.3f} "
        f"adaptive_vs_best_per_bucket_max={worst('adaptive_vs_best_per_bucket_max', max):.3f} "
        f"step_mem_err_max={max(errors, default=math.nan) * 100:.2f} "
        f"learn_vs_adaptive={worst('learn_vs_adaptive', max):.3f} "
        f"learn_vs_best_per_bucket_max={worst('learn_vs_best_per_bucket_max', max):.3f} "
        f"peak_predicted_over_measured_min={min(peaks, default=math.nan):.3f} "
        f"peak_predicted_over_measured_max={max(peaks, default=math.nan):.3f} "
        f"time_predicted_over_measured_min={min(times, default=math.nan):.3f} "
        f"time_predicted_over_measured_max={max(times, default=math.nan):.3f} "
        f"host_syncs={max(syncs)} tokens_per_s={_least(throughput):.0f} mfu={_least(mfu) * 100:.1f}"
    )


def _least(values: list[float]) -> float:
    """The smallest of ``values``; nan if any is."""
    return math.nan if any(math.isnan(v) for v in values) else min(values)
