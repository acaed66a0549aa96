"""`TransferEvent`s that carry a `KVChunk`, encoded and parsed without copying the KV bytes.

The bytes on the wire are exactly the protobuf encoding of `TransferEvent{seq, chunk: KVChunk}`
(any protobuf peer parses them), but going through the generated classes costs four copies of
every chunk: building the message, `SerializeToString`, `FromString` and reading `.data`. Here:

- `encode_chunk_event` writes the message in one `bytes.join` straight from the staging buffer
  (a worker thread does it, so the event loop only hands the bytes to gRPC);
- `decode_event` (the client's response deserializer) returns a `ChunkEvent` whose `chunk.data`
  is a `memoryview` into the received message, and leaves every other event to protobuf.

Example: seq=3, layers [0, 27), pages [4, 6), 4 data bytes, crc 0x1234 is
`08 03 | 1a 0d | 10 1b 18 04 20 06 | 2a 04 <data> | 30 b4 24` (a zero field is omitted, as protobuf
does: layer_begin=0 is not written).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from deepseek_pd.proto import bootstrap_pb2 as pb

_VARINT, _LEN = 0, 2
_CHUNK_FIELDS = ("layer_begin", "layer_end", "page_begin", "page_end")  # field numbers 1..4


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _packed(field: int, values: Sequence[int]) -> bytes:
    body = b"".join(_varint(value) for value in values)
    return _tag(field, _LEN) + _varint(len(body)) + body


@dataclass(frozen=True)
class ChunkHeader:
    """Where a chunk's data goes: layers [layer_begin, layer_end) x request pages [page_begin, page_end)."""

    layer_begin: int
    layer_end: int
    page_begin: int
    page_end: int


@dataclass
class EncodedChunk:
    """A chunk event ready for the wire; `payload[data_offset:data_offset+data_len]` is the KV.

    `stream`: the room's KV stream it goes on (0: the Transfer stream); `seq` counts on that stream.
    """

    seq: int
    header: ChunkHeader
    crc32: int
    payload: bytes
    data_offset: int
    data_len: int
    stream: int = 0
    # The KV bytes this chunk accounts for: `data_len`, or for a chunk written directly into the
    # decode pool (no data on the wire) the cells' bytes.
    kv_bytes: int = 0

    def SerializeToString(self) -> bytes:  # noqa: N802 - the name gRPC's serializer calls on protobufs
        return self.payload


def encode_chunk_event(seq: int, header: ChunkHeader, data, crc32: int, stream: int = 0,
                       direct_bytes: int = 0, source_slots: Sequence[int] = ()) -> EncodedChunk:
    """`data`: any buffer (bytes, memoryview of a staging tensor); copied once, into the payload.

    `direct_bytes` > 0: the cells (that many bytes) were already copied into the decode pool; the
    chunk carries no `data` and only tells the decode side they are there (`written_directly`).
    `source_slots`: a pulled mooncake chunk's send-staging slots (packed, as protobuf packs them)."""
    size = memoryview(data).nbytes
    fields = bytearray()
    for number, name in enumerate(_CHUNK_FIELDS, start=1):
        value = getattr(header, name)
        if value:
            fields += _tag(number, _VARINT) + _varint(value)
    data_prefix = _tag(5, _LEN) + _varint(size) if size else b""
    suffix = ((_tag(6, _VARINT) + _varint(crc32) if crc32 else b"")
              + (_tag(7, _VARINT) + b"\x01" if direct_bytes else b"")
              + (_packed(8, source_slots) if source_slots else b""))
    body_len = len(fields) + len(data_prefix) + size + len(suffix)
    prefix = ((_tag(1, _VARINT) + _varint(seq) if seq else b"") + _tag(3, _LEN) + _varint(body_len)
              + bytes(fields) + data_prefix)
    payload = b"".join((prefix, memoryview(data).cast("B") if size else b"", suffix))
    return EncodedChunk(seq, header, crc32, payload, len(prefix), size, stream, direct_bytes or size)


