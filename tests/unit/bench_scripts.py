"""The benchmark scripts, imported for their unit tests (benchmarks/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str) -> ModuleType:
    """Import benchmarks/NAME.py under a unique module name (tests/chaos has its own report.py), once."""
    module_name = f"bench_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    # Some scripts put benchmarks/ first on sys.path for their siblings; last, it still serves them without
    # its lightning.py shadowing Lightning's own ``lightning`` package for the rest of the session.
    if str(BENCHMARKS) in sys.path:
        sys.path.remove(str(BENCHMARKS))
        sys.path.append(str(BENCHMARKS))
    return module
