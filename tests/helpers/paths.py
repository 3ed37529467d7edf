"""Where things are, from the repository root."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
SCRIPTS = ROOT / "scripts"
HELPERS = Path(__file__).resolve().parent
