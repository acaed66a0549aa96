"""`serve --engine-factory MODULE:FUNC` (or `path/to/file.py:FUNC`): a TEST HOOK, not a plug-in API.

It replaces the role's default engine builder (deepseek_pd.workers.serve.builders) with FUNC, which
receives the resolved `ServeConfig` and the process's `WorkerMetrics` and returns a `WorkerEngine`.
Tests use it to serve a scripted engine (tests/support/pdtest/servicer_fakes.py:build_fake_engine)
through the real process, signal and router path without loading a model. Production never sets it.
"""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Callable

from deepseek_pd.errors import UserError
from deepseek_pd.workers.engine.interface import WorkerEngine
from deepseek_pd.workers.metrics.worker_metrics import WorkerMetrics
from deepseek_pd.workers.serve.config import ServeConfig

EngineBuilder = Callable[[ServeConfig, WorkerMetrics], WorkerEngine]


def load_builder(spec: str) -> EngineBuilder:
    """Resolves "module:function" or "file.py:function"; a clear UserError if it is not there."""
    target, sep, func_name = spec.rpartition(":")
    if not sep or not target or not func_name:
        raise UserError(f"engine factory {spec!r} must look like 'package.module:function'")
    try:
        if target.endswith(".py"):
            path = Path(target)
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            if module_spec is None or not path.exists():
                raise ModuleNotFoundError(f"no file {path}")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ModuleNotFoundError as exc:
        raise UserError(f"engine factory {spec!r} is not available: {exc}") from exc
    builder = getattr(module, func_name, None)
    if not callable(builder):
        raise UserError(f"engine factory {spec!r}: {target} has no function {func_name!r}")
    return builder
