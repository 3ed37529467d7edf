"""Bad input is refused early and clearly: a start-up failure on any rank stops every rank within seconds,
with one message (rank 0's) naming the rank and the cause.

The ranks are started as ``srun`` starts them (:mod:`helpers.job_ranks`), one plain process each, with
nobody to kill the others when one exits: torchrun would end them itself and hide a rank left waiting for
the distributed timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml

from megatron_paradyse import pretrain_gpt
from megatron_paradyse.cli import main as paradyse
from megatron_paradyse.data import write_documents

from helpers import entry_point
from helpers.job_ranks import Job, launch

SMALL_GPT = [
    *entry_point.SMALL_GPT,
    "--tensor-model-parallel-size",
    "2",
    "--global-batch-size",
    "1",
    "--train-iters",
    "2",
]
SPREAD_S = 5.0
"""How far apart the ranks' exits may be: the others must not outlive the failing rank by more than this."""


def _launch(nproc: int, args: Callable[[int], list[str]], folder: Path) -> Job:
    """Rank ``r`` runs ``python -m megatron_paradyse.pretrain_gpt *args(r)``; no process it started may
    outlive the ranks."""
    job = launch(nproc, lambda rank: ["-m", "megatron_paradyse.pretrain_gpt", *args(rank)], folder, timeout=180)
    assert not job.left, f"processes the ranks started still run after them: {job.left}"
    return job


def _assert_every_rank_stops(job: Job, message: str) -> None:
    """Every rank exits with status 2 within ``SPREAD_S`` of the first; rank 0 alone prints ``message``."""
    for rank, result in enumerate(job.ranks):
        assert result.code == 2, f"rank {rank}: exit {result.code}\n{result.err[-3000:]}"
        assert "Traceback" not in result.err, f"rank {rank}:\n{result.err[-3000:]}"
    first, *others = job.ranks
    assert first.err.endswith(f"paradyse: error: {message}\n"), first.err[-3000:]
    assert all("paradyse: error" not in r.err for r in others), [r.err[-500:] for r in others]
    times = [r.at for r in job.ranks]
    assert max(times) - min(times) < SPREAD_S, f"exits spread over {max(times) - min(times):.1f} s"


def _config(folder: Path, **sections) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = {"memory": {"budget_gib": 1.0}, "data": {"dataset": "code", "cache_dir": str(folder / "cache")}}
    data.update(sections)
    path = folder / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_profile_that_is_not_json_on_one_rank_of_four_stops_every_rank(tmp_path, quick_profile_p2):
    configs = []
    for rank in range(4):
        folder = tmp_path / f"rank{rank}"
        folder.mkdir()
        shutil.copy(quick_profile_p2, folder / "profile.json")
        configs.append(_config(folder, cost={"profile": "profile.json", "check_machine": False}))
    broken = tmp_path / "rank2" / "profile.json"
    broken.write_text(quick_profile_p2.read_text()[:-40])
    with pytest.raises(json.JSONDecodeError) as why:
        json.loads(broken.read_text())
    flags = [*SMALL_GPT, "--global-batch-size", "2"]  # TP=2 x DP=2
    results = _launch(4, lambda rank: ["--paradyse-config", str(configs[rank]), *flags], tmp_path / "ranks")
    _assert_every_rank_stops(
        results,
        f"rank 2: cost profile {broken} is not valid JSON ({why.value}); recalibrate with `paradyse calibrate` "
        "(every rank of 4 stops)",
    )


def test_a_config_one_rank_cannot_read_and_a_bad_profile_value_stop_every_rank(tmp_path, quick_profile_p2):
    config = _config(tmp_path / "ok", cost={"profile": str(quick_profile_p2), "check_machine": False})
    missing = tmp_path / "missing" / "cfg.yaml"
    results = _launch(
        2, lambda rank: ["--paradyse-config", str(config if rank == 0 else missing), *SMALL_GPT], tmp_path / "ranks"
    )
    _assert_every_rank_stops(
        results,
        f"rank 1: cannot read the paradyse config {missing}: No such file or directory (every rank of 2 stops)",
    )

    config, message = _bad_profile_values(tmp_path / "bad", quick_profile_p2)
    results = _launch(2, lambda rank: ["--paradyse-config", str(config), *SMALL_GPT], tmp_path / "bad-profile-ranks")
    _assert_every_rank_stops(results, message)


