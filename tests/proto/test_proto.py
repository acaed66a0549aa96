"""Our bootstrap proto: committed generated code is current, and wire numbers never change."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deepseek_pd.proto import bootstrap_pb2 as pb

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def test_regenerating_gives_the_committed_files(tmp_path):
    result = subprocess.run(["bash", str(ROOT / "scripts/gen_proto.sh"), str(tmp_path)],
                            env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr
    generated = sorted(p.name for p in tmp_path.iterdir())
    assert generated == ["bootstrap_pb2.py", "bootstrap_pb2.pyi", "bootstrap_pb2_grpc.py"]
    for name in generated:
        committed = (ROOT / "proto" / name).read_text()
        assert (tmp_path / name).read_text() == committed, f"proto/{name} is stale: run scripts/gen_proto.sh"
    grpc_code = (tmp_path / "bootstrap_pb2_grpc.py").read_text()
    assert "from deepseek_pd.proto import bootstrap_pb2" in grpc_code
    assert "\nimport bootstrap_pb2" not in grpc_code


# Wire numbers of protocol version 1. Adding fields is fine; changing any of these breaks peers.
FROZEN = {
    "Handshake": {"protocol_version": 1, "room": 2, "decode_rid": 3, "num_tokens": 4, "page_ids": 5,
                  "layout": 6, "grpc": 10, "mooncake": 11, "fake": 12},
    "DecodeMessage": {"handshake": 1, "credit": 2},
    "Credit": {"received_seq": 1},
    "KVLayout": {"num_layers": 1, "page_size": 2, "kv_dim": 3, "dtype": 4},
    "MooncakeDestination": {"session_id": 1, "layer_base_addrs": 2, "page_bytes": 3},
    "TransferEvent": {"seq": 1, "accepted": 2, "chunk": 3, "done": 4, "failed": 5},
    "KVChunk": {"layer_begin": 1, "layer_end": 2, "page_begin": 3, "page_end": 4, "data": 5, "crc32": 6},
    "TransferDone": {"first_token_id": 1, "first_token_logprob": 2, "num_pages": 3, "cached_tokens": 4,
                     "bytes_sent": 5, "generator_state": 6},
    "TransferFailed": {"code": 1, "reason": 2},
    "HandshakeAck": {"protocol_version": 1, "prefill_rid": 2, "credit_window": 3},
}


@pytest.mark.parametrize("message", sorted(FROZEN))
def test_field_numbers_are_frozen(message):
    descriptor = getattr(pb, message).DESCRIPTOR
    numbers = {field.name: field.number for field in descriptor.fields}
    for name, number in FROZEN[message].items():
        assert numbers.get(name) == number, f"{message}.{name} must keep field number {number}"


def test_messages_round_trip_through_the_wire_format():
    handshake = pb.Handshake(protocol_version=1, room=-5, page_ids=[3, 1, 2], num_tokens=9,
                             layout=pb.KVLayout(num_layers=2, page_size=4, kv_dim=576, dtype="bfloat16"))
    handshake.mooncake.session_id = "10.0.0.1:12345"
    handshake.mooncake.layer_base_addrs.extend([1 << 40, (1 << 40) + 4096])
    again = pb.Handshake.FromString(handshake.SerializeToString())
    assert again == handshake and again.WhichOneof("destination") == "mooncake"
