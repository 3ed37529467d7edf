"""``python -m megatron_paradyse.bench e2e``: two small runs on gloo ranks, their output and their accounting.

The first run trains the demo's GPT on six short synthetic-DNA documents, one per micro-batch, under
every arm on 2 ranks (TP=2), one timed repeat, with the default (derived) budget. The second packs
eight such documents into micro-batches of at most 512 tokens and trains them on 4 ranks (TP=2 x DP=2)
under a fixed budget, every arm but Megatron's (which cannot attend per document on CPU). Their cost
profile is built from published A100 figures relabelled fp32 with no allocator slack: the arms' plans and
peaks do not depend on its rates (the adaptive arm's choices do, which is all this test needs from it),
and a CPU calibration would take minutes.

What is checked: the tables and the last line; that the derived budget makes ``tp_sp/tp_sp`` fail on
the longest document and ``lean/lean`` train every one; that a sequence is trained if and only if its
measured peak is within the budget on every rank (the rest are OOMs, counted, not timed); that the
ratios of the last line are those of the recorded times and lengths; that every arm trains the
same model: sequences trained by arms that have trained the same sequences before give the same loss,
stock Megatron included; that packed micro-batches hold consecutive documents, several in some, never
over the token budget; and that with DP=2 both DP ranks train their own micro-batch of each step and
end with the same weights (their gradients averaged).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re

import pytest

from megatron_paradyse.bench import _e2e_arms as e2e_arms
from megatron_paradyse.bench import _e2e_results as e2e_results
from megatron_paradyse.bench import e2e
from megatron_paradyse.bench.memory import PAIRINGS
from megatron_paradyse.cost.profile import save_profile

from helpers.cost_profiles import published_profile

P = 2
DP = 2
PACK = 512
LOSS_TOLERANCE = 1e-4
LEARN_PASSES = 2
LAST_LINE = (
    r"adaptive_vs_best_static=(\S+) adaptive_vs_megatron=(\S+) max_len_ratio=(\S+) "
    r"adaptive_vs_best_per_bucket_max=(\S+) step_mem_err_max=(\S+) learn_vs_adaptive=(\S+) "
    r"learn_vs_best_per_bucket_max=(\S+) peak_predicted_over_measured_min=(\S+) peak_predicted_over_measured_max=(\S+) "
    r"time_predicted_over_measured_min=(\S+) time_predicted_over_measured_max=(\S+) host_syncs=(\d+) "
    r"tokens_per_s=(\S+) mfu=(\S+)"
)
PACKED_BUDGET_MIB = 14.75
"""The packed run's budget. The derived one (midway, 14.1 MiB) fell within 2 KiB of ring/zero3's measured peak
on the first step, which then trained or not by a few bytes of gloo's buffers; at 14.75 MiB every arm trains
the first step (0.65 MiB to spare) and no static arm but lean/lean trains the second (over by 1.9 MiB or more)."""
STEP_MEMORY_TOLERANCE_PERCENT = 2.0
"""Issue 15's target for the whole step's peak against the cost model's (the CPU runs agree within 0.5%)."""


