"""The chunk wire codec against protobuf itself: same bytes out, same fields in, views not copies."""
from __future__ import annotations

import random

import pytest
from google.protobuf.message import DecodeError

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.transport.wire import (
    ChunkEvent, ChunkHeader, decode_event, encode_chunk_event, serialize_event)


def random_chunk(rng: random.Random) -> tuple[int, ChunkHeader, bytes, int]:
    def value() -> int:  # zero (omitted on the wire) and multi-byte varints both
        return rng.choice([0, rng.randrange(1, 128), rng.randrange(128, 1 << 31)])
    header = ChunkHeader(value(), value(), value(), value())
    data = random.randbytes(rng.choice([0, 1, rng.randrange(2, 5000)]))
    return rng.choice([0, rng.randrange(1, 1 << 40)]), header, data, rng.randrange(1 << 32)


def test_encoded_chunks_are_the_protobuf_encoding():
    rng = random.Random()
    for _ in range(300):
        seq, header, data, crc = random_chunk(rng)
        encoded = encode_chunk_event(seq, header, memoryview(data), crc)
        oracle = pb.TransferEvent(seq=seq, chunk=pb.KVChunk(
            layer_begin=header.layer_begin, layer_end=header.layer_end, page_begin=header.page_begin,
            page_end=header.page_end, data=data, crc32=crc))
        assert serialize_event(encoded) == oracle.SerializeToString()
        assert encoded.payload[encoded.data_offset:encoded.data_offset + encoded.data_len] == data


def test_decoded_chunks_match_protobuf_and_view_the_message():
    rng = random.Random()
    for _ in range(300):
        seq, header, data, crc = random_chunk(rng)
        if not data and rng.random() < 0.5:
            continue
        raw = pb.TransferEvent(seq=seq, chunk=pb.KVChunk(
            layer_begin=header.layer_begin, layer_end=header.layer_end, page_begin=header.page_begin,
            page_end=header.page_end, data=data, crc32=crc)).SerializeToString()
        event = decode_event(raw)
        assert isinstance(event, ChunkEvent) and event.seq == seq and event.WhichOneof("event") == "chunk"
        chunk = event.chunk
        assert (chunk.layer_begin, chunk.layer_end, chunk.page_begin, chunk.page_end, chunk.crc32) == (
            header.layer_begin, header.layer_end, header.page_begin, header.page_end, crc)
        assert bytes(chunk.data) == data and isinstance(chunk.data, memoryview)
        assert chunk.data.obj is raw  # a view into the received message: no copy


def test_other_events_and_unknown_fields_go_through_protobuf():
    rng = random.Random()
    events = [pb.TransferEvent(seq=0, accepted=pb.HandshakeAck(protocol_version=1, credit_window=8)),
              pb.TransferEvent(seq=5, done=pb.TransferDone(first_token_id=rng.randrange(1000), num_pages=3)),
              pb.TransferEvent(seq=9, failed=pb.TransferFailed(code=pb.FAILURE_CODE_INTERNAL, reason="x"))]
    for event in events:
        assert decode_event(event.SerializeToString()) == event
    # A field a newer peer might add to KVChunk (number 15, length-delimited) is skipped.
    data = random.randbytes(64)
    raw = pb.TransferEvent(seq=3, chunk=pb.KVChunk(layer_end=2, page_end=1, data=data, crc32=7)).SerializeToString()
    extra = bytes([15 << 3 | 2, 3]) + b"abc"
    body_start = raw.index(bytes([3 << 3 | 2])) + 1
    length = raw[body_start]
    patched = raw[:body_start] + bytes([length + len(extra)]) + raw[body_start + 1:] + extra
    event = decode_event(patched)
    assert isinstance(event, ChunkEvent) and bytes(event.chunk.data) == data and event.chunk.crc32 == 7
    with pytest.raises(DecodeError):
        decode_event(raw[:-10])  # truncated: protobuf's own error
