"""KV transports between prefill and decode workers, chosen by name when a worker is built.

`build_sender(name, pool, config)` on the prefill side and `build_receiver(...)` on the decode
side; the contract is in `base.py`. The registries (`KV_SENDERS`, `KV_RECEIVERS`) hold "fake"
(in-process, tests), "grpc" (KV on the bootstrap stream) and "mooncake" (one-sided writes, TCP or
RDMA). Importing the mooncake module needs nothing beyond this project: it imports the Mooncake
library (which needs libibverbs) only when a Mooncake engine is built.
"""
from __future__ import annotations

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model.registry import Registry
from deepseek_pd.workers.transport import fake, grpc_stream, mooncake
from deepseek_pd.workers.transport.base import (
    KVReceiver, KVSender, KVSink, SendChannel, TransportConfig)
from deepseek_pd.workers.transport.plan import SendPlan

KV_SENDERS: Registry[KVSender] = Registry("KV transport")
KV_RECEIVERS: Registry[KVReceiver] = Registry("KV transport")
for _name, _sender, _receiver in (("fake", fake.FakeSender, fake.FakeReceiver),
                                  ("grpc", grpc_stream.GrpcSender, grpc_stream.GrpcReceiver),
                                  ("mooncake", mooncake.MooncakeSender, mooncake.MooncakeReceiver)):
    KV_SENDERS.register(_name)(_sender)
    KV_RECEIVERS.register(_name)(_receiver)

TRANSPORT_NAMES = tuple(KV_SENDERS.names())


def build_sender(name: str, pool: KVPool, config: TransportConfig) -> KVSender:
    """The prefill worker's side of transport `name`, bound to its pool."""
    return KV_SENDERS.build(name, pool, config)


def build_receiver(name: str, pool: KVPool, config: TransportConfig) -> KVReceiver:
    """The decode worker's side of transport `name`, bound to its pool."""
    return KV_RECEIVERS.build(name, pool, config)


__all__ = ["KV_RECEIVERS", "KV_SENDERS", "KVReceiver", "KVSender", "KVSink", "SendChannel", "SendPlan",
           "TransportConfig", "TRANSPORT_NAMES", "build_receiver", "build_sender"]
