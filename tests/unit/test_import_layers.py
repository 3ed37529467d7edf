"""The package's layers import downwards only, and megatron-core only where the Megatron adapter, the
training entry points and the benchmarks are (docs/architecture.md, "Layers").

Every import statement counts, at module level or inside a function, ``TYPE_CHECKING`` ones included:
a function-level import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers.paths import ROOT

PACKAGE = ROOT / "megatron_paradyse"

LAYERS = (
    ("core",),
    ("attention",),
    ("strategies",),
    ("cost",),
    ("planner",),
    ("config",),
    ("mcore",),
    ("data",),
    ("calibration",),
    ("run",),
    ("cli", "spec", "pretrain_gpt", "bench", "__init__"),
)
"""Lowest first: a module may import its own package and the layers below its own."""

IMPORT_MEGATRON = {"mcore", "run", "pretrain_gpt", "bench"}
"""The Megatron adapter, the training entry points, the benchmarks."""


def _layer(part: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if part in names)


def _part(module: str) -> str:
    """The package (or top-level module) of a ``megatron_paradyse`` module name."""
    return module.split(".")[1] if "." in module else "__init__"


def imports(package: Path = PACKAGE) -> list[tuple[str, str, int]]:
    """(importing module, imported module, line) for every import statement under ``package``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(module, alias.name, node.lineno) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.append((module, node.module, node.lineno))
    return found


def layer_breaks(found: list[tuple[str, str, int]]) -> dict[tuple[str, str], int]:
    """Imports of a higher layer, or of megatron-core outside :data:`IMPORT_MEGATRON`, by (from, to)."""
    breaks = {}
    for module, target, line in found:
        if target == "megatron" or target.startswith("megatron."):
            if _part(module) not in IMPORT_MEGATRON:
                breaks[(module, target)] = line
        elif target.startswith("megatron_paradyse."):
            source, imported = _part(module), _part(target)
            if source != imported and _layer(imported) >= _layer(source):
                breaks[(module, target)] = line
    return breaks


def test_every_module_is_in_a_layer():
    parts = {_part(".".join(path.relative_to(ROOT).with_suffix("").parts)) for path in PACKAGE.rglob("*.py")}
    assert parts == {part for names in LAYERS for part in names}


def test_layers_import_downwards_and_megatron_behind_its_door():
    breaks = sorted(f"{a} -> {b} (line {line})" for (a, b), line in layer_breaks(imports()).items())
    assert not breaks, "imports against the layer order (docs/architecture.md):\n" + "\n".join(breaks)


def test_an_import_against_the_order_is_found(tmp_path):
    """The checker itself: a strategy module that imports the planner, or megatron-core, is a break."""
    bad = tmp_path / "megatron_paradyse" / "strategies" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("def f():\n    from megatron_paradyse.planner import Planner\n    import megatron.core\n")
    assert layer_breaks(imports(tmp_path / "megatron_paradyse")) == {
        ("megatron_paradyse.strategies.bad", "megatron_paradyse.planner"): 2,
        ("megatron_paradyse.strategies.bad", "megatron.core"): 3,
    }