def test_token_ids_outside_the_vocabulary_stop_every_rank(tmp_path, quick_profile_p2):
    config, message = _ids_outside_the_vocabulary(tmp_path, quick_profile_p2)
    results = _launch(2, lambda rank: ["--paradyse-config", str(config), *SMALL_GPT], tmp_path / "ranks")
    _assert_every_rank_stops(results, message)


def test_a_dataset_path_with_no_files_is_refused_before_any_process_group(tmp_path, quick_profile_p2, capsys):
    config, message = _no_dataset_there(tmp_path, quick_profile_p2)
    assert pretrain_gpt.main(["--paradyse-config", str(config), *SMALL_GPT]) == 2
    assert capsys.readouterr().err == f"paradyse: error: {message}\n"


def test_datasets_with_nothing_to_train_on_stop_every_rank(tmp_path, quick_profile_p2):
    """An empty dataset on rank 0, one of one-token documents on rank 1: each rank's problem is named."""
    cases = [case(tmp_path / f"rank{rank}", quick_profile_p2) for rank, case in enumerate(NOTHING_TO_TRAIN_ON)]
    results = _launch(2, lambda rank: ["--paradyse-config", str(cases[rank][0]), *SMALL_GPT], tmp_path / "ranks")
    _assert_every_rank_stops(results, f"rank 0: {cases[0][1]}; rank 1: {cases[1][1]} (every rank of 2 stops)")


def test_check_config_stops_on_what_the_job_stops_on(tmp_path, quick_profile_p2, capsys):
    """Every bad input above that every rank of a job stops on, ``paradyse check-config`` refuses, on this
    machine, in the job's words."""
    for name, case in BAD_INPUTS.items():
        config, message = case(tmp_path / name, quick_profile_p2)
        with pytest.raises(SystemExit) as exit_status:
            paradyse(["check-config", str(config), "--", *SMALL_GPT])
        assert exit_status.value.code == 2, name
        stopped = f"{config}: its job would stop at start-up (on a machine without CUDA): {message}"
        assert capsys.readouterr() == ("", f"paradyse: error: {stopped}\n"), name


def test_a_misspelt_megatron_flag_is_one_line_from_rank_0_not_megatrons_usage(tmp_path):
    config = _config(tmp_path)
    results = _launch(
        2, lambda rank: ["--paradyse-config", str(config), *SMALL_GPT, "--num-layer", "2"], tmp_path / "ranks"
    )
    _assert_every_rank_stops(results, "--num-layer: not a Megatron flag; did you mean --num-layers?")
    assert not any("usage:" in r.out + r.err for r in results.ranks), [r.err[-500:] for r in results.ranks]


# -- bad inputs: (config, what the job says) --------------------------------------------------------
def _bad_profile_values(folder: Path, profile: Path) -> tuple[Path, str]:
    data = json.loads(profile.read_text())
    data["attention"]["forward"]["causal"]["per_call_s"] = "fast"
    data["collectives"]["2"]["all_gather"]["per_byte_s"] = float("nan")
    folder.mkdir(parents=True)
    bad = folder / "bad-profile.json"
    bad.write_text(json.dumps(data))
    return _config(folder, cost={"profile": str(bad), "check_machine": False}), (
        f"cost profile {bad} has values a cost model cannot use: attention.forward.causal.per_call_s must be a "
        "number, got 'fast'; collectives.2.all_gather.per_byte_s must be finite, got nan; recalibrate with "
        "`paradyse calibrate`"
    )


def _dataset_config(folder: Path, profile: Path, documents: list, *, vocab_size: int = 100) -> tuple[Path, Path]:
    """(a config training on ``documents``, written with a byte tokenizer's manifest of ``vocab_size``
    ids, its dataset's prefix)."""
    prefix = folder / "data" / "docs"
    write_documents(prefix, documents, vocab_size=256)
    manifest = {"tokenizer": "byte", "vocab_size": vocab_size, "eod_id": vocab_size - 1, "pad_id": vocab_size - 2}
    Path(f"{prefix}.json").write_text(json.dumps(manifest))
    cost = {"profile": str(profile), "check_machine": False}
    return _config(folder, cost=cost, data={"dataset": str(prefix), "max_len": 1024}), prefix


