"""Constants and conversions of the bootstrap protocol (proto/bootstrap.proto) shared by both sides."""
from __future__ import annotations

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.transfer_limits import MAX_KV_STREAMS
from deepseek_pd.workers.engine.interface import FailureCode

# Bump when a message change would be misread by an older peer; both sides refuse a mismatch.
PROTOCOL_VERSION = 2  # 2: AuthToken on handshake, ack, done and abort
# 3: a pulled mooncake transfer (MooncakeDestination.pull). Only such handshakes carry it, so an
# older prefill worker, which would ignore `pull` and write, refuses them at the handshake, while
# every other handshake stays version 2 and old and new workers keep serving each other. The
# prefill side answers with the version it was offered.
PULL_PROTOCOL_VERSION = 3
ACCEPTED_VERSIONS = (PROTOCOL_VERSION, PULL_PROTOCOL_VERSION)


def handshake_version(handshake: pb.Handshake) -> int:
    """The protocol version a decode worker's handshake goes out with."""
    pulls = handshake.WhichOneof("destination") == "mooncake" and handshake.mooncake.pull
    return PULL_PROTOCOL_VERSION if pulls else PROTOCOL_VERSION


def version_refusal_hint(handshake: pb.Handshake) -> str:
    """What to add to a prefill worker's version refusal of `handshake` (decode's side)."""
    if handshake.protocol_version != PULL_PROTOCOL_VERSION:
        return ""
    return (" (decode reads mooncake KV from the prefill worker, protocol 3; this prefill worker is older "
            "and can only write into decode: upgrade it, or run the decode workers with --engine-opt "
            "mooncake_kv_direction=write until every prefill worker is upgraded)")

# A message adds at most this around a KVChunk's data (at most MAX_CHUNK_BYTES, deepseek_pd/transfer_limits.py);
# both ends size their gRPC message limits from these.
MESSAGE_ENVELOPE_BYTES = 64 << 10

_TO_PB = {
    FailureCode.INVALID_ARGUMENT: pb.FAILURE_CODE_INVALID_ARGUMENT,
    FailureCode.RESOURCE_EXHAUSTED: pb.FAILURE_CODE_RESOURCE_EXHAUSTED,
    FailureCode.DEADLINE_EXCEEDED: pb.FAILURE_CODE_DEADLINE_EXCEEDED,
    FailureCode.UNAVAILABLE: pb.FAILURE_CODE_UNAVAILABLE,
    FailureCode.ABORTED: pb.FAILURE_CODE_ABORTED,
    FailureCode.INTERNAL: pb.FAILURE_CODE_INTERNAL,
}
_FROM_PB = {value: key for key, value in _TO_PB.items()}


def code_to_pb(code: FailureCode) -> int:
    return _TO_PB[code]


def code_from_pb(code: int) -> FailureCode:
    """Unknown (newer) codes map to INTERNAL rather than failing the failure path."""
    return _FROM_PB.get(code, FailureCode.INTERNAL)


def kv_stream_count(offered: int, limit: int) -> int:
    """KV streams of a room: the decode side's offer (0 from an older peer: 1), capped by the
    prefill side's own `grpc_streams`. The prefill side decides it once, in its HandshakeAck."""
    return max(1, min(offered or 1, limit, MAX_KV_STREAMS))


def target(host: str, port: int) -> str:
    """gRPC target of a bootstrap server; IPv6 literals need brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
