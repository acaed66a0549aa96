"""KV transports between prefill and decode workers, chosen by name when a worker is built.

`build_sender(name, pool, config)` on the prefill side and `build_receiver(...)` on the decode
side; the contract is in `base.py`. Names: "fake" (in-process, tests), "grpc" (KV on the
bootstrap stream), "mooncake" (one-sided writes, TCP or RDMA). The mooncake module is imported
only when chosen, since it needs libibverbs.
"""
from __future__ import annotations

import importlib

from deepseek_pd.errors import UserError
from deepseek_pd.model.kv_pool import KVPool
from deepseek_pd.workers.common.kv_transfer.base import (
    KVReceiver, KVSender, KVSink, SendChannel, TransportConfig)
from deepseek_pd.workers.common.kv_transfer.plan import SendPlan

# name -> (module, sender class, receiver class)
_REGISTRY: dict[str, tuple[str, str, str]] = {
    "fake": ("fake", "FakeSender", "FakeReceiver"),
    "grpc": ("grpc_stream", "GrpcSender", "GrpcReceiver"),
    "mooncake": ("mooncake", "MooncakeSender", "MooncakeReceiver"),
}

TRANSPORT_NAMES = tuple(_REGISTRY)


def _load(name: str, which: int) -> type:
    if name not in _REGISTRY:
        raise UserError(f"unknown KV transport {name!r}; choose one of {', '.join(_REGISTRY)}")
    entry = _REGISTRY[name]
    module = importlib.import_module(f"{__name__}.{entry[0]}")
    return getattr(module, entry[which])


def build_sender(name: str, pool: KVPool, config: TransportConfig) -> KVSender:
    """The prefill worker's side of transport `name`, bound to its pool."""
    return _load(name, 1)(pool, config)


def build_receiver(name: str, pool: KVPool, config: TransportConfig) -> KVReceiver:
    """The decode worker's side of transport `name`, bound to its pool."""
    return _load(name, 2)(pool, config)


__all__ = ["KVReceiver", "KVSender", "KVSink", "SendChannel", "SendPlan", "TransportConfig",
           "TRANSPORT_NAMES", "build_receiver", "build_sender"]