def _bench(tmp_path_factory, name: str, argv: list[str]) -> tuple[str, dict]:
    """(stdout, the JSON result of the one corpus) of a small run on the DNA corpus with ``argv`` added."""
    tmp = tmp_path_factory.mktemp(name)
    save_profile(published_profile(P), tmp / "profile.json")
    argv = ["--p", str(P), "--corpora", "dna", "--min-len", "64", "--max-len", "512", *argv]
    argv += ["--repeats", "1", "--learn-passes", str(LEARN_PASSES)]
    argv += ["--profile", str(tmp / "profile.json"), "--cache-dir", str(tmp / "cache")]
    argv += ["--json", str(tmp / "result.json")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert e2e.main(argv) == 0
    (result,) = json.loads((tmp / "result.json").read_text())
    return out.getvalue(), result


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[str, dict]:
    return _bench(tmp_path_factory, "bench-e2e", ["--sequences", "6"])


@pytest.fixture(scope="module")
def packed_dp_run(tmp_path_factory) -> tuple[str, dict]:
    argv = ["--sequences", "8", "--pack", str(PACK), "--dp", str(DP), "--budget-mib", str(PACKED_BUDGET_MIB)]
    return _bench(tmp_path_factory, "bench-e2e-packed-dp", argv)


def test_small_run_output_and_accounting(run):
    out, result = run
    lines = out.strip().splitlines()
    assert "PeakMemory" in lines[1] and "16 B/param" in lines[1]  # how the peak is measured
    last = re.fullmatch(LAST_LINE, lines[-1])
    assert last, lines[-1]
    budget_mib = result["budget_bytes"] / 2**20
    assert re.search(rf"^== dna corpus: 6 documents of \d+\.\.\d+ tokens; budget {budget_mib:.1f} MiB", out, re.M)
    arms = result["arms"]
    assert list(arms) == [*PAIRINGS, e2e_results.MEGATRON, e2e_results.ADAPTIVE, e2e_results.LEARNING]
    for name in arms:
        assert re.search(rf"^{re.escape(name)}\s+\d/6\s+\d+\s", out, re.M), name
    for arm in arms.values():
        assert all(len(s["document_tokens"]) == 1 and len(s["document_tokens"][0]) == 1 for s in arm["sequences"])

    _check_budget_accounting(result, ranks=P)
    assert arms["tp_sp/tp_sp"]["sequences"][-1]["status"] == e2e_results.OOM
    assert all(s["status"] == e2e_results.TRAINED for s in arms["lean/lean"]["sequences"])

    results = _corpus_result(result)
    ratios = results.ratios()
    keys = ("adaptive_vs_best_static", "adaptive_vs_megatron", "max_len_ratio", "adaptive_vs_best_per_bucket_max")
    printed = [float(v) for v in last.groups()]
    assert printed[:4] == pytest.approx([round(ratios[k], 3) for k in keys], abs=1e-3, nan_ok=True)
    errors = results.arms[e2e_results.ADAPTIVE].peak_errors()
    assert errors and printed[4] == pytest.approx(100 * max(map(abs, errors)), abs=0.01)
    # per power-of-two bin: adaptive over the fastest static arm that trains the whole bin
    adaptive = results.arms[e2e_results.ADAPTIVE]
    worst = math.nan
    for low in (64, 128, 256, 512):
        inside = [i for i, s in enumerate(adaptive.sequences) if low <= s.tokens < 2 * low]
        whole = [results.arms[n] for n in PAIRINGS if all(i in results.arms[n].trained() for i in inside)]
        both = [i for i in inside if i in adaptive.trained()]
        if inside and whole and both:
            best = min(sum(a.sequences[i].time_s for i in inside) for a in whole)
            fastest = next(a for a in whole if sum(a.sequences[i].time_s for i in inside) == best)
            ratio = sum(adaptive.sequences[i].time_s for i in both) / sum(fastest.sequences[i].time_s for i in both)
            worst = ratio if math.isnan(worst) else max(worst, ratio)
    assert ratios["adaptive_vs_best_per_bucket_max"] == pytest.approx(worst, nan_ok=True)
    assert re.search(r"^adaptive / the fastest static arm of each length bin: \[", out, re.M)
    static_longest = max(results.arms[n].longest() for n in PAIRINGS)
    assert ratios["max_len_ratio"] == results.arms[e2e_results.ADAPTIVE].longest() / static_longest
    learning = results.arms[e2e_results.LEARNING]
    both = learning.trained().keys() & adaptive.trained().keys()
    learn_vs_adaptive = learning.time_on(both) / adaptive.time_on(both)
    learn_worst_bin = max(ratio for *_, ratio in results.per_bucket(e2e_results.LEARNING) if not math.isnan(ratio))
    assert printed[5:7] == pytest.approx([learn_vs_adaptive, learn_worst_bin], abs=1e-3)
    _check_learning_arm(out, result)
    _check_rank_figures(out, results, printed[7:])

    assert _compare_losses_across_arms(results) >= 5  # at least the shortest document, trained by every arm
    _check_each_arm_trains_its_own_weights(results)


def _check_rank_figures(out: str, results: e2e_results.CorpusResult, printed: list[float]) -> None:
    """Every rank's predicted and measured peak and forward + backward time under each arm with a cost model,
    in a table and, at their extremes, in the last line; the adaptive arm's host syncs, tokens/s and MFU."""
    predicted = [*PAIRINGS, e2e_results.ADAPTIVE]
    for name in predicted:
        figures = results.arms[name].per_rank()
        assert [f.rank for f in figures] == list(range(P)), name
        for f in figures:
            assert 0 < f.measured_s and 0 < f.predicted_s and 0 < f.peak_bytes and 0 < f.predicted_peak_bytes
            row = (
                rf"^{re.escape(name)}\s+{f.rank}\s+{f.predicted_peak_bytes / 2**20:.1f}\s+{f.peak_bytes / 2**20:.1f}\s"
            )
            assert re.search(row, out, re.M), (name, f)
    assert not results.arms[e2e_results.MEGATRON].per_rank()  # no prediction for Megatron's own layers
    peaks = [r for name in predicted for r in results.arms[name].peak_ratios()]
    times = [f.predicted_s / f.measured_s for name in predicted for f in results.arms[name].per_rank()]
    assert printed[:4] == pytest.approx([min(peaks), max(peaks), min(times), max(times)], abs=1e-3)
    adaptive = results.arms[e2e_results.ADAPTIVE]
    done = adaptive.trained().values()
    tokens = sum(s.tokens for s in done)
    assert printed[4] == len(adaptive.host_syncs)
    assert printed[5] == pytest.approx(tokens / sum(s.time_s for s in done), abs=0.5)
    assert math.isnan(printed[6]), "MFU on a CPU: no peak to compare with"


def _check_each_arm_trains_its_own_weights(results: e2e_results.CorpusResult) -> None:
    """The arms take turns on one model, each with its own weights and Adam: two arms end with the same
    weights (rank 0's checksum, to float rounding: about 1e-7 apart here) exactly when they trained the
    same sequences (one step more moves it by about 1e-4)."""
    arms = list(results.arms.values())
    for i, a in enumerate(arms):
        for b in arms[i + 1 :]:
            same = math.isclose(a.weight_checksums[0], b.weight_checksums[0], rel_tol=1e-6)
            assert same == (a.trained().keys() == b.trained().keys()), (
                a.name,
                b.name,
                a.weight_checksums[0],
                b.weight_checksums[0],
            )


def test_adaptive_stays_within_budget(run, packed_dp_run):
    """The planner's predicted peaks hold on the ranks: no sequence of a planned arm is an OOM, and every step's
    measured peak (weights, gradients, Adam, inputs, embedding, layers, output layer, loss) is within 2% of
    the cost model's for its plan."""
    for out, result in (run, packed_dp_run):
        step_mem_err = float(re.fullmatch(LAST_LINE, out.strip().splitlines()[-1]).group(5))
        assert step_mem_err <= STEP_MEMORY_TOLERANCE_PERCENT, out
        for name in (e2e_results.ADAPTIVE, e2e_results.LEARNING):  # the learning arm: every plan it ran, measured after
            over = [s for s in result["arms"][name]["sequences"] if s["status"] == e2e_results.OOM]
            assert not over, [
                (s["document_tokens"], s["plans"], s["peak_bytes"], s["predicted_peak_bytes"]) for s in over
            ]


def test_packed_documents_on_two_dp_ranks(packed_dp_run):
    out, result = packed_dp_run
    lines = out.strip().splitlines()
    assert f"TP={P}, sequence parallel; DP={DP}" in lines[0] and f"at most {PACK} tokens" in lines[0]
    assert lines[2].startswith("megatron arm: not run with --pack")
    last = re.fullmatch(LAST_LINE, lines[-1])
    assert last and last.group(2) == "nan", lines[-1]  # no megatron arm; the other ratios are measured
    assert not math.isnan(float(last.group(3)))
    assert (result["tp"], result["dp"], result["pack_tokens"]) == (P, DP, PACK)
    arms = result["arms"]
    assert list(arms) == [*PAIRINGS, e2e_results.ADAPTIVE, e2e_results.LEARNING]
    _check_budget_accounting(result, ranks=P * DP)

    # Packed: consecutive documents in curriculum order, several in some micro-batches, none over the budget.
    steps = [s["document_tokens"] for s in arms[e2e_results.ADAPTIVE]["sequences"]]
    assert all(s["document_tokens"] == step for arm in arms.values() for s, step in zip(arm["sequences"], steps))
    micro_batches = [micro_batch for step in steps for micro_batch in step]
    packed = re.search(
        r"^packed into (\d+) micro-batches .* the last (\d+) micro-batch\(es\) dropped", out, re.M | re.S
    )
    assert packed and len(micro_batches) == int(packed.group(1)) - int(packed.group(2))
    documents = [n for micro_batch in micro_batches for n in micro_batch]
    assert documents == sorted(documents) and len(documents) <= 8
    assert all(sum(micro_batch) <= PACK for micro_batch in micro_batches), micro_batches
    assert max(len(micro_batch) for micro_batch in micro_batches) > 1, micro_batches

    # DP: every step holds one micro-batch per DP rank, each trained by its DP rank; the replicas agree.
    assert len(steps) >= 2 and all(len(step) == DP for step in steps)
    for name, arm in arms.items():
        trained = [s for s in arm["sequences"] if s["status"] == e2e_results.TRAINED]
        assert trained, name
        for s in trained:
            assert len(s["peak_bytes"]) == P * DP and len(s["losses"]) == DP, (name, s)
            assert all(math.isfinite(loss) for loss in s["losses"]) and len(set(s["losses"])) == DP, (name, s)
        checksums = arm["weight_checksums"]
        assert len(checksums) == P * DP
        assert checksums[P:] == checksums[:P], (name, checksums)  # DP rank 1's shards equal DP rank 0's
        assert checksums[0] != checksums[1], (name, checksums)  # TP ranks hold different shards
    assert re.search(r"^weights after training, .*: tp_sp/tp_sp 0\.0e\+00, ", out, re.M)

    assert _compare_losses_across_arms(_corpus_result(result)) >= 3  # the first step, trained by every arm


def _check_learning_arm(out: str, result: dict) -> None:
    """The adaptive+learn arm trains what the adaptive arm trains within budget, records the plan of every
    step it timed and the peak of the plan of highest peak (within the budget), and prints what it learned."""
    adaptive, learning = (result["arms"][name]["sequences"] for name in (e2e_results.ADAPTIVE, e2e_results.LEARNING))
    assert [s["status"] for s in learning] == [s["status"] for s in adaptive]
    for s in learning:
        if s["status"] == e2e_results.TRAINED:
            assert len(s["times_s"]) == 1 and len(s["plans_run"]) == LEARN_PASSES + 1
            assert tuple(s["plans"]) in map(tuple, s["plans_run"])
            assert len(s["predicted_peak_bytes"]) == len(s["plans"]) and not s["creates_optimizer_state"]
    learned = re.search(r"^adaptive\+learn: time corrections learned \(option x\[bucket: factor\]\): (.*)$", out, re.M)
    assert learned and learned.group(1) == result["arms"][e2e_results.LEARNING]["time_corrections"]
    assert re.fullmatch(r"(\S+ x\[\d+:[\d.e+-]+(, \d+:[\d.e+-]+)*\](; )?)+", learned.group(1)), learned.group(1)
    steps = sum(s["status"] == e2e_results.TRAINED for s in learning) * (LEARN_PASSES + 1)
    assert re.search(rf"^adaptive\+learn plans, last repeat: .*; explored in \d+ of {steps} steps$", out, re.M)


def _check_budget_accounting(result: dict, *, ranks: int) -> None:
    """Every run sequence has a peak per rank; trained if and only if every peak is within the budget."""
    budget = result["budget_bytes"]
    for name, arm in result["arms"].items():
        for s in arm["sequences"]:
            if s["status"] == e2e_results.INFEASIBLE:
                assert name in (e2e_results.ADAPTIVE, e2e_results.LEARNING) and not s["peak_bytes"]
                continue
            assert len(s["peak_bytes"]) == ranks
            over = max(s["peak_bytes"]) > budget
            assert s["status"] == (e2e_results.OOM if over else e2e_results.TRAINED), (name, s)
            assert len(s["times_s"]) == (0 if over else 1)


def _compare_losses_across_arms(results: e2e_results.CorpusResult) -> int:
    """Every arm trains the same model: the same history of trained sequences gives the same loss.
    Returns how many pairs of arms were compared."""
    by_history: dict[tuple, list[tuple[str, float]]] = {}
    for name, arm in results.arms.items():
        for i, s in arm.trained().items():
            history = tuple(j for j in arm.trained() if j <= i)
            by_history.setdefault(history, []).append((name, s.loss))
    compared = 0
    for history, losses in by_history.items():
        first_name, first = losses[0]
        for name, loss in losses[1:]:
            assert math.isclose(loss, first, rel_tol=LOSS_TOLERANCE), (history, first_name, first, name, loss)
            compared += 1
    return compared


def _corpus_result(data: dict) -> e2e_results.CorpusResult:
    arms = {
        name: e2e_results.ArmResult(
            arm["name"],
            [e2e_results.SequenceResult(**s) for s in arm["sequences"]],
            arm["resident_bytes"],
            weight_checksums=tuple(arm["weight_checksums"]),
            host_syncs=None if arm["host_syncs"] is None else tuple(arm["host_syncs"]),
        )
        for name, arm in data["arms"].items()
    }
    return e2e_results.CorpusResult(**{**data, "arms": arms})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--arms", "tp_sp/tp_sp,adaptive"], "--arms must include lean/lean, megatron"),
        (["--arms", "tp_sp/tp_sp,lean/lean,megatron,adaptive,zz"], "--arms: unknown zz"),
        (["--corpora", "code,wiki"], "--corpora takes code and/or dna, got 'code,wiki'"),
        (["--pack", "512", "--arms", "tp_sp/tp_sp,lean/lean,megatron,adaptive"], "megatron cannot run with --pack"),
        (["--dp", "0"], "--repeats, --p, --dp and --pack must be >= 1"),
        (["--learn-passes", "-1"], "--learn-passes must be >= 0, got -1"),
        (["--layers", "0"], "--layers must be >= 1, got 0"),
        (["--", "--hidden-size", "64"], "Megatron flags (--hidden-size 64) go with --model, which they override"),
        (["--device", "cuda"], "--device cuda needs --profile, a cost profile calibrated on this machine"),
        (
            ["--model", "configs/llama3-8b.yaml", "--", "--position-embedding-type", "learned_absolute"],
            "--model configs/llama3-8b.yaml: bench e2e trains RoPE GPTs, and its flags give "
            "--position-embedding-type learned_absolute",
        ),
        (["--model", "configs/llama3-8b.yaml", "--", "--hidden-sise", "64"], "--hidden-sise: not a Megatron flag"),
    ],
)
def test_bad_arguments_exit_2_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        e2e.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_under_torchrun_rank_zero_alone_says_what_is_wrong(monkeypatch, capsys):
    """Every rank of a torchrun launch checks the arguments alike and exits 2; rank 0 alone prints why."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    for rank, said in (
        ("0", "bench e2e: error: --p 2 x --dp 1 makes 2 ranks, and torchrun started 3: give --nproc-per-node 2\n"),
        ("1", ""),
    ):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_:
            e2e.main(["--p", "2"])
        assert (exit_.value.code, capsys.readouterr().err) == (2, said)


def test_no_arm_always_follows_the_same_arm_in_the_timed_passes():
    """The arms take turns at each step of each repeat, in orders that differ from step to step."""
    names = ["tp_sp/tp_sp", "ulysses/zero3", "ring/zero3", "lean/lean", "megatron", "adaptive", "adaptive+learn"]
    orders = [e2e_arms.arm_order(names, repeat, step) for repeat in range(3) for step in range(16)]
    assert all(sorted(order) == sorted(names) for order in orders)
    assert orders == [e2e_arms.arm_order(names, r, s) for r in range(3) for s in range(16)]  # the same on every rank
    before_adaptive = [order[order.index("adaptive") - 1] for order in orders]  # cyclically: a rotation fails
    assert set(before_adaptive) == set(names) - {"adaptive"}, orders
    assert len({tuple(order) for order in orders}) == len(orders)
