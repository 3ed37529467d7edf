"""``python -m megatron_paradyse.bench <name> [options]``."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import megatron_paradyse.bench as bench


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_"))
    if not argv or argv[0] not in names:
        print(f"usage: python -m megatron_paradyse.bench {{{','.join(names)}}} [options]", file=sys.stderr)
        return 2
    return importlib.import_module(f"megatron_paradyse.bench.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
