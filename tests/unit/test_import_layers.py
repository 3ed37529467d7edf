"""The package's layers import downwards only, and megatron-core only where the Megatron adapter, the
training entry points and the benchmarks are (docs/architecture.md, "Which package may import which");
outside the adapter, a module imports the adapter (which installs the CPU shim) before megatron-core.

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
    ("simulation",),
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

MCORE = "megatron_paradyse.mcore"
"""The adapter: importing it (or any of its modules) installs the CPU shim megatron-core needs first."""


def _layer(part: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if part in names)


def _part(module: str) -> str:
    """The package (or top-level module) of a ``megatron_paradyse`` module name."""
    return module.split(".")[1] if "." in module else "__init__"


def _modules(package: Path) -> list[tuple[str, Path]]:
    """(module name, file) of every module under ``package``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return found


def imports(package: Path = PACKAGE) -> list[tuple[str, str, int]]:
    """(importing module, imported module, line) for every import statement under ``package``."""
    found = []
    for module, path in _modules(package):
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


def _is_megatron(module: str) -> bool:
    return module == "megatron" or module.startswith("megatron.")


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement imports (``from a import b``: ``a`` and ``a.b``, b may be one)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not node.module:
        return []
    return [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]


def _import_scopes(tree: ast.Module) -> list[tuple[int, tuple[ast.AST, ...], list[str]]]:
    """(line, the functions around it, outermost first, the modules imported) for every import statement."""
    found = []

    def visit(node: ast.AST, functions: tuple[ast.AST, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                found.append((child.lineno, functions, _imported(child)))
            inner = functions + (child,) if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else functions
            visit(child, inner)

    visit(tree, ())
    return found


def _is_adapter(module: str) -> bool:
    return module == MCORE or module.startswith(MCORE + ".")


def shim_breaks(package: Path = PACKAGE) -> dict[str, int]:
    """Modules outside ``mcore`` that may import megatron-core before the CPU shim is installed, with the line
    of the first such import: one at module level before any module-level import of ``megatron_paradyse.mcore``
    (or of one of its modules); one inside a function, where the module imports the adapter nowhere at module
    level and the function not before it."""
    breaks = {}
    for module, path in _modules(package):
        if _is_adapter(module):
            continue
        scopes = _import_scopes(ast.parse(path.read_text(), str(path)))
        adapter_lines = [line for line, functions, names in scopes if not functions and any(map(_is_adapter, names))]
        shim_line = min(adapter_lines, default=None)
        for line, functions, names in sorted(scopes, key=lambda scope: scope[0]):
            if not any(map(_is_megatron, names)):
                continue
            if not functions:
                shimmed = shim_line is not None and shim_line < line
            else:  # the function runs after the module's imports, or imported the adapter itself before
                shimmed = shim_line is not None or any(
                    earlier < line and scope and scope[0] is functions[0] and any(map(_is_adapter, imported))
                    for earlier, scope, imported in scopes
                )
            if not shimmed:
                breaks[module] = line
                break
    return breaks


def test_every_module_is_in_a_layer():
    parts = {_part(".".join(path.relative_to(ROOT).with_suffix("").parts)) for path in PACKAGE.rglob("*.py")}
    assert parts == {part for names in LAYERS for part in names}


def test_layers_import_downwards_and_megatron_behind_its_door():
    breaks = sorted(f"{a} -> {b} (line {line})" for (a, b), line in layer_breaks(imports()).items())
    assert not breaks, "imports against the layer order (docs/architecture.md):\n" + "\n".join(breaks)


def test_megatron_after_the_cpu_shim():
    breaks = sorted(f"{module} (line {line})" for module, line in shim_breaks().items())
    assert not breaks, (
        "megatron-core imported before megatron_paradyse.mcore (the CPU shim) is (docs/architecture.md):\n"
        + "\n".join(breaks)
    )


def test_an_import_against_the_order_is_found(tmp_path):
    """The checker itself: a strategy module that imports the planner, or megatron-core, is a break."""
    bad = tmp_path / "megatron_paradyse" / "strategies" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("def f():\n    from megatron_paradyse.planner import Planner\n    import megatron.core\n")
    assert layer_breaks(imports(tmp_path / "megatron_paradyse")) == {
        ("megatron_paradyse.strategies.bad", "megatron_paradyse.planner"): 2,
        ("megatron_paradyse.strategies.bad", "megatron.core"): 3,
    }


def test_megatron_before_the_shim_is_found(tmp_path):
    """The checker itself: megatron-core before the adapter at module level, or in a function of a module
    that imports the adapter nowhere, is a break; after it, or after the function's own, is not."""
    run = tmp_path / "megatron_paradyse" / "run"
    run.mkdir(parents=True)
    (run / "early.py").write_text("import torch\nimport megatron.core\nfrom megatron_paradyse.mcore import compat\n")
    (run / "lazy.py").write_text("def f():\n    from megatron.core import parallel_state\n")
    (run / "after.py").write_text("from megatron_paradyse.mcore.spec import x\nfrom megatron.core import y\n")
    (run / "lazy_after.py").write_text(
        "def f():\n    from megatron_paradyse.mcore import compat\n    from megatron.training import get_args\n"
    )
    (run / "late.py").write_text("def f():\n    import megatron.core\n\n\nfrom megatron_paradyse.mcore import compat\n")
    assert shim_breaks(tmp_path / "megatron_paradyse") == {
        "megatron_paradyse.run.early": 2,
        "megatron_paradyse.run.lazy": 2,
    }
