"""Fixtures every test module may use, and the layers: each folder under tests/ is a layer and gives its
tests the marker of its name (``pytest -m "unit or ranks"``: the fast lane; docs/testing.md)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
from pathlib import Path

import pytest

import megatron_paradyse.mcore  # noqa: F401  (records the strategies' memory from their code)

# Rank processes are forked from a server that imported these once (megatron_paradyse.core.multiprocess).
# The server finds them on PYTHONPATH: Python 3.11's fork server does not take the caller's sys.path.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
multiprocessing.set_forkserver_preload(["helpers.rank_imports"])

LAYERS = ("unit", "ranks", "megatron", "e2e", "gpu")


def pytest_collection_modifyitems(config, items) -> None:
    root = Path(__file__).resolve().parent
    for item in items:
        layer = Path(item.fspath).resolve().relative_to(root).parts[0]
        if layer not in LAYERS:
            raise pytest.UsageError(f"{item.nodeid}: a test belongs in one of the layers {', '.join(LAYERS)}")
        item.add_marker(layer)


@pytest.fixture(scope="session")
def quick_profile_p2(tmp_path_factory) -> Path:
    """A quick cost profile for p=2, calibrated once for the whole run (or the one
    ``PARADYSE_TEST_PROFILE`` names): for runs that need a valid profile, not a calibration."""
    from megatron_paradyse.calibration.calibrate import calibrate
    from megatron_paradyse.cost.profile import save_profile

    profile = os.environ.get("PARADYSE_TEST_PROFILE")
    if profile:
        return Path(profile)
    path = tmp_path_factory.mktemp("profile") / "p2.json"
    save_profile(calibrate([2], grid="quick", show_progress=False), path)
    return path


@pytest.fixture(scope="module")
def cache_p2(tmp_path_factory, quick_profile_p2) -> Path:
    """A folder with the code corpus and the quick cost profile for p=2 (``profile.json``), shared by a
    module's runs."""
    from megatron_paradyse.data.corpora import build_code_corpus

    path = tmp_path_factory.mktemp("cache")
    build_code_corpus(path)
    shutil.copy(quick_profile_p2, path / "profile.json")
    return path
