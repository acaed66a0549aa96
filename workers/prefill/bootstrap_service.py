"""The prefill worker's bootstrap server: one room per PD request, met by both sides.

The router sends Generate to prefill and decode at the same time, so either may arrive first:

- the prefill engine `claim`s the room when its Generate arrives and waits for the handshake;
- the decode side's `Transfer` call `attach`es its handshake and waits for the claim.

Whichever waits too long fails cleanly (prefill: DEADLINE_EXCEEDED for its request; decode: a
TransferFailed on its stream). After both meet, the room's events (KV chunks for the grpc
transport, then TransferDone) flow to decode in order through a bounded queue; a failure
overtakes queued chunks. If the decode side goes away (stream cancelled, connection lost, Abort),
`peer_gone` fires and the prefill engine fails its request with UNAVAILABLE or ABORTED.

The pieces: `room.py` (one room and its `TransferPhase`s), `room_registry.py` (claims, handshakes,
tombstones), `bootstrap_servicer.py` (the `Transfer` stream and a room's extra `KVStream`s); this
module hosts them on the port.
"""
from __future__ import annotations

import logging

import grpc

from deepseek_pd.errors import UserError
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.transport.bootstrap_protocol import MESSAGE_ENVELOPE_BYTES
from deepseek_pd.workers.transport.wire import serialize_event
from deepseek_pd.workers.metrics.worker_metrics import WorkerMetrics
from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig
from deepseek_pd.workers.prefill.bootstrap_servicer import BootstrapServicer
from deepseek_pd.workers.prefill.room import Room, TransferPhase
from deepseek_pd.workers.prefill.room_registry import RoomRegistry

log = logging.getLogger(__name__)

_SERVICE = "deepseek_pd.pd.v1.Bootstrap"


def _handlers(servicer: BootstrapServicer) -> grpc.GenericRpcHandler:
    """The generated handlers, except that Transfer's events go through `serialize_event`, which
    passes KV chunks the sender already encoded (`wire.py`) straight to gRPC."""
    return grpc.method_handlers_generic_handler(_SERVICE, {
        "Transfer": grpc.stream_stream_rpc_method_handler(
            servicer.Transfer, request_deserializer=pb.DecodeMessage.FromString,
            response_serializer=serialize_event),
        "KVStream": grpc.stream_stream_rpc_method_handler(
            servicer.KVStream, request_deserializer=pb.KVStreamMessage.FromString,
            response_serializer=serialize_event),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort, request_deserializer=pb.AbortRoom.FromString,
            response_serializer=pb.AbortAck.SerializeToString),
        "Route": grpc.unary_unary_rpc_method_handler(
            servicer.Route, request_deserializer=pb.RouteRequest.FromString,
            response_serializer=pb.RouteReply.SerializeToString),
    })


class BootstrapServer:
    """The gRPC server that hosts `BootstrapServicer` on the bootstrap port."""

    def __init__(self, registry: RoomRegistry, config: BootstrapConfig, max_message_bytes: int,
                 advertise_host: str = "", kv_streams: int = 1, metrics: WorkerMetrics | None = None) -> None:
        """`advertise_host`: the address decode workers dial (tokens must name it or `config.host`);
        `kv_streams`: the most parallel KV streams per room (grpc transport's `grpc_streams`);
        `metrics`: where refused handshakes are counted (the engine's)."""
        self.registry = registry
        self.config = config
        # Chunks are capped at TransportConfig.max_chunk_bytes; leave headroom for the envelope.
        options = [("grpc.max_send_message_length", max_message_bytes + MESSAGE_ENVELOPE_BYTES),
                   ("grpc.max_receive_message_length", 16 << 20),  # a handshake lists every page id
                   ("grpc.so_reuseport", 0)]  # a second worker on this port must fail, not share it
        self.server = grpc.aio.server(options=options)
        wildcard = config.host in ("0.0.0.0", "::", "")
        hosts = tuple(h for h in {config.host, advertise_host} if h) if not wildcard else (
            (advertise_host,) if advertise_host else ())
        if hosts:  # () means any host; else the aliases count too
            hosts = tuple(dict.fromkeys((*hosts, *config.aliases)))
        servicer = self.servicer = BootstrapServicer(registry, hosts, kv_streams, metrics)
        self.server.add_generic_rpc_handlers((_handlers(servicer),))
        try:  # grpc raises RuntimeError on a busy port (older versions returned 0)
            self.port = self.server.add_insecure_port(f"{config.host}:{config.port}")
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise UserError(f"bootstrap server cannot listen on {config.host}:{config.port} "
                            f"(in use? choose another --bootstrap-port)")
        servicer.port = self.port

    async def start(self) -> None:
        await self.server.start()
        log.info("bootstrap server listening on %s:%d (%s)", self.config.host, self.port,
                 "handshakes authenticated by the deployment secret" if self.config.auth.enabled
                 else "INSECURE: handshakes not authenticated")

    async def stop(self, grace_s: float | None = None) -> None:
        await self.server.stop(grace_s)


__all__ = ["BootstrapServer", "BootstrapServicer", "Room", "RoomRegistry", "TransferPhase"]