@dataclass(frozen=True)
class ChunkView:
    """A received `KVChunk` whose `data` is a view into the message (duck-types `pb.KVChunk`)."""

    layer_begin: int
    layer_end: int
    page_begin: int
    page_end: int
    data: memoryview
    crc32: int
    written_directly: bool = False
    source_slots: tuple[int, ...] = ()


@dataclass(frozen=True)
class ChunkEvent:
    seq: int
    chunk: ChunkView

    def WhichOneof(self, group: str) -> str:  # noqa: N802 - mirrors the protobuf API
        return "chunk"


ReceivedEvent = Union[pb.TransferEvent, ChunkEvent]


class _Malformed(Exception):
    pass


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Malformed
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _skip(buf: memoryview, pos: int, end: int, wire_type: int) -> int:
    if wire_type == _VARINT:
        return _read_varint(buf, pos, end)[1]
    if wire_type == 1:
        pos += 8
    elif wire_type == _LEN:
        length, pos = _read_varint(buf, pos, end)
        pos += length
    elif wire_type == 5:
        pos += 4
    else:
        raise _Malformed
    if pos > end:
        raise _Malformed
    return pos


def _parse_chunk(buf: memoryview, pos: int, end: int) -> ChunkView:
    values = {name: 0 for name in _CHUNK_FIELDS}
    data, crc, direct, slots = buf[0:0], 0, False, []
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        field, wire_type = key >> 3, key & 7
        if 1 <= field <= 4 and wire_type == _VARINT:
            values[_CHUNK_FIELDS[field - 1]], pos = _read_varint(buf, pos, end)
        elif field == 5 and wire_type == _LEN:
            length, pos = _read_varint(buf, pos, end)
            if pos + length > end:
                raise _Malformed
            data, pos = buf[pos:pos + length], pos + length
        elif field == 6 and wire_type == _VARINT:
            crc, pos = _read_varint(buf, pos, end)
        elif field == 7 and wire_type == _VARINT:
            flag, pos = _read_varint(buf, pos, end)
            direct = bool(flag)
        elif field == 8 and wire_type == _LEN:  # packed, as protobuf writes it
            length, pos = _read_varint(buf, pos, end)
            stop = pos + length
            if stop > end:
                raise _Malformed
            while pos < stop:
                slot, pos = _read_varint(buf, pos, stop)
                slots.append(slot)
        elif field == 8 and wire_type == _VARINT:  # unpacked: protobuf parsers accept both
            slot, pos = _read_varint(buf, pos, end)
            slots.append(slot)
        else:  # a field a newer peer added: skip it, as protobuf would
            pos = _skip(buf, pos, end, wire_type)
    return ChunkView(data=data, crc32=crc & 0xFFFFFFFF, written_directly=direct,
                     source_slots=tuple(slot & 0xFFFFFFFF for slot in slots), **values)


def decode_event(raw: bytes) -> ReceivedEvent:
    """The client's response deserializer: chunk events as views, anything else via protobuf."""
    buf = memoryview(raw)
    seq, chunk, pos, end = 0, None, 0, len(raw)
    try:
        while pos < end:
            key, pos = _read_varint(buf, pos, end)
            field, wire_type = key >> 3, key & 7
            if field == 1 and wire_type == _VARINT:
                seq, pos = _read_varint(buf, pos, end)
            elif field == 3 and wire_type == _LEN and chunk is None:
                length, pos = _read_varint(buf, pos, end)
                if pos + length > end:
                    raise _Malformed
                chunk, pos = _parse_chunk(buf, pos, pos + length), pos + length
            else:
                return pb.TransferEvent.FromString(raw)  # not (only) a chunk: protobuf decides
    except _Malformed:
        return pb.TransferEvent.FromString(raw)  # raises protobuf's own DecodeError
    if chunk is None:
        return pb.TransferEvent.FromString(raw)
    return ChunkEvent(seq & 0xFFFFFFFFFFFFFFFF, chunk)


def serialize_event(event: pb.TransferEvent | EncodedChunk) -> bytes:
    """The server's response serializer: protobuf events, or chunks encoded by the sender."""
    return event.SerializeToString()
