"""Test-session setup shared by every test module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def cache_p2(tmp_path_factory) -> Path:
    """A folder with the code corpus and a quick cost profile for p=2 (``profile.json``; or the one
    ``PARADYSE_TEST_PROFILE`` names), shared by a module's runs."""
    from megatron_paradyse.cost.calibrate import calibrate
    from megatron_paradyse.cost.profile import save_profile
    from megatron_paradyse.data.corpora import build_code_corpus

    path = tmp_path_factory.mktemp("cache")
    build_code_corpus(path)
    profile = os.environ.get("PARADYSE_TEST_PROFILE")
    if profile:
        (path / "profile.json").write_text(Path(profile).read_text())
    else:
        save_profile(calibrate([2], grid="quick", show_progress=False), path / "profile.json")
    return path
