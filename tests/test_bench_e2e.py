"""``python -m megatron_paradyse.bench e2e``: one small run on 2 gloo ranks, its output and its accounting.

The run trains the demo's GPT on six short synthetic-DNA documents under every arm, one timed repeat,
with the default (derived) budget. Its cost profile is built from published A100 figures relabelled
fp32 with no allocator slack: the arms' plans and peaks do not depend on its rates (the adaptive
arm's choices do, which is all this test needs from it), and a CPU calibration would take minutes.

What is checked: the tables and the last line; that the derived budget makes ``tp_sp/tp_sp`` fail on
the longest document and ``lean/lean`` train every one; that a sequence is trained if and only if its
measured peak is within the budget on every rank (the rest are OOMs, counted, not timed); that the
ratios of the last line are those of the recorded times and lengths; and that every arm trains the
same model: sequences trained by arms that have trained the same sequences before give the same loss,
stock Megatron included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import re

import pytest

from megatron_paradyse.bench import e2e
from megatron_paradyse.cost.hardware import HARDWARE, hardware_profile
from megatron_paradyse.cost.profile import save_profile

P = 2
LOSS_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[str, dict]:
    """(stdout, the JSON result of the one corpus) of the small run."""
    tmp = tmp_path_factory.mktemp("bench-e2e")
    profile = hardware_profile(dataclasses.replace(HARDWARE["a100"], p=P))
    profile.update(dtype="float32", allocator_slack=0.0)
    save_profile(profile, tmp / "profile.json")
    argv = ["--p", str(P), "--corpora", "dna", "--sequences", "6", "--min-len", "64", "--max-len", "512"]
    argv += ["--repeats", "1", "--profile", str(tmp / "profile.json"), "--cache-dir", str(tmp / "cache")]
    argv += ["--json", str(tmp / "result.json")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert e2e.main(argv) == 0
    (result,) = json.loads((tmp / "result.json").read_text())
    return out.getvalue(), result


def test_small_run_output_and_accounting(run):
    out, result = run
    lines = out.strip().splitlines()
    assert "PeakMemory" in lines[1] and "16 B/param" in lines[1]  # how the peak is measured
    last = re.fullmatch(
        r"adaptive_vs_best_static=(\S+) adaptive_vs_megatron=(\S+) max_len_ratio=(\S+) "
        r"adaptive_vs_best_per_bucket_max=(\S+)",
        lines[-1],
    )
    assert last, lines[-1]
    budget_mib = result["budget_bytes"] / 2**20
    assert re.search(rf"^== dna corpus: 6 documents of \d+\.\.\d+ tokens; budget {budget_mib:.1f} MiB", out, re.M)
    arms = result["arms"]
    assert list(arms) == [*e2e.PAIRINGS, e2e.MEGATRON, e2e.ADAPTIVE]
    for name in arms:
        assert re.search(rf"^{re.escape(name)}\s+\d/6\s+\d+\s", out, re.M), name

    budget = result["budget_bytes"]
    for name, arm in arms.items():
        for s in arm["sequences"]:
            if s["status"] == e2e.INFEASIBLE:
                assert name == e2e.ADAPTIVE and not s["peak_bytes"]
                continue
            assert len(s["peak_bytes"]) == P
            over = max(s["peak_bytes"]) > budget
            assert s["status"] == (e2e.OOM if over else e2e.TRAINED), (name, s)
            assert len(s["times_s"]) == (0 if over else 1)
    assert arms["tp_sp/tp_sp"]["sequences"][-1]["status"] == e2e.OOM
    assert all(s["status"] == e2e.TRAINED for s in arms["lean/lean"]["sequences"])

    results = e2e.CorpusResult(**{**result, "arms": {n: _arm(a) for n, a in arms.items()}})
    ratios = results.ratios()
    keys = ("adaptive_vs_best_static", "adaptive_vs_megatron", "max_len_ratio", "adaptive_vs_best_per_bucket_max")
    printed = [float(v) for v in last.groups()]
    assert printed == pytest.approx([round(ratios[k], 3) for k in keys], abs=1e-3, nan_ok=True)
    # per power-of-two bin: adaptive over the fastest static arm that trains the whole bin
    adaptive = results.arms[e2e.ADAPTIVE]
    worst = math.nan
    for low in (64, 128, 256, 512):
        inside = [i for i, s in enumerate(adaptive.sequences) if low <= s.tokens < 2 * low]
        whole = [results.arms[n] for n in e2e.PAIRINGS if all(i in results.arms[n].trained() for i in inside)]
        both = [i for i in inside if i in adaptive.trained()]
        if inside and whole and both:
            best = min(sum(a.sequences[i].time_s for i in inside) for a in whole)
            fastest = next(a for a in whole if sum(a.sequences[i].time_s for i in inside) == best)
            ratio = sum(adaptive.sequences[i].time_s for i in both) / sum(fastest.sequences[i].time_s for i in both)
            worst = ratio if math.isnan(worst) else max(worst, ratio)
    assert ratios["adaptive_vs_best_per_bucket_max"] == pytest.approx(worst, nan_ok=True)
    assert re.search(r"^adaptive / the fastest static arm of each length bin: \[", out, re.M)
    static_longest = max(results.arms[n].longest() for n in e2e.PAIRINGS)
    assert ratios["max_len_ratio"] == results.arms[e2e.ADAPTIVE].longest() / static_longest

    # Every arm trains the same model: the same history of trained sequences gives the same loss.
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
    assert compared >= 5  # at least the shortest document, trained by every arm


def test_adaptive_stays_within_budget(run):
    """The planner's predicted peaks hold on the ranks: no adaptive sequence is an OOM."""
    _, result = run
    over = [s for s in result["arms"][e2e.ADAPTIVE]["sequences"] if s["status"] == e2e.OOM]
    assert not over, [(s["tokens"], s["plan"], max(s["peak_bytes"]), s["predicted_peak_bytes"]) for s in over]


def _arm(data: dict) -> e2e.ArmResult:
    return e2e.ArmResult(data["name"], [e2e.SequenceResult(**s) for s in data["sequences"]], data["resident_bytes"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--arms", "tp_sp/tp_sp,adaptive"], "--arms must include lean/lean, megatron"),
        (["--arms", "tp_sp/tp_sp,lean/lean,megatron,adaptive,zz"], "--arms: unknown zz"),
        (["--corpora", "code,wiki"], "--corpora takes code and/or dna, got 'code,wiki'"),
    ],
)
def test_bad_arguments_exit_2_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        e2e.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
