"""``bench planner``: the decision latency table and last line, for one stage and for pipeline stages
whose every ``decide`` a rank makes (the figures mean nothing here; the structure does)."""

from __future__ import annotations

import json
import re

from megatron_paradyse.bench.planner import main
from megatron_paradyse.planner import Planner


def test_pipeline_stages_plan_alike_and_one_call_decides_for_every_stage(tmp_path, capsys, monkeypatch):
    deciders = []
    decide = Planner.decide

    def recording(self, *args, **kwargs):
        deciders.append(id(self))
        return decide(self, *args, **kwargs)

    monkeypatch.setattr(Planner, "decide", recording)
    figures = {}
    for stages in (1, 4):
        out = tmp_path / f"{stages}.json"
        args = ["--layers", "8", "--pipeline-stages", str(stages), "--uncached-calls", "3", "--cached-calls", "4"]
        deciders.clear()
        assert main([*args, "--json", str(out)]) == 0
        # the timed calls (3 uncached, 3 to fill the cache, 4 cached) run every stage's planner in turn
        timed = deciders[-10 * stages :]
        assert timed == timed[:stages] * 10 and len(set(timed)) == stages
        lines = capsys.readouterr().out.splitlines()
        assert re.fullmatch(r"planner_us_cached=[0-9.]+ planner_us_uncached=[0-9]+", lines[-1])
        figures[stages] = json.loads(out.read_text())
        assert figures[stages]["layers"] == 8 // stages and figures[stages]["pipeline_stages"] == stages
    assert ("4 pipeline stages alike: a call below is every stage's decide, as every rank makes them") in lines
    # two layers a stage fit longer sequences than eight
    assert figures[4]["longest_feasible"] > figures[1]["longest_feasible"]


def test_layers_that_do_not_split_over_the_stages_are_refused(capsys):
    assert main(["--layers", "6", "--pipeline-stages", "4"]) == 2
    assert capsys.readouterr().err == "error: --layers 6 does not split over --pipeline-stages 4\n"
