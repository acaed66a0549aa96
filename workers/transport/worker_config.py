"""A PD worker's settings besides its model runner (frozen), built once from flags (workers/serve/
resolution.py) and passed down the role engines' constructors: its KV transport and the bootstrap
channel (this folder's) and its scheduler's limits (workers/engine/scheduler_config.py). It lives with
the transports, which use the engine's types, so that the engine core knows no transport."""
from __future__ import annotations

from dataclasses import dataclass, field

from deepseek_pd.errors import UserError
from deepseek_pd.workers.engine.scheduler_config import SchedulerConfig
from deepseek_pd.workers.transport.base import TransportConfig
from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a prefill or decode engine needs besides the model runner."""

    kv_transport: str = "grpc"  # a name from TRANSPORT_NAMES (workers/transport/__init__.py)
    transport: TransportConfig = field(default_factory=TransportConfig)
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        from deepseek_pd.workers.transport import TRANSPORT_NAMES
        if self.kv_transport not in TRANSPORT_NAMES:
            raise UserError(f"unknown KV transport {self.kv_transport!r}; choose one of {', '.join(TRANSPORT_NAMES)}")
