"""Same plan on every rank, and the start-up check that ranks plan from the same inputs, on 3 gloo ranks.

One launch runs every case; each agreement case is one all-gather that every rank reaches, and every
rank must return the same outcome: the agreed digest, or the same error naming the ranks that differ.
Spawned ranks hash strings with different seeds, so a plan that depended on set order would differ.
"""

from __future__ import annotations

import dataclasses
import random
import re

import pytest

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.planner import PlannerConfig
from megatron_paradyse.run.agreement import RankDisagreement, check_ranks_agree, config_digest

from helpers.planner_cost_models import physical_planner

WORLD = 3


def _cases(rank: int, world_size: int, profiles: dict[str, str]) -> dict[str, str]:
    """Outcome of each case on this rank: ``ok <digest>`` or the error message."""
    config = PlannerConfig()
    cases = {
        "agree": (config, [profiles["a"]]),
        "config": (dataclasses.replace(config, hysteresis=0.1) if rank == 2 else config, [profiles["a"]]),
        "profile": (config, [profiles["b" if rank == 1 else "a"]]),
        "missing": (config, [profiles["missing" if rank == 0 else "a"]]),
        "no profile": ({"planner": {"hysteresis": 0.05}, "layers": [1, 2]}, []),
    }
    outcomes = {"plans": _plans()}
    for name, (cfg, paths) in cases.items():
        try:
            outcomes[name] = f"ok {check_ranks_agree(cfg, paths)}"
        except RankDisagreement as e:
            outcomes[name] = str(e)
    return outcomes


def _plans() -> str:
    """Every decision of a 24-option planner along 40 lengths, without any communication."""
    p = 8
    planner = physical_planner(num_layers=32, budget_bytes=60 * 2**30, p=p, on_infeasible="skip")
    rng = random.Random(0)
    decisions = [planner.decide(SequenceLayout.build(rng.randint(1, 2**19), p, causal=True)) for _ in range(40)]
    return "\n".join(d.plan.compact() if d else "skip" for d in decisions)


@pytest.fixture(scope="module")
def profiles(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("profiles")
    (folder / "a.json").write_text('{"gemm": 1.0}')
    (folder / "b.json").write_text('{"gemm": 2.0}')
    return {"a": str(folder / "a.json"), "b": str(folder / "b.json"), "missing": str(folder / "gone.json")}


@pytest.fixture(scope="module")
def outcomes(profiles) -> list[dict[str, str]]:
    return run_on_ranks(_cases, WORLD, args=(profiles,), timeout_s=120)


def _same_on_every_rank(outcomes: list[dict[str, str]], case: str) -> str:
    messages = {o[case] for o in outcomes}
    assert len(messages) == 1, messages
    return messages.pop()


def test_every_rank_plans_the_same_without_talking(outcomes):
    plans = _same_on_every_rank(outcomes, "plans")
    assert len(set(plans.splitlines())) > 3  # the lengths cover several different plans


def test_ranks_that_agree_get_the_same_digest(outcomes):
    for case in ("agree", "no profile"):
        assert re.fullmatch(r"ok [0-9a-f]{64}", _same_on_every_rank(outcomes, case))


def test_a_rank_with_another_config_is_named(outcomes):
    message = _same_on_every_rank(outcomes, "config")
    assert re.fullmatch(
        r"ranks would plan from different inputs: the config differs: ranks \[0, 1\] have [0-9a-f]{12}; "
        r"ranks \[2\] have [0-9a-f]{12}\. Give every rank the same config file and overrides, the same profile "
        r"files and the same megatron-paradyse version",
        message,
    )


def test_a_rank_with_another_profile_is_named(outcomes):
    message = _same_on_every_rank(outcomes, "profile")
    assert "the cost profile differs: ranks [0, 2] have" in message and "ranks [1] have" in message
    assert "config differs" not in message


def test_a_rank_that_cannot_read_its_profile_fails_every_rank_without_hanging(outcomes, profiles):
    message = _same_on_every_rank(outcomes[1:], "missing")
    assert re.fullmatch(
        r"ranks would plan from different inputs: the cost profile differs: ranks \[0\] have [0-9a-f]{12}; ranks "
        r"\[1, 2\] have [0-9a-f]{12}; ranks \[0\] could not read their cost profile\. Give every rank .*",
        message,
    )
    missing = profiles["missing"]
    unreadable = f"; this rank could not read {missing}: [Errno 2] No such file or directory: '{missing}'. Give"
    assert outcomes[0]["missing"] == message.replace(". Give", unreadable, 1)


def test_config_digest_is_canonical_and_refuses_opaque_objects():
    assert config_digest({"a": 1, "b": [1.5, None]}) == config_digest({"b": (1.5, None), "a": 1})
    assert config_digest(PlannerConfig()) != config_digest(PlannerConfig(hysteresis=0.1))
    with pytest.raises(ValueError, match=r"cannot hash a config holding object"):
        config_digest({"model": object()})
