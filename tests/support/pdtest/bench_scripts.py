"""The scripts under bench/ as modules, for tests that reuse their helpers (checkpoint writers,
py-spy lookup). bench/ is a folder of scripts, not a package: each is loaded from its path once."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[3] / "bench"


def bench_module(name: str) -> ModuleType:
    """bench/<name>.py, imported under the name `bench_<name>` (cached in sys.modules)."""
    module_name = f"bench_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, BENCH_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None, f"no bench script {name!r} in {BENCH_DIR}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before exec: dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module