def _ids_outside_the_vocabulary(folder: Path, profile: Path) -> tuple[Path, str]:
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 100, size=n) for n in (300, 500, 700)]
    documents[1][123] = 130  # one id past the vocabulary of 100 the manifest gives
    config, prefix = _dataset_config(folder, profile, documents)
    return config, (
        f"dataset {prefix}: document 1 has token id 130 (at its token 123), outside the tokenizer's vocabulary "
        "[0, 100); prepare the dataset with the tokenizer the run uses (--tokenizer-type, --vocab-size, or the "
        "dataset's manifest)"
    )


def _no_dataset_there(folder: Path, profile: Path) -> tuple[Path, str]:
    prefix = folder / "data" / "typo"
    cost = {"profile": str(profile), "check_machine": False}
    return _config(folder, cost=cost, data={"dataset": str(prefix)}), (
        f"data.dataset: no dataset at {prefix}: neither {prefix}.bin nor {prefix}.idx exists (a dataset is named "
        f"by the path of its .bin and .idx files without the suffix); nor is '{prefix}' a built-in corpus (code, dna)"
    )


def _empty_dataset(folder: Path, profile: Path) -> tuple[Path, str]:
    config, prefix = _dataset_config(folder, profile, [np.zeros(0, dtype=np.int64)] * 3)
    return config, (
        f"the dataset {prefix} has no tokens (3 documents, every one empty): prepare it again from texts that are "
        "not empty, or name another dataset"
    )


def _one_token_documents(folder: Path, profile: Path) -> tuple[Path, str]:
    config, prefix = _dataset_config(folder, profile, [np.array([7])] * 5)
    return config, (
        f"the dataset {prefix}: each of its 5 documents is shorter than 2 tokens, and a token is learnt from the "
        "one before it: there is nothing to train on"
    )


NOTHING_TO_TRAIN_ON = (_empty_dataset, _one_token_documents)
BAD_INPUTS = {
    "profile values": _bad_profile_values,
    "vocabulary": _ids_outside_the_vocabulary,
    "no dataset": _no_dataset_there,
    "empty dataset": _empty_dataset,
    "one-token documents": _one_token_documents,
}
"""What every rank of a job refuses alike, checked by the job (the tests above) and by check-config."""


def test_a_rank_whose_timeout_flag_is_bad_joins_the_others_with_the_defaults_to_say_so():
    """Megatron's parser refuses the value (the problem this rank reports); the rank's own reading of it
    must not print a usage and exit before the others hear of it."""
    from megatron_paradyse.run.startup import distributed_settings

    bad = ["--distributed-backend", "gloo", "--distributed-timeout-minutes", "abc"]
    assert distributed_settings(bad)[1] == datetime.timedelta(minutes=10)


def test_a_rank_leaves_its_process_groups_when_its_work_ends_without_a_failure():
    """Destroyed on a return and on Megatron's ``--exit-interval`` exit (status 0); kept after a failure, where
    destroying a gloo group would wait for a collective the other ranks may never join (one gloo rank)."""
    import torch.distributed as dist

    from megatron_paradyse.run.startup import leaving_process_groups

    def joined() -> None:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def work(*, then: BaseException | None) -> None:
        with leaving_process_groups():
            if then is not None:
                raise then

    try:
        for failure in (RuntimeError("a collective failed"), SystemExit(1), KeyboardInterrupt()):
            joined()
            with pytest.raises(type(failure)):
                work(then=failure)
            assert dist.is_initialized(), failure
            dist.destroy_process_group()
        for end in (None, SystemExit(0), SystemExit(None)):
            joined()
            with pytest.raises(SystemExit) if end is not None else contextlib.nullcontext():
                work(then=end)
            assert not dist.is_initialized(), end
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
