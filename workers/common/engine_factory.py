"""Builds the engine a worker process serves, chosen once at start-up by role.

The default builders (engine_builders.py) map the flags onto the engines' frozen configs; they are
imported lazily so that `deepseek-pd --help` and the servicer tests do not import torch.
`--engine-factory MODULE:FUNC` (or `path/to/file.py:FUNC`) replaces the default: FUNC receives the
`WorkerOptions` and returns a `WorkerEngine`. Tests use it to serve a scripted engine through the
real process, signal and router path.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from deepseek_pd.errors import UserError
from deepseek_pd.workers.common.api import WorkerEngine

ROLES = ("prefill", "decode")

# role -> "module:function" of the engine builder that ships with the package.
DEFAULT_BUILDERS = {
    "prefill": "deepseek_pd.workers.common.engine_builders:build_prefill_engine",
    "decode": "deepseek_pd.workers.common.engine_builders:build_decode_engine",
}


@dataclass(frozen=True)
class ParallelOptions:
    """How one worker spans GPUs and nodes (the operator's LWS-style flags)."""

    tp: int = 1
    dp: int = 1
    ep: int = 1
    deepep_mode: str = "none"
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str = ""

    @property
    def is_single_process(self) -> bool:
        return self.tp == self.dp == self.ep == self.nnodes == 1


@dataclass(frozen=True)
class WorkerOptions:
    """Everything `deepseek-pd serve` was told; engines read what concerns them."""

    role: str
    model_dir: str
    served_model_name: str
    host: str = "127.0.0.1"  # bind address of the gRPC and bootstrap servers
    advertise_host: str = "127.0.0.1"  # the address peers use to reach this worker (pod IP)
    port: int = 30001
    bootstrap_port: int = 8998
    kv_transport: str = "grpc"
    device: str = "cpu"
    dtype: str = "auto"
    page_size: int | None = None  # None: the engine's default
    num_pages: int | None = None  # None: the engine's default
    chunked_prefill_size: int | None = None
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    engine_options: dict = field(default_factory=dict, hash=False)  # --engine-opt KEY=VALUE


EngineBuilder = Callable[[WorkerOptions], WorkerEngine]


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


def builder_for(role: str, override: str | None = None) -> EngineBuilder:
    if role not in ROLES:
        raise UserError(f"unknown worker role {role!r}; choose {' or '.join(ROLES)}")
    return load_builder(override or DEFAULT_BUILDERS[role])
