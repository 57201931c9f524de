"""Loading a script of bench/ (not a package) as a module, for its tests."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str) -> Iterator:
    """Yield bench/<name>.py as the module `name`, registered in sys.modules while it is in use
    (dataclasses look their module up) and removed after: the body of a pytest fixture."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]
